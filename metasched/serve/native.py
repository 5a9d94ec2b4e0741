"""The native API: ``POST /v1/actions`` (the dispatcher's request JSON), ``GET
/v1/actions/{id}``, ``POST /v1/trajectories/{name}/close``, ``GET /v1/status``, ``GET
/v1/health``, ``GET /v1/ping`` and the Prometheus ``GET /metrics``.

``POST /v1/actions`` answers once the request is durable (journaled): ``202`` with
``{"id", "status": "queued"}``, or, with ``?wait=<seconds>``, ``200`` with the result if
it finishes within that time. A request the dispatcher rejects (bad input) is ``422``
with its result (``status: "rejected"``, ``reason`` naming the field). ``GET
/v1/actions/{id}`` answers ``{"id", "status": "queued" | "running"}`` or the result
(``status`` ``done``, ``failed`` or ``rejected``), and ``404`` for an unknown id; it too
takes ``?wait=<seconds>`` (long polling). ``POST /v1/actions/{id}/cancel`` (or
``DELETE /v1/actions/{id}``) cancels an action: dropped if it waits, its command killed if
it runs; its result's ``status`` is then ``cancelled``. A client that disconnects while
its ``POST /v1/actions?wait=`` waits cancels its action the same way (a ``GET`` that
disconnects does not: a reader leaving says nothing of the action). With authentication
on, a trajectory is its opening client's (:mod:`metasched.serve.ownership`): another
client's action in it or close of it is ``403``, its results (and cancelling its
actions) ``404``. An ``api`` request's ``http.url`` must lie under its endpoint's
configured url (:mod:`metasched.serve.targets`; else ``422``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from metasched.errors import ConfigError
from metasched.runtime.requests import REJECTED, Result
from metasched.runtime.requests import Request as ActionRequest
from metasched.serve.bodies import JSONRoute, decode_json
from metasched.serve.context import context_from
from metasched.serve.deadlines import DEADLINE_PARAM, header_deadline
from metasched.serve.disconnect import Gone, unless_disconnected
from metasched.serve.openapi import (
    GATED,
    OPEN,
    TRAJECTORY_HEADERS,
    ActionPending,
    CancelAnswer,
    ErrorDetail,
    Health,
    TrajectoryClosing,
    responses,
)
from metasched.serve.ownership import with_scoped_prompt
from metasched.serve.security import CLIENT
from metasched.serve.targets import check_http_target

if TYPE_CHECKING:
    from metasched.serve.service import Service

__all__ = ["MAX_WAIT_S", "error", "native_router", "read_json", "result_response"]

MAX_WAIT_S = 3600.0  # the longest one long poll waits (a client polls again after it)


def error(status: int, detail: str) -> JSONResponse:
    """A one-line error answer: ``{"detail": "<field>: <problem>"}``."""
    return JSONResponse({"detail": detail}, status_code=status)


async def read_json(request: Request) -> Any:
    """The request's JSON body (see :func:`~metasched.serve.bodies.decode_json`).

    Raises:
        ConfigError: the body is not JSON, nests too deep or holds a lone surrogate
            (named ``body``).
    """
    return decode_json(await request.body())


def _inlined(schema: dict[str, Any]) -> dict[str, Any]:
    """A JSON schema with its ``$defs`` written where they are referred to (an OpenAPI
    document resolves ``#/$defs/...`` from its own root, not the embedded schema's)."""
    defs = schema.pop("$defs", {})

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return walk(defs[ref.rsplit("/", 1)[1]])
            return {k: walk(v) for k, v in node.items()}
        return [walk(v) for v in node] if isinstance(node, list) else node

    return walk(schema)


def result_response(result: Result, status: int = 200) -> Response:
    """A result as the JSON the dispatcher's journal holds (values JSON cannot hold are
    written as their repr)."""
    return Response(result.to_json(), status_code=status, media_type="application/json")


async def _wait(future: asyncio.Future[Result], wait_s: float) -> Result | None:
    if wait_s <= 0 and not future.done():
        return None
    try:
        # shield: a client that gives up waiting does not cancel the request.
        return await asyncio.wait_for(asyncio.shield(future), wait_s)
    except asyncio.TimeoutError:
        return None


def native_router(service: Service) -> APIRouter:
    """The routes of the native API (see the module docstring)."""
    router = APIRouter(route_class=JSONRoute)
    wait_query = Query(0.0, ge=0.0, le=MAX_WAIT_S,
                       description="seconds to wait for the result before answering")

    @router.get("/v1/ping", responses=responses(*OPEN))
    async def ping() -> str:
        """Liveness, as SandboxFusion answers it."""
        return "pong"

    @router.get("/v1/health", responses=responses(*OPEN, s200=Health,
                                                  s503=Health | ErrorDetail))
    async def health() -> JSONResponse:
        """200 once the dispatcher runs and the languages are probed; 503 before."""
        if not service.ready:
            return JSONResponse({"status": "starting"}, status_code=503)
        return JSONResponse({"status": "ok", "scheduler": service.dispatcher.stats()
                             ["scheduler"]})

    @router.get("/v1/status", responses=responses(*GATED))
    async def status() -> JSONResponse:
        """Pools, queue, utilisation and the policy in use."""
        return JSONResponse(service.status())

    @router.get("/metrics", response_class=Response, responses={
        **responses(*GATED), 200: {"description": "the metrics", "content": {
            "text/plain": {"schema": {"type": "string"}}}}})
    async def metrics() -> Response:
        """Prometheus metrics (text exposition format)."""
        return Response(generate_latest(service.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    # The body is read as JSON and merged with the trajectory headers before the request
    # schema checks it (in the dispatcher, as every front door's): documented here.
    body_schema = {"requestBody": {"required": True, "content": {"application/json": {
        "schema": _inlined(ActionRequest.model_json_schema())}}},
        "parameters": [*TRAJECTORY_HEADERS, DEADLINE_PARAM]}

    @router.post("/v1/actions", openapi_extra=body_schema, responses=responses(
        *GATED, 403, 422, s200=Result, s202=ActionPending, s422=Result | ErrorDetail))
    async def submit(request: Request, wait: float = wait_query) -> Response:
        """Submit one request; with ``wait``, its result if it finishes by then (202:
        queued, not finished yet). A request the dispatcher rejects is 422 with its
        result (``status: rejected``); a body that is not a request, 422 with one
        line."""
        try:
            doc = await read_json(request)
            if not isinstance(doc, dict):
                raise ConfigError("body", f"must be a JSON object (a request; got "
                                  f"{type(doc).__name__})")
            ctx = context_from(request.headers)
            wait_s = header_deadline(request.headers)
        except ConfigError as e:
            return error(422, str(e))
        doc = {**ctx.fields(), **doc}
        if wait_s is not None:  # the body's deadline_s wins (metasched.serve.deadlines)
            doc.setdefault("deadline_s", wait_s)
        rid = doc.setdefault("id", uuid.uuid4().hex)
        try:
            check_http_target(doc, service.config.upstreams)
        except ConfigError as e:  # rejected as the dispatcher rejects (never accepted)
            now = time.time()
            return result_response(Result(str(rid), REJECTED, str(e), queued_at=now,
                                          finished_at=now), 422)
        client = request.scope.get(CLIENT)
        try:
            trajectory = doc.get("trajectory")
            service.owners.claim(None if trajectory is None else str(trajectory), client)
            service.owners.submitted(str(rid), client)
        except ConfigError as e:
            return error(403, str(e))
        future = await service.dispatcher.enqueue(with_scoped_prompt(doc, client))
        if isinstance(rid, str):  # any other id is rejected (a result saying so)
            service.track(rid, future, doc.get("kind"))
        try:
            result = await (_wait(future, wait) if wait <= 0 or not isinstance(rid, str)
                            else unless_disconnected(
                                request, _wait(future, wait),
                                lambda: service.cancel(rid, "disconnect")))
        except Gone:
            return error(499, "client disconnected: its action was cancelled")
        if result is None:
            return JSONResponse({"id": rid, "status": "queued"}, status_code=202)
        return result_response(result, 422 if result.status == REJECTED else 200)

    @router.post("/v1/trajectories/{name}/close", responses=responses(
        *GATED, 403, 422, s200=TrajectoryClosing))
    async def close_trajectory(name: str, request: Request) -> JSONResponse:
        """End trajectory ``name`` as its reward action would: its sandbox and workspace
        go once nothing of it is queued or running. With authentication on, only the
        client that opened it may (403 for another)."""
        try:
            service.owners.check_close(name, request.scope.get(CLIENT))
        except ConfigError as e:
            return error(403, str(e))
        service.dispatcher.close_trajectory(name)
        return JSONResponse({"trajectory": name, "status": "closing"})

    async def cancel(rid: str, request: Request) -> JSONResponse:
        """Cancel action ``rid``: dropped if it is queued, its command killed if it runs
        (its result then says ``cancelled``). Answers ``{"id", "status"}``: ``cancelled``
        (ended now), ``cancelling`` (killed; its result follows), ``finished`` (it had
        ended: nothing done) or ``running`` (an api call or a gpu service batch, which
        runs to its end); 404 for an id not known here (or another client's)."""
        if not service.owners.may_read(rid, request.scope.get(CLIENT)):
            return error(404, f"id: {rid!r} is not known here")
        state, result, _ = await service.submissions.lookup(rid)
        if state == "unknown":
            return error(404, f"id: {rid!r} is not known here")
        done = result is not None  # its result is kept here (the dispatcher may not know it)
        answer = "finished" if done else service.cancel(rid, "request")
        return JSONResponse({"id": rid, "status": "finished" if answer == "unknown"
                             else answer})

    for method, path in (("POST", "/v1/actions/{rid}/cancel"), ("DELETE", "/v1/actions/{rid}")):
        router.add_api_route(path, cancel, methods=[method],
                             responses=responses(*GATED, 404, s200=CancelAnswer),
                             summary="Cancel an action")

    @router.get("/v1/actions/{rid}", responses=responses(
        *GATED, 404, 422, s200=Result | ActionPending))
    async def lookup(rid: str, request: Request, wait: float = wait_query) -> Response:
        """A request's result, or that it is queued or running (with ``wait``: once it
        finishes, if it does by then); 404 for an id not known here (or, with
        authentication on, another client's)."""
        if not service.owners.may_read(rid, request.scope.get(CLIENT)):
            return error(404, f"id: {rid!r} is not known here")
        state, result, future = await service.submissions.lookup(rid)
        if result is None and future is not None:
            result = await _wait(future, wait)
            if result is None:
                state, result, _ = await service.submissions.lookup(rid)
        if result is not None:
            return result_response(result)
        if state == "unknown":
            return error(404, f"id: {rid!r} is not known here")
        return JSONResponse({"id": rid, "status": state})

    return router
