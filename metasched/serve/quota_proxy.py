"""The API-quota proxy: ``/v1/endpoints/<name>/<path>`` forwards to the endpoint's
upstream (``<url>/<path>``, query string kept), within the endpoint's RPM, TPM and
concurrency, for every worker that uses the service at once.

Each forwarded request is an ``api`` action of the dispatcher, so it queues with the
others until the endpoint's quota and concurrency let it start (the caller waits: no
429 from here). The upstream's 429 and 5xx answers, and connection failures, are
retried with backoff (``Retry-After`` honoured), each retry charging the quota again, as
for every API action; when the retries run out the caller gets the upstream's last
answer. A call that runs past the endpoint's ``timeout_s`` is answered 504, a call that
never reached the upstream 502.

Headers: the caller's are forwarded, except hop-by-hop ones, the service's own
(``X-Trajectory-Id``, ``X-Turn``, ``X-Task``, ``X-Reward``, ``X-Prompt-Id``, ``X-Tokens``)
and, when the service has a token, ``Authorization`` (that is the service's); the
upstream's configured ``headers`` replace the caller's of the same name. ``X-Tokens``
says how many tokens the call counts against the endpoint's TPM (default: the
endpoint's ``tokens``).

A caller that disconnects before its call starts is not forwarded (the quota it was
granted is spent unused); one that disconnects later does not stop the upstream call.

In front of a dispatcher on Ray (``backend=ray``), the quotas are the dispatcher
actor's, and so is the upstream call: the service hands the actor a :class:`Forward`
(the call as data), which it makes, retries and answers with the upstream's answer, so
that every service and worker using that dispatcher shares one quota and a call's
concurrency slot is held exactly while it is in flight. There, a call whose retries run
out is answered with the upstream's last status and an error body, not its last body,
and a caller that leaves does not stop its call from being forwarded.
"""

from __future__ import annotations

import asyncio
import base64
import re
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import Response

from metasched.errors import ConfigError
from metasched.runtime.api_calls import RetryableError, parse_retry_after, read_body
from metasched.runtime.requests import REJECTED, Result
from metasched.serve.context import HEADERS, context_from
from metasched.serve.native import error
from metasched.serve.openapi import GATED, TRAJECTORY_HEADERS, responses
from metasched.serve.ownership import with_scoped_prompt
from metasched.serve.security import CLIENT

if TYPE_CHECKING:
    from metasched.serve.service import Service

__all__ = ["METHODS", "proxy_router"]

METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate",
                         "proxy-authorization", "te", "trailer", "transfer-encoding",
                         "upgrade"})
# Not forwarded to the upstream: hop-by-hop, the client's own framing and encoding (the
# pooled client sets them), and what is the service's.
_DROP_REQUEST = _HOP_BY_HOP | {"host", "content-length", "accept-encoding", "x-tokens",
                               *HEADERS}
# Not passed back: hop-by-hop, and what the body as sent here (decoded, whole) and this
# server's own headers replace.
_DROP_RESPONSE = _HOP_BY_HOP | {"content-length", "content-encoding", "date", "server"}


