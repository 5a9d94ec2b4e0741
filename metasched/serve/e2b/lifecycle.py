"""E2B's sandbox lifecycle API (the REST calls an SDK sends to ``E2B_API_URL``), under
the service's ``/e2b`` prefix: create (``POST /sandboxes``, ``/v2/sandboxes``), list
(``GET /sandboxes``, ``/v2/sandboxes``), get (``GET /sandboxes/{id}``), kill
(``DELETE``), set the timeout (``POST .../timeout``, ``.../refreshes``) and connect
(``POST .../connect``, ``/v2/...``). Pause and resume answer 501: a sandbox's processes
cannot be checkpointed here.

With authentication on, each call carries a client's token as its API key
(``X-API-Key``, as the SDK sends ``E2B_API_KEY``), and a client sees and acts on its own
sandboxes only (another's is 404). Errors are E2B's: ``{"code", "message"}``.
"""

from __future__ import annotations

import hmac
import inspect
import time
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from metasched.errors import ConfigError
from metasched.serve.bodies import decode_json
from metasched.serve.e2b.sandboxes import (
    DEFAULT_TEMPLATE,
    DEFAULT_TIMEOUT_S,
    MAX_TIMEOUT_S,
    Busy,
    Sandbox,
    Sandboxes,
)
from metasched.serve.e2b.sdk1_door import DOOR

if TYPE_CHECKING:
    from metasched.serve.service import Service

__all__ = ["e2b_error", "lifecycle_router"]


def e2b_error(status: int, message: str) -> JSONResponse:
    """An error as E2B's API answers it."""
    return JSONResponse({"code": status, "message": message}, status_code=status)


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def client_of(service: Service, request: Request) -> str | None:
    """The client whose token the request carries as its API key (None: authentication
    off).

    Raises:
        _Refused: authentication is on and the key is missing or wrong (401).
    """
    clients = service.config.clients
    if not clients:
        return None
    given = (request.headers.get("x-api-key") or "").encode()
    bearer = request.headers.get("authorization", "")
    if bearer.startswith("Bearer "):
        given = given or bearer[7:].encode()
    found = None
    for token, name in clients.items():  # all of them: the time tells nothing
        if hmac.compare_digest(given, token.encode()):
            found = name
    if found is None:
        raise _Refused(401, "missing or wrong API key (X-API-Key: the service's token; "
                       "set E2B_API_KEY)")
    return found


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        doc = decode_json(raw)
    except ConfigError as e:
        raise _Refused(400, str(e)) from None
    if not isinstance(doc, dict):
        raise _Refused(400, "body: must be a JSON object")
    return doc


def _timeout(doc: dict[str, Any], default: float | None) -> float | None:
    value = doc.get("timeout", default)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) \
            or not 0 <= value <= MAX_TIMEOUT_S:
        raise _Refused(400, f"timeout: must be seconds from 0 to {MAX_TIMEOUT_S} "
                       f"(got {value!r})")
    return float(value)


def _strings(doc: dict[str, Any], key: str) -> dict[str, str]:
    value = doc.get(key) or {}
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and "\0" not in k + v
            for k, v in value.items()):
        raise _Refused(400, f"{key}: must map strings to strings")
    return value


