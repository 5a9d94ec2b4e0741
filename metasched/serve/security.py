"""What every request passes before a route sees it: the bearer token (when the service
has one), the body size limit and the body's deadline. One ASGI middleware, so that a
refused request costs no parsing, an oversized body is cut off while it streams in, and
a body that does not come in time is answered 408. Most bodies are read here whole;
those of the routes named ``streamed`` (E2B uploads) pass on as they come, each
under its own cap, for the route to write out piece by piece. The client a token belongs to is left
in the request's scope (:data:`CLIENT`) for the routes that check who owns a trajectory
(:mod:`metasched.serve.ownership`)."""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

__all__ = ["CLIENT", "OPEN_PATHS", "BodyRefused", "Gate"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# Answered without a token: liveness checks carry none.
OPEN_PATHS = frozenset({"/v1/ping", "/v1/health"})
CLIENT = "metasched.client"  # scope key: the client's name (None: authentication off)


class BodyRefused(Exception):
    """A streamed body refused while it came in: the answer's status and one line."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


async def _refuse(send: Send, status: int, detail: str,
                  headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


class Gate:
    """ASGI middleware: bearer-token authentication, a request body limit and a
    deadline for the body.

    Args:
        app: the application behind it.
        clients: the tokens requests may carry (``Authorization: Bearer <token>``),
            each to the name of its client; empty: no authentication. Compared in
            constant time, each of them.
        max_body: the largest request body, in bytes: a larger one is answered 413,
            whether its ``Content-Length`` says so or it streams past the limit.
        body_timeout_s: seconds the whole body may take to arrive, from the end of the
            headers: later, the request is answered 408 and its connection closed.
        own_auth: path prefixes whose routes check credentials of their own (the E2B
            API's keys and access tokens): no bearer token asked there.
        streamed: ``(method, path)`` of routes whose bodies pass on as they come, to
            the cap given here instead of ``max_body`` (a ``Content-Length`` over it:
            413 at once); ``body_timeout_s`` then bounds each wait for the next piece,
            not the whole body (its pace is the route's, which writes as it reads).
    """

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], *,
                 clients: Mapping[str, str], max_body: int,
                 body_timeout_s: float = 60.0, own_auth: tuple[str, ...] = (),
                 streamed: Mapping[tuple[str, str], int] | None = None) -> None:
        self.app = app
        self.own_auth = own_auth
        self.streamed = dict(streamed or {})
        self.expected = [(f"Bearer {token}".encode(), name) for token, name in clients.items()]
        self.max_body = max_body
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        scope[CLIENT] = None
        if self.expected and scope["path"] not in OPEN_PATHS \
                and not scope["path"].startswith(self.own_auth):
            given = headers.get(b"authorization", b"")
            client = None
            for expected, name in self.expected:  # all of them: the time tells nothing
                if hmac.compare_digest(given, expected):
                    client = name
            if client is None:
                await _refuse(send, 401, "missing or wrong bearer token (Authorization: "
                              "Bearer <token>)", ((b"www-authenticate", b"Bearer"),))
                return
            scope[CLIENT] = client
        length = headers.get(b"content-length")
        cap = self.streamed.get((scope.get("method", ""), scope["path"]))
        limit = self.max_body if cap is None else cap
        if length is not None and length.isdigit() and int(length) > limit:
            await _refuse(send, 413, f"request body over {limit} bytes")
            return
        if cap is not None:
            await self.app(scope, self._paced(receive, cap), send)
            return
        # The body is read here, within the limit, and handed on whole: a route then
        # never sees a body over it (FastAPI would turn an error raised while it reads
        # into a 400).
        try:
            async with asyncio.timeout(self.body_timeout_s):
                whole = await self._read(receive, send)
        except TimeoutError:
            await _refuse(send, 408, f"body: not received within {self.body_timeout_s:g} s",
                          ((b"connection", b"close"),))
            return
        if whole is None:
            return
        body: list[bytes] | None = [whole]

        async def replay() -> Message:
            nonlocal body
            if body is not None:
                whole, body = body[0], None
                return {"type": "http.request", "body": whole, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)

    def _paced(self, receive: Receive, cap: int) -> Receive:
        """``receive`` for a streamed body: each piece within ``body_timeout_s``, and
        the body within ``cap`` bytes (past either, :class:`BodyRefused`: the route
        answers it)."""
        seen = 0

        async def paced() -> Message:
            nonlocal seen
            try:
                async with asyncio.timeout(self.body_timeout_s):
                    message = await receive()
            except TimeoutError:
                raise BodyRefused(408, f"body: no data for {self.body_timeout_s:g} s "
                                  f"(body_timeout_s)") from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > cap:
                    raise BodyRefused(413, f"request body over {cap} bytes")
            return message

        return paced

    async def _read(self, receive: Receive, send: Send) -> bytes | None:
        """The whole body, within the limit (None: answered 413, or the client left)."""
        chunks: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return None
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.max_body:
                await _refuse(send, 413, f"request body over {self.max_body} bytes")
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)
