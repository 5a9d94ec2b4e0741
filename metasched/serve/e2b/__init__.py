"""An E2B-compatible sandbox API, under the service's ``/e2b`` prefix: point an E2B SDK
at it with ``E2B_API_URL`` and ``E2B_SANDBOX_URL`` both ``http://<host>:<port>/e2b``
(and ``E2B_API_KEY``: the service's token, or anything with authentication off).

- the lifecycle REST API (:mod:`.lifecycle`): create, list, get, kill, timeouts;
- envd's Connect RPC services (:mod:`.process`, :mod:`.filesystem`) and its file
  transfer (``/files``), routed by the ``E2b-Sandbox-Id`` header the SDK sends with
  ``E2B_SANDBOX_URL`` set, checked against the sandbox's access token
  (``X-Access-Token``) when authentication is on;
- the code interpreter of E2B's ``code-interpreter-v1`` template (:mod:`.interpreter`):
  ``/execute`` and ``/contexts``, each context a kernel in the sandbox.

Each sandbox is a trajectory of the dispatcher, each command and file call one of its
actions (:mod:`.sandboxes`). It needs the ``connectrpc``, ``protobuf-py`` and
``python-multipart`` packages (``pip install metasched[e2b]``); without them the service
runs without ``/e2b``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastapi import FastAPI

    from metasched.serve.service import Service

__all__ = ["PREFIX", "mount_e2b"]

PREFIX = "/e2b"
log = logging.getLogger("metasched.serve")


def mount_e2b(app: FastAPI, service: Service) -> bool:
    """Add the E2B API to ``app`` under :data:`PREFIX`; False (and one log line) when
    its packages are not installed."""
    try:
        from python_multipart import MultipartParser  # noqa: F401 - uploads' parser

        from metasched.serve.e2b.envd.filesystem_connect import FilesystemASGIApplication
        from metasched.serve.e2b.envd.process_connect import ProcessASGIApplication
    except ImportError as e:
        log.info("E2B API (/e2b) off: %s (pip install 'metasched[e2b]')", e)
        return False
    from metasched.serve.e2b.filesystem import FilesystemService, files_router
    from metasched.serve.e2b.interpreter import Interpreter, interpreter_router
    from metasched.serve.e2b.lifecycle import lifecycle_router
    from metasched.serve.e2b.process import ProcessService
    from metasched.serve.e2b.sandboxes import Sandboxes

    sandboxes = Sandboxes(service)
    app.state.e2b = sandboxes
    app.include_router(lifecycle_router(service, sandboxes), prefix=PREFIX)
    app.include_router(files_router(sandboxes), prefix=PREFIX)
    app.include_router(interpreter_router(Interpreter(sandboxes)), prefix=PREFIX)
    max_bytes = service.config.max_body_bytes
    rpc = {"/process.Process/": ProcessASGIApplication(
               ProcessService(sandboxes), read_max_bytes=max_bytes),  # type: ignore[arg-type]
           "/filesystem.Filesystem/": FilesystemASGIApplication(
               FilesystemService(sandboxes), read_max_bytes=max_bytes)}  # type: ignore[arg-type]

    async def envd(scope: Any, receive: Any, send: Any) -> None:
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        for prefix, rpc_app in rpc.items():
            if path.startswith(prefix):
                await rpc_app(scope, receive, send)
                return
        body = b'{"code": 404, "message": "not found"}'
        await send({"type": "http.response.start", "status": 404, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    app.mount(PREFIX, envd)
    return True
