"""The OpenAI-compatible front door's routes: ``POST /v1/chat/completions`` and
``POST /v1/completions``, streamed (``"stream": true``, server-sent events) or not,
forwarded to the ``generation`` setting's vLLM or SGLang replicas by
:class:`~metasched.serve.generation_door.GenerationDoor` (priority, affinity, trace).

The trajectory comes from the headers ``/run_code`` reads (``X-Trajectory-Id``,
``X-Turn``, ``X-Task``, ``X-Prompt-Id``); without them a request is its own and is not
stamped. The body is checked only for what the door reads (the models below); every
other field passes to the replica as sent.
"""

from __future__ import annotations

import time
from typing import Any

import aiohttp
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.background import BackgroundTask

from metasched.errors import ConfigError, validation_error
from metasched.serve.context import context_from
from metasched.serve.generation_door import Generation, GenerationDoor, count_tokens
from metasched.serve.native import error, read_json
from metasched.serve.openapi import GATED, TRAJECTORY_HEADERS, responses
from metasched.serve.security import CLIENT
from metasched.serve.service import Service

__all__ = ["ChatCompletionRequest", "CompletionRequest", "openai_router"]

# Response headers not relayed: the hop's own (the door's server sets them).
_HOP = {"content-length", "transfer-encoding", "connection", "keep-alive", "date", "server"}


class _OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    stream: bool = False
    priority: int | None = None


class ChatCompletionRequest(_OpenAIRequest):
    """``POST /v1/chat/completions``: what the door reads of it (the rest passes)."""

    messages: list[dict[str, Any]] = Field(min_length=1)


class CompletionRequest(_OpenAIRequest):
    """``POST /v1/completions``: what the door reads of it; ``prompt`` text or token
    ids (a list of ints, or a list of such lists)."""

    prompt: str | list[int] | list[str] | list[list[int]]


def openai_router(service: Service) -> APIRouter:
    """The two routes (see the module docstring)."""
    router = APIRouter()

    async def forward(request: Request, path: str, contract: type[_OpenAIRequest]
                      ) -> Response:
        door: GenerationDoor | None = service.generation
        if door is None:
            return error(404, "generation: no replicas configured (the serve setting "
                              "generation.replicas)")
        try:
            body = await read_json(request)
            if not isinstance(body, dict):
                raise ConfigError("body", "must be a JSON object")
            try:
                req = contract.model_validate(body)
            except ValidationError as e:
                raise validation_error(e.errors(), root="body") from None
            ctx = context_from(request.headers).fields()
        except ConfigError as e:
            return error(422, str(e))
        trajectory = ctx.get("trajectory")
        try:
            service.owners.claim(trajectory, request.scope.get(CLIENT))
        except ConfigError as e:
            return error(403, str(e))
        priority = door.priority_for(trajectory, ctx.get("task", service.config.task),
                                     ctx.get("turn"))
        if priority is not None:
            body["priority"] = priority
        gen = Generation(trajectory, ctx.get("turn"), door.replica_for(trajectory),
                         priority if priority is not None else req.priority,
                         count_tokens(body.get("prompt")), time.perf_counter(), req.stream)
        try:
            resp = await door.open(path, body, dict(request.headers), gen)
        except (aiohttp.ClientError, TimeoutError) as e:
            return error(502, f"generation: replica {door.config.replicas[gen.replica]} "
                              f"unreachable ({type(e).__name__})")
        headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP}
        # Counted and traced once the answer is out (not on the client's time).
        after = BackgroundTask(door.finish, gen, resp.status)
        if req.stream:
            return StreamingResponse(door.relay(resp, gen), status_code=resp.status,
                                     headers=headers, background=after)
        return Response(await door.read(resp, gen), status_code=resp.status,
                        headers=headers, background=after)

    def route(contract: type[_OpenAIRequest], what: str) -> dict[str, Any]:
        return {"summary": f"{what}, forwarded to a vLLM or SGLang replica",
                "description": "The OpenAI-compatible front door: the request goes to the "
                "`generation` setting's replicas (a trajectory's to the one its first went "
                "to), its `priority` stamped from the dispatcher's remaining-work "
                "predictor; the replica's answer, streamed (server-sent events) or not, "
                "comes back byte for byte, with its status.",
                "responses": {**responses(*GATED, 403, 404, 422, 502),
                              200: {"description": "the replica's answer, as it sent it"}},
                "openapi_extra": {"parameters": TRAJECTORY_HEADERS, "requestBody": {
                    "required": True, "content": {"application/json": {
                        "schema": contract.model_json_schema()}}}}}

    @router.post("/v1/chat/completions", **route(ChatCompletionRequest, "Chat completion"))
    async def chat_completions(request: Request) -> Response:
        return await forward(request, "/v1/chat/completions", ChatCompletionRequest)

    @router.post("/v1/completions", **route(CompletionRequest, "Completion"))
    async def completions(request: Request) -> Response:
        return await forward(request, "/v1/completions", CompletionRequest)

    return router
