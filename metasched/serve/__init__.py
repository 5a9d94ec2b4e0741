"""``metasched-serve``: the HTTP service in front of one dispatcher.

- ``POST /run_code``: SandboxFusion's contract (what verl's and SkyRL's sandbox clients
  post), each request run as the dispatcher's actions in a trajectory's sandbox, and
  ``POST /run_jupyter``, its notebook cells in a kernel kept per trajectory;
- the native API (``/v1/actions``, cancelling one, ``/v1/status``, ``/v1/health``,
  ``/v1/ping``) and Prometheus ``/metrics``; a client that disconnects cancels what it
  waits for;
- the API-quota proxy (``/v1/endpoints/<name>/...``), which holds each endpoint's RPM,
  TPM and concurrency across every worker that uses the service.

``create_app(dispatcher, ServeConfig(...))`` builds the ASGI application; see
``docs/apps/serve.md``.
"""

from metasched.serve.app import create_app
from metasched.serve.config import ServeConfig, Upstream
from metasched.serve.server import BackgroundServer, serve
from metasched.serve.service import Service

__all__ = ["BackgroundServer", "ServeConfig", "Service", "Upstream", "create_app", "serve"]