class _Upstream:
    """The upstream's answer to the last attempt of one call."""

    __slots__ = ("status", "headers", "body")

    def __init__(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body

    def response(self) -> Response:
        return Response(self.body, status_code=self.status,
                        headers={k: v for k, v in self.headers if k.lower() not in
                                 _DROP_RESPONSE and k.lower() != "content-type"},
                        media_type=dict((k.lower(), v) for k, v in self.headers)
                        .get("content-type"))


@dataclass(frozen=True)
class Forward:
    """One proxied call as data: made by the service's process (``attempt``), or, in
    front of a dispatcher on Ray, by the dispatcher actor (``__call__``, which pickles
    it there)."""

    method: str
    url: str
    headers: dict[str, str]
    body: bytes

    async def attempt(self, client: httpx.AsyncClient) -> _Upstream:
        """One attempt: the upstream's answer (a transport failure is retryable)."""
        try:  # a body over the limit (BadResponse) fails the call, unretried
            async with client.stream(self.method, self.url, headers=self.headers,
                                     content=self.body or None) as resp:
                content = await read_body(resp)
        except httpx.TransportError as e:
            raise RetryableError(f"upstream unreachable: {type(e).__name__}: "
                                 f"{str(e)[:200] or 'no detail'}") from None
        return _Upstream(resp.status_code, list(resp.headers.multi_items()), content)

    async def __call__(self) -> dict[str, Any]:
        """The call in the dispatcher actor: retried there; its value is the answer."""
        up = await self.attempt(_process_client())
        _raise_if_retryable(up)
        return {"status": up.status, "headers": up.headers,
                "body": base64.b64encode(up.body).decode()}


_client: httpx.AsyncClient | None = None


def _process_client() -> httpx.AsyncClient:
    """The pooled client of this process's proxied calls (the dispatcher actor's)."""
    global _client
    if _client is None:
        from metasched.runtime.api_calls import make_client

        _client = make_client()
    return _client


def _raise_if_retryable(up: _Upstream) -> None:
    if up.status == 429 or up.status >= 500:
        retry_after = dict((k.lower(), v) for k, v in up.headers).get("retry-after")
        raise RetryableError(f"HTTP {up.status}", parse_retry_after(retry_after))


X_TOKENS = {"name": "X-Tokens", "in": "header", "required": False,
            "description": "what the call counts against the endpoint's TPM (default: its "
                           "tokens)", "schema": {"type": "integer", "minimum": 0}}


def _tokens(request: Request, default: int) -> int:
    text = request.headers.get("x-tokens")
    if text is None:
        return default
    if not text.strip().isdigit():
        raise ConfigError("X-Tokens", f"must be a whole number >= 0 (got {text!r})")
    return int(text)


# Characters a path segment may not hold once decoded: a separator (an upstream that
# decodes ``%2F`` or reads ``\\`` as one would see more segments than were checked), NUL
# and the other control characters.
_FORBIDDEN = re.compile(r"[/\\\x00-\x1f\x7f]")
_ENCODED = re.compile(r"%[0-9A-Fa-f]{2}")


def confined_path(raw_path: str) -> str:
    """The path ``raw_path`` (as sent, percent-encoded, after
    ``/v1/endpoints/<name>/``) to append to the endpoint's base URL: decoded segment by
    segment, its dot segments resolved, and encoded again, so that it stays below the
    base, whatever the upstream decodes.

    Raises:
        ConfigError: a ``..`` climbs above the base, or a segment holds an encoded
            ``/``, a backslash, a NUL or another control character, or is encoded
            twice (``%252e``), which an upstream might decode into one of those.
    """
    out: list[str] = []
    segments = raw_path.split("/")
    for n, raw in enumerate(segments):
        seg = unquote(raw, errors="strict") if "%" in raw else raw
        if (m := _FORBIDDEN.search(seg)) is not None:
            raise ConfigError("path", f"segment {raw[:60]!r} holds {m.group()!r} once "
                              f"decoded, which no proxied path may")
        if _ENCODED.search(seg) is not None:
            raise ConfigError("path", f"segment {raw[:60]!r} is percent-encoded twice")
        if seg == "..":
            if not out:
                raise ConfigError("path", "climbs out of the endpoint's base path ('..')")
            out.pop()
        elif seg == "." or (seg == "" and n < len(segments) - 1):
            continue  # "a/./b" and "a//b" are "a/b"; a trailing "/" is kept
        else:
            out.append(quote(seg, safe="!$&'()*+,;=:@~-._"))
    if segments[-1] in (".", "..") and out:
        out.append("")  # "a/b/.." is "a/", as a URL resolves it
    return "/".join(out)


def _raw_path(request: Request) -> str:
    """What follows ``/v1/endpoints/<name>/`` in the request's path as sent (still
    percent-encoded; a server that does not give it: the decoded path, encoded)."""
    raw = request.scope.get("raw_path")
    text = quote(request.url.path) if raw is None else raw.decode("latin-1")
    return text.split("/", 4)[4]


def proxy_router(service: Service) -> APIRouter:
    """The quota proxy's route (see the module docstring)."""
    router = APIRouter()

    async def forward(name: str, path: str, request: Request) -> Response:
        """The quota proxy: forward the call to endpoint ``name``'s upstream under its
        one RPM/TPM/concurrency quota, shared by every client."""
        up = service.config.upstreams.get(name)
        if up is None:
            known = ", ".join(sorted(service.config.upstreams)) or "none"
            return error(404, f"endpoint: {name!r} is not proxied here (proxied: {known})")
        try:
            tail = confined_path(_raw_path(request))
        except (ConfigError, UnicodeDecodeError) as e:
            return error(400, str(e) if isinstance(e, ConfigError) else
                         "path: not valid UTF-8 once percent-decoded")
        try:
            tokens = _tokens(request, up.tokens)
            ctx = context_from(request.headers)
        except ConfigError as e:
            return error(422, str(e))
        try:
            service.owners.claim(ctx.trajectory, request.scope.get(CLIENT))
        except ConfigError as e:
            return error(403, str(e))
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k not in _DROP_REQUEST}
        if service.config.clients:  # the client's token is not the upstream's
            headers.pop("authorization", None)
        for k, v in up.headers.items():
            headers.pop(k.lower(), None)
            headers[k] = v
        url = f"{up.url}/{tail}"
        if request.url.query:
            url += f"?{request.url.query}"
        forward = Forward(request.method, url, headers, body)
        last: list[_Upstream] = []
        gone = asyncio.Event()
        client = service.http
        count = service.metrics.upstream
        remote = getattr(service.dispatcher, "remote", False)

        async def call() -> None:
            if gone.is_set():
                return  # the caller left while the call waited its turn
            answer = await forward.attempt(client)
            count.labels(name, str(answer.status)).inc()
            last[:] = [answer]
            _raise_if_retryable(answer)

        doc: dict[str, Any] = {"kind": "api", "endpoint": name, "tokens": tokens,
                               "timeout_s": up.timeout_s, "id": uuid.uuid4().hex,
                               "name": name, "on_restart": "cancel",  # its caller waits here
                               **with_scoped_prompt(ctx.fields(), request.scope.get(CLIENT))}
        future = service.dispatcher.accept(doc, call=forward if remote else call)
        service.track(doc["id"], future, "api")
        result = await _until_done(future, request, gone)
        if result is None:  # the caller left
            return Response(status_code=499)
        if remote:
            _received(result, last, count, name)
        return _answer(result, last)

    # One route per method, each with its own operation id: one route serving every
    # method gives them all the same id, which FastAPI warns about and OpenAPI forbids.
    answers = {**responses(*GATED, 400, 403, 404, 422, 502, 504),
               200: {"description": "the upstream's answer, passed on",
                     "content": {"*/*": {"schema": {}}}},
               "default": {"description": "the upstream's answer, passed on (any status "
                           "it answers, after the retries)"}}
    for method in METHODS:
        router.add_api_route("/v1/endpoints/{name}/{path:path}", forward, methods=[method],
                             operation_id=f"proxy_{method.lower()}", responses=answers,
                             response_class=Response,
                             openapi_extra={"parameters": [*TRAJECTORY_HEADERS, X_TOKENS]})
    return router


