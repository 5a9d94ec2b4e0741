"""One attempt of an API call: the pooled HTTP client (:func:`make_client`), a request
sent and its reply read (size-capped) and judged (done, failed, or worth a retry, with
the server's ``Retry-After``), or a user's async callable awaited."""

from __future__ import annotations

import email.utils
import json as jsonlib
import math
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from metasched.runtime.api_retry import RetryableError
from metasched.runtime.api_spec import HttpSpec, _one_line
from metasched.runtime.outcome import Outcome

__all__ = ["BadResponse", "make_client", "parse_retry_after", "read_body", "warm_up"]

_BODY_CHARS = 500  # of an error response kept in Outcome.detail["body"]
_MAX_BODY = 64 * 1024 * 1024  # a larger response is refused (memory, not a real API reply)
_USER_AGENT = "metasched"


@dataclass(slots=True)
class _Retry:
    """An attempt that failed in a way worth retrying."""

    reason: str
    retry_after_s: float | None = None
    detail: dict[str, Any] = field(default_factory=dict)


class BadResponse(Exception):
    """The server's reply is not HTTP we can read (not retried: it would be again), or
    its body is over the size limit."""


_ssl_context: ssl.SSLContext | None = None


def _tls() -> ssl.SSLContext:
    # Built once: loading the system CA store costs milliseconds.
    global _ssl_context
    if _ssl_context is None:
        _ssl_context = ssl.create_default_context()
    return _ssl_context


def make_client(*, max_keepalive: int = 20, verify: ssl.SSLContext | None = None
                ) -> httpx.AsyncClient:
    """The pooled HTTP client for API calls (see the module docstring); close it with
    ``await client.aclose()``.

    Args:
        max_keepalive: idle connections kept for reuse (the dispatcher passes its
            endpoints' total concurrency). The number of connections open at once is
            not capped here: the endpoints' concurrency limits bound it, and a cap
            below them would make calls queue inside the client, out of the scheduler's
            sight.
        verify: the TLS context that checks servers (default: the system's CA store).
    """
    return httpx.AsyncClient(
        http2=True, trust_env=True, follow_redirects=False, timeout=None,
        verify=verify if verify is not None else _tls(),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=max_keepalive),
        headers={"User-Agent": _USER_AGENT})


async def warm_up() -> None:
    """Load what a client's first call would otherwise load on its way (httpx's
    transport imports its async backend, anyio's asyncio support, at first use: about
    70 ms here), so that the first call starts as promptly as the later ones."""
    import anyio  # httpx's own dependency: its transport runs on it

    await anyio.sleep(0)


async def read_body(resp: httpx.Response) -> bytes:
    """A streamed response's whole body, decoded (gzip, deflate ...).

    Raises:
        BadResponse: the body is over 64 MiB (said by its Content-Length, or found
            while reading it).
    """
    length = resp.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > _MAX_BODY:
        raise BadResponse(f"response body over {_MAX_BODY >> 20} MiB")
    parts: list[bytes] = []
    size = 0
    async for chunk in resp.aiter_bytes():  # decoded (gzip, deflate ...)
        size += len(chunk)
        if size > _MAX_BODY:
            raise BadResponse(f"response body over {_MAX_BODY >> 20} MiB")
        parts.append(chunk)
    return b"".join(parts)


async def _http_request(client: httpx.AsyncClient, spec: HttpSpec
                        ) -> tuple[httpx.Response, bytes]:
    """One request on the pooled client. Raises httpx's errors for connection trouble
    and :class:`BadResponse` for an unreadable reply."""
    body, content_type = spec.payload()
    headers = dict(spec.headers)
    if content_type is not None and "content-type" not in {k.lower() for k in headers}:
        headers["Content-Type"] = content_type
    async with client.stream(spec.method, spec.url, headers=headers, content=body) as resp:
        return resp, await read_body(resp)


def _charset(content_type: str) -> str:
    for param in content_type.split(";")[1:]:
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset" and value.strip():
            return value.strip().strip('"')
    return "utf-8"