def lifecycle_router(service: Service, sandboxes: Sandboxes) -> APIRouter:
    """The lifecycle routes (see the module docstring), to mount under ``/e2b``."""
    router = APIRouter(include_in_schema=False)

    def find(request: Request, sandbox_id: str) -> Sandbox:
        sb = sandboxes.get(sandbox_id, client_of(service, request))
        if sb is None:
            raise _Refused(404, f"sandbox {sandbox_id!r} not found")
        return sb

    def answer(fn: Any) -> Any:
        async def route(request: Request, **kw: Any) -> Response:
            try:
                return await fn(request, **kw)
            except _Refused as e:
                return e2b_error(e.status, e.message)
        route.__name__ = fn.__name__
        route.__signature__ = inspect.signature(fn)  # type: ignore[attr-defined]
        return route

    async def create(request: Request) -> Response:
        client = client_of(service, request)
        doc = await _body(request)
        template = doc.get("templateID", DEFAULT_TEMPLATE) or DEFAULT_TEMPLATE
        if not isinstance(template, str):
            raise _Refused(400, "templateID: must be a string")
        if doc.get("autoPause"):
            raise _Refused(400, "autoPause: pausing is not supported here")
        timeout = _timeout(doc, DEFAULT_TIMEOUT_S)
        try:
            sb = await sandboxes.create(
                template=template, timeout_s=timeout or DEFAULT_TIMEOUT_S, client=client,
                metadata=_strings(doc, "metadata"), env=_strings(doc, "envVars"),
                door=bool(request.scope.get(DOOR)))
        except ValueError as e:
            raise _Refused(400, str(e)) from None
        except Busy as e:
            raise _Refused(503, str(e)) from None
        return JSONResponse(sb.created(), status_code=201)

    async def listing(request: Request) -> Response:
        client = client_of(service, request)
        wanted = request.query_params.get("metadata")
        states = request.query_params.getlist("state")
        pairs: dict[str, str] = {}
        if wanted:
            from urllib.parse import parse_qsl
            pairs = dict(parse_qsl(wanted))
        out = [sb.info() for sb in sandboxes.listed(client)
               if all(sb.metadata.get(k) == v for k, v in pairs.items())
               and (not states or "running" in states)]
        return JSONResponse(out)

    async def get(request: Request, sandbox_id: str) -> Response:
        sb = find(request, sandbox_id)
        info = sb.info()
        if sb.token is not None:
            info["envdAccessToken"] = sb.token
        return JSONResponse(info)

    async def kill(request: Request, sandbox_id: str) -> Response:
        sandboxes.kill(find(request, sandbox_id))
        return Response(status_code=204)

    async def timeout(request: Request, sandbox_id: str) -> Response:
        sb = find(request, sandbox_id)
        value = _timeout(await _body(request), None)
        if value is None:
            raise _Refused(400, "timeout: required (seconds)")
        sandboxes.set_timeout(sb, value)
        return Response(status_code=204)

    async def refresh(request: Request, sandbox_id: str) -> Response:
        sb = find(request, sandbox_id)
        doc = await _body(request)
        value = _timeout({"timeout": doc.get("duration", DEFAULT_TIMEOUT_S)}, None)
        sandboxes.set_timeout(sb, max(value or 0.0, sb.end_at - time.time()))
        return Response(status_code=204)

    async def connect(request: Request, sandbox_id: str) -> Response:
        sb = find(request, sandbox_id)
        value = _timeout(await _body(request), None)
        if value is not None:
            sandboxes.set_timeout(sb, value)
        return JSONResponse(sb.created(), status_code=200)

    async def metrics(request: Request, sandbox_id: str) -> Response:
        find(request, sandbox_id)
        return JSONResponse([])  # none kept per sandbox (see /metrics for the service)

    async def pause(request: Request, sandbox_id: str) -> Response:
        find(request, sandbox_id)
        raise _Refused(501, "pause: not supported by metasched (a sandbox's processes "
                       "cannot be checkpointed); kill it and create another")

    async def resume(request: Request, sandbox_id: str) -> Response:
        raise _Refused(404, f"sandbox {sandbox_id!r} not found (metasched does not pause "
                       f"sandboxes, so none can be resumed)")

    for path in ("/sandboxes", "/v2/sandboxes"):
        router.add_api_route(path, answer(create), methods=["POST"])
        router.add_api_route(path, answer(listing), methods=["GET"])
    router.add_api_route("/sandboxes/{sandbox_id}", answer(get), methods=["GET"])
    router.add_api_route("/sandboxes/{sandbox_id}", answer(kill), methods=["DELETE"])
    router.add_api_route("/sandboxes/{sandbox_id}/timeout", answer(timeout), methods=["POST"])
    router.add_api_route("/sandboxes/{sandbox_id}/refreshes", answer(refresh),
                         methods=["POST"])
    for path in ("/sandboxes/{sandbox_id}/connect", "/v2/sandboxes/{sandbox_id}/connect"):
        router.add_api_route(path, answer(connect), methods=["POST"])
    router.add_api_route("/sandboxes/{sandbox_id}/metrics", answer(metrics), methods=["GET"])
    router.add_api_route("/sandboxes/{sandbox_id}/pause", answer(pause), methods=["POST"])
    router.add_api_route("/sandboxes/{sandbox_id}/resume", answer(resume), methods=["POST"])
    return router