_HTTP_STATUS = re.compile(r"HTTP (\d{3})\b")


def _received(result: Result, last: list[_Upstream], count: Any, name: str) -> None:
    """The upstream's answer to a call the dispatcher actor made, into ``last`` (its
    value; after the retries ran out, the status its reason names) and counted."""
    v = result.value
    if result.ok and isinstance(v, dict):
        last[:] = [_Upstream(v["status"], [tuple(h) for h in v["headers"]],
                             base64.b64decode(v["body"]))]
    elif (m := _HTTP_STATUS.match(result.reason or "")) is not None:
        last[:] = [_Upstream(int(m.group(1)), [("content-type", "application/json")],
                             error(int(m.group(1)), f"upstream: {result.reason}").body)]
    if last:
        count.labels(name, str(last[0].status)).inc()


def _answer(result: Result, last: list[_Upstream]) -> Response:
    if result.status == REJECTED:
        return error(422, result.reason)
    if last and (result.ok or result.reason.startswith("HTTP ")):
        return last[0].response()  # the upstream's answer, retried as far as allowed
    if result.reason.startswith("timeout"):
        return error(504, f"upstream: {result.reason}")
    return error(502, f"upstream: {result.reason}")


async def _until_done(future: asyncio.Future[Result], request: Request,
                      gone: asyncio.Event) -> Result | None:
    """The call's result; None (and ``gone`` set) if the caller disconnects first."""
    async def disconnected() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(1.0)

    watch = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({future, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if future in done:
        return future.result()
    gone.set()
    return None