def _text(resp: httpx.Response, body: bytes) -> str:
    try:
        return body.decode(_charset(resp.headers.get("content-type", "")), "replace")
    except LookupError:  # an unknown charset name
        return body.decode("utf-8", "replace")


def parse_retry_after(value: str | None) -> float | None:
    """Retry-After in seconds: a number of seconds or an HTTP date; None if absent/bad."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            return None
        seconds = when.timestamp() - time.time()
    return max(0.0, seconds) if math.isfinite(seconds) else None


def _causes(e: BaseException) -> list[BaseException]:
    """``e`` and what it was raised from (httpx wraps the OS's error twice)."""
    out: list[BaseException] = []
    while e is not None and e not in out:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def _connection_reason(e: BaseException) -> str:
    for c in _causes(e):
        if isinstance(c, ConnectionRefusedError):
            return "connection refused"
        if isinstance(c, ConnectionResetError):
            return "connection reset"
        if isinstance(c, ssl.SSLError):
            return f"TLS error: {_one_line(str(c), 200)}"
    for c in _causes(e):
        if isinstance(c, OSError) and c.strerror:
            return f"connection error: {_one_line(c.strerror, 200)}"
    return f"connection error: {_one_line(str(e) or type(e).__name__, 200)}"


def _closed_early(e: httpx.RemoteProtocolError) -> bool:
    """A server that hung up (worth a retry), as opposed to one that sent bytes that are
    not HTTP (not worth one)."""
    msg = str(e).lower()
    return any(w in msg for w in ("disconnected", "peer closed", "incomplete", "closed"))


async def _http_attempt(client: httpx.AsyncClient, spec: HttpSpec) -> Outcome | _Retry:
    try:
        resp, body = await _http_request(client, spec)
    except httpx.ConnectError as e:
        if any(isinstance(c, ssl.SSLCertVerificationError) for c in _causes(e)):
            # Deterministic: the same certificate fails the same way on every retry.
            return Outcome(ok=False, reason=_connection_reason(e))
        return _Retry(_connection_reason(e))
    except httpx.RemoteProtocolError as e:
        if _closed_early(e):
            return _Retry("connection closed before the response ended")
        return Outcome(ok=False, reason=f"bad response: {_one_line(str(e), 200)}")
    except httpx.ProxyError as e:
        return _Retry(f"proxy error: {_one_line(str(e), 200)}")
    except (httpx.NetworkError, OSError) as e:  # reset, or closed, mid-exchange
        return _Retry(_connection_reason(e))
    except BadResponse as e:
        return Outcome(ok=False, reason=f"bad response: {e}")
    except httpx.DecodingError as e:
        return Outcome(ok=False, reason=f"bad response: {_one_line(str(e), 200)}")
    except Exception as e:  # anything unforeseen is a failed call, not a dispatcher crash
        msg = _one_line(str(e), 200)
        return Outcome(ok=False, reason=f"request failed: {type(e).__name__}"
                       + (f": {msg}" if msg else ""))
    status = resp.status_code
    if 200 <= status < 300:
        text = _text(resp, body)
        value: Any = text
        if "json" in resp.headers.get("content-type", "").lower():
            try:
                value = jsonlib.loads(text)
            except ValueError:
                value = text  # labelled JSON but is not: hand over the text as is
        return Outcome(ok=True, value=value,
                       detail={"status": status, "http_version": resp.http_version})
    detail = {"status": status, "body": _text(resp, body)[:_BODY_CHARS]}
    if status == 429 or status >= 500:
        return _Retry(f"HTTP {status}", parse_retry_after(resp.headers.get("retry-after")), detail)
    return Outcome(ok=False, reason=f"HTTP {status}", detail=detail)


async def _callable_attempt(fn: Callable[[], Awaitable[Any]]) -> Outcome | _Retry:
    try:
        value = await fn()
    except RetryableError as e:
        return _Retry(_one_line(str(e.message)) or "RetryableError", e.retry_after_s)
    except Exception as e:  # a user's failure is an outcome; CancelledError is not caught
        msg = _one_line(str(e))
        return Outcome(ok=False, reason=f"{type(e).__name__}: {msg}" if msg
                       else type(e).__name__)
    return Outcome(ok=True, value=value)

