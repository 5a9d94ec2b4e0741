"""API executor: performs one web-search / LLM-judge call, with retries, once the
scheduler has started it.

The scheduler decides *when* a call starts (the endpoint's RPM/TPM buckets and
concurrency in ``ClusterState``); :func:`call_api` performs it. A call is either an
:class:`HttpSpec` (a JSON-over-HTTP request) or a user's async callable. 429s, 5xx,
connection errors and :class:`RetryableError` are retried with exponential backoff and
full jitter (or the server's ``Retry-After``); the whole call, retries and waits
included, is bounded by ``timeout_s``; failures come back as an :class:`Outcome`, never
as an exception (except cancellation and misuse of the API itself).

HTTP is spoken over asyncio streams rather than ``urllib`` in a thread:

- cancellation is immediate and leaves nothing behind: a timed-out or cancelled call
  closes its socket at once, whereas a thread blocked in ``urllib`` cannot be stopped
  and a socket timeout bounds each read, not the whole response (a server dripping a
  byte per second keeps such a thread alive indefinitely);
- concurrency is not capped by a thread pool (``asyncio.to_thread`` shares the loop's
  default executor, ``min(32, cores + 4)`` threads: 6 on a 2-core node, fewer than the
  concurrency of one search endpoint).

The client is deliberately small: HTTP/1.1, one connection per attempt
(``Connection: close``), identity/``Content-Length``/chunked bodies, TLS with the default
verified context. It does not follow redirects (a 3xx fails like a 4xx), read proxy
settings from the environment, or decompress bodies (it asks for ``identity``).
"""

from __future__ import annotations

import asyncio
import email.utils
import json as jsonlib
import math
import random
import re
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

from metasched.runtime.outcome import Outcome

METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")
SPEC_KEYS = ("url", "method", "headers", "json", "body")

# Headers the client writes itself: a user's value would contradict the bytes sent.
_MANAGED_HEADERS = frozenset({"content-length", "transfer-encoding", "connection"})
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110 header-name characters
_URL_CHARS = re.compile(r"[\x21-\x7e]+")  # printable ASCII, no spaces: safe in a request line
_BODY_CHARS = 500  # of an error response kept in Outcome.detail["body"]
_MAX_BODY = 64 * 1024 * 1024  # a larger response is refused (memory, not a real API reply)
_MAX_HEAD = 1024 * 1024  # status line + headers
_USER_AGENT = "metasched"


def _show(value: Any, limit: int = 60) -> str:
    """repr() for an error message: one line (repr escapes newlines), shortened."""
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _one_line(text: str, limit: int = 500) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class HttpSpec:
    """One HTTP request.

    Attributes:
        url: ``http://`` or ``https://`` URL (printable ASCII; no credentials in it).
        method: GET, POST, PUT, PATCH or DELETE (stored upper-case).
        headers: extra request headers; ``Content-Length``, ``Transfer-Encoding`` and
            ``Connection`` are the client's. A ``Content-Type`` given here wins over the
            default for the body.
        json: sent as the JSON body (``application/json``) when not None.
        body: sent as a UTF-8 text body (``text/plain``) otherwise.

    Construction validates every field (``ValueError`` with a one-line message naming
    the field); :meth:`from_dict` also rejects unknown keys.
    """

    url: str
    method: str = "POST"
    headers: Mapping[str, str] = field(default_factory=dict)
    json: Any = None
    body: str | None = None

    def __post_init__(self) -> None:
        url = self.url
        if not isinstance(url, str):
            raise ValueError(f"http.url: must be a string (got {_show(url)})")
        if not url.lower().startswith(("http://", "https://")):
            raise ValueError(f"http.url: must start with http:// or https:// (got {_show(url)})")
        if not _URL_CHARS.fullmatch(url):
            raise ValueError(f"http.url: must be printable ASCII without spaces "
                             f"(percent-encode other characters; got {_show(url)})")
        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018 -- parsing the port is the check (ValueError if bad)
        except ValueError as e:
            raise ValueError(f"http.url: {_one_line(str(e), 80)} (got {_show(url)})") from None
        if not parts.hostname:
            raise ValueError(f"http.url: has no host (got {_show(url)})")
        try:
            parts.hostname.encode("idna")  # what the resolver will need (label lengths)
        except UnicodeError:
            raise ValueError(f"http.url: invalid host name (got {_show(url)})") from None
        if parts.username is not None or parts.password is not None:
            raise ValueError("http.url: credentials in the URL are not supported; "
                             "send an Authorization header instead")

        method = self.method
        if not isinstance(method, str) or method.upper() not in METHODS:
            raise ValueError(f"http.method: must be one of {', '.join(METHODS)} "
                             f"(got {_show(method)})")
        object.__setattr__(self, "method", method.upper())

        if not isinstance(self.headers, Mapping):
            raise ValueError(f"http.headers: must be a mapping of names to strings "
                             f"(got {type(self.headers).__name__})")
        headers: dict[str, str] = {}
        for name, value in self.headers.items():
            if not isinstance(name, str) or not _TOKEN.fullmatch(name):
                raise ValueError(f"http.headers: invalid header name {_show(name)}")
            if name.lower() in _MANAGED_HEADERS:
                raise ValueError(f"http.headers: {name!r} is set by the client; remove it")
            if not isinstance(value, str):
                raise ValueError(f"http.headers: value of {name!r} must be a string "
                                 f"(got {type(value).__name__})")
            if any(c in value for c in "\r\n\0") or not value.isascii():
                # Non-ASCII would need an encoding the server may not share; line breaks
                # would inject headers.
                raise ValueError(f"http.headers: value of {name!r} must be ASCII text "
                                 f"without line breaks (got {_show(value)})")
            headers[name] = value
        # A read-only copy: the spec is frozen, and the caller's dict may change later.
        object.__setattr__(self, "headers", MappingProxyType(headers))

        if self.json is not None and self.body is not None:
            raise ValueError("http: give json or body, not both")
        if self.json is not None:
            try:
                jsonlib.dumps(self.json, allow_nan=False)
            except (TypeError, ValueError, RecursionError) as e:
                raise ValueError(f"http.json: not JSON-serialisable "
                                 f"({type(e).__name__}: {_one_line(str(e), 120)})") from None
        if self.body is not None and not isinstance(self.body, str):
            raise ValueError(f"http.body: must be a string (got {type(self.body).__name__}); "
                             f"use json for structured bodies")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> HttpSpec:
        """Build a spec from a plain mapping (e.g. a request's ``http`` section).

        Raises:
            ValueError: one line naming the bad field (``http.url: ...``), for a missing
                url, an unknown key or any invalid value.
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"http: must be a mapping (got {type(d).__name__})")
        unknown = [k for k in d if k not in SPEC_KEYS]
        if unknown:
            names = ", ".join(_show(k, 40) for k in unknown[:5])
            more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
            raise ValueError(f"http: unknown key(s) {names}{more} "
                             f"(allowed: {', '.join(SPEC_KEYS)})")
        if "url" not in d:
            raise ValueError("http.url: missing")
        kwargs = dict(d)
        if kwargs.get("method") is None:
            kwargs.pop("method", None)  # absent or null: the default
        if kwargs.get("headers") is None:
            kwargs.pop("headers", None)
        return cls(**kwargs)

    def payload(self) -> tuple[bytes | None, str | None]:
        """The body bytes and their default Content-Type (None, None without a body)."""
        if self.json is not None:
            return (jsonlib.dumps(self.json, allow_nan=False).encode(),
                    "application/json")
        if self.body is not None:
            return self.body.encode(), "text/plain; charset=utf-8"
        return None, None


class RetryableError(Exception):
    """Raised by a user's async callable to ask for a retry (like a 429/5xx).

    Args:
        message: why, in a few words; the failure reason if the retries run out.
        retry_after_s: wait this long before the retry (capped by the policy's
            ``max_backoff_s``) instead of the exponential backoff.
    """

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently to retry.

    Attributes:
        max_attempts: calls in all (1: no retry).
        backoff_s: base wait; before retry ``k`` (1-based) the wait is uniform in
            ``[0, min(max_backoff_s, backoff_s * 2**(k-1))]`` ("full jitter", so that
            clients rejected together do not come back together).
        max_backoff_s: cap on any wait, a server's ``Retry-After`` included.
    """

    max_attempts: int = 4
    backoff_s: float = 0.5
    max_backoff_s: float = 30.0

    def __post_init__(self) -> None:
        if not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ValueError(f"retry.max_attempts: must be an integer >= 1 "
                             f"(got {self.max_attempts!r})")
        for name in ("backoff_s", "max_backoff_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not (0 <= v < math.inf):
                raise ValueError(f"retry.{name}: must be a finite number >= 0 (got {v!r})")

    def delay(self, retry: int, rng: random.Random,
              retry_after_s: float | None = None) -> float:
        """Seconds to wait before retry number ``retry`` (1 = the second attempt).

        ``retry_after_s`` (a server's or a :class:`RetryableError`'s) replaces the
        jittered backoff; either way the wait is capped by ``max_backoff_s``.
        """
        if retry_after_s is not None:
            try:
                after = float(retry_after_s)
            except (TypeError, ValueError):  # a user's odd value: fall back to backoff
                after = math.nan
            if math.isfinite(after):
                return min(self.max_backoff_s, max(0.0, after))
        # min() on the exponent first: 2.0**k overflows a float for k > 1023.
        ceiling = min(self.max_backoff_s, self.backoff_s * 2.0 ** min(retry - 1, 64))
        return rng.random() * ceiling


# --- one attempt -------------------------------------------------------------------


@dataclass(slots=True)
class _Retry:
    """An attempt that failed in a way worth retrying."""

    reason: str
    retry_after_s: float | None = None
    detail: dict[str, Any] = field(default_factory=dict)


class _BadResponse(Exception):
    """The server's reply is not HTTP we can read (not retried: it would be again)."""


@dataclass(slots=True)
class _Response:
    status: int
    headers: dict[str, str]  # lower-case names; repeated headers joined with ", "
    body: bytes


_ssl_context: ssl.SSLContext | None = None


def _tls() -> ssl.SSLContext:
    # Built once: loading the system CA store costs milliseconds.
    global _ssl_context
    if _ssl_context is None:
        _ssl_context = ssl.create_default_context()
    return _ssl_context


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError:
        raise _BadResponse(f"response headers over {_MAX_HEAD} bytes") from None
    lines = head.decode("latin-1").split("\r\n")
    status_line = lines[0].split(" ", 2)
    if len(status_line) < 2 or not status_line[0].startswith("HTTP/") \
            or not status_line[1].isdigit() or len(status_line[1]) != 3:
        raise _BadResponse(f"bad status line {_show(lines[0])}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise _BadResponse(f"bad header line {_show(line)}")
        name, value = name.strip().lower(), value.strip()
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    return int(status_line[1]), headers


async def _read_body(reader: asyncio.StreamReader, status: int, headers: dict[str, str]
                     ) -> bytes:
    if 100 <= status < 200 or status in (204, 304):
        return b""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        parts: list[bytes] = []
        size = 0
        while True:
            line = await reader.readuntil(b"\r\n")
            try:
                n = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise _BadResponse(f"bad chunk size line {_show(line)}") from None
            if n == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers
                    pass
                return b"".join(parts)
            size += n
            if size > _MAX_BODY:
                raise _BadResponse(f"response body over {_MAX_BODY >> 20} MiB")
            parts.append(await reader.readexactly(n))
            await reader.readexactly(2)  # CRLF after each chunk
    length = headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise _BadResponse(f"bad Content-Length {_show(length)}")
        if int(length) > _MAX_BODY:
            raise _BadResponse(f"response body over {_MAX_BODY >> 20} MiB")
        return await reader.readexactly(int(length))
    body = await reader.read(_MAX_BODY + 1)  # no length: the body ends with the connection
    while len(body) <= _MAX_BODY:
        more = await reader.read(_MAX_BODY + 1 - len(body))
        if not more:
            return body
        body += more
    raise _BadResponse(f"response body over {_MAX_BODY >> 20} MiB")


async def _http_request(spec: HttpSpec) -> _Response:
    """One request on a fresh connection. Raises OSError / IncompleteReadError for
    connection trouble and :class:`_BadResponse` for an unreadable reply."""
    parts = urlsplit(spec.url)
    https = parts.scheme.lower() == "https"
    host = parts.hostname or ""
    port = parts.port or (443 if https else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    body, content_type = spec.payload()

    names = {k.lower() for k in spec.headers}
    host_header = host if ":" not in host else f"[{host}]"  # IPv6 literal
    if parts.port is not None:
        host_header += f":{parts.port}"
    lines = [f"{spec.method} {target} HTTP/1.1"]
    if "host" not in names:
        lines.append(f"Host: {host_header}")
    if "user-agent" not in names:
        lines.append(f"User-Agent: {_USER_AGENT}")
    if "accept-encoding" not in names:
        lines.append("Accept-Encoding: identity")
    if content_type is not None and "content-type" not in names:
        lines.append(f"Content-Type: {content_type}")
    lines.extend(f"{k}: {v}" for k, v in spec.headers.items())
    if body is not None or spec.method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {len(body or b'')}")  # some servers want 0 on POST
    lines.append("Connection: close")
    request = ("\r\n".join(lines) + "\r\n\r\n").encode("ascii") + (body or b"")

    reader, writer = await asyncio.open_connection(
        host, port, ssl=_tls() if https else None,
        server_hostname=host if https else None, limit=_MAX_HEAD)
    try:
        writer.write(request)
        await writer.drain()
        status, headers = await _read_head(reader)
        while 100 <= status < 200:  # interim responses (we send no Expect, but be tolerant)
            status, headers = await _read_head(reader)
        return _Response(status, headers, await _read_body(reader, status, headers))
    finally:
        # Not awaiting wait_closed(): under cancellation it could wait on the peer; the
        # transport is closed (socket released) by close() itself.
        writer.close()


def _charset(content_type: str) -> str:
    for param in content_type.split(";")[1:]:
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset" and value.strip():
            return value.strip().strip('"')
    return "utf-8"


def _text(resp: _Response) -> str:
    try:
        return resp.body.decode(_charset(resp.headers.get("content-type", "")), "replace")
    except LookupError:  # an unknown charset name
        return resp.body.decode("utf-8", "replace")


def _retry_after(value: str | None) -> float | None:
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


def _connection_reason(e: BaseException) -> str:
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    if isinstance(e, ConnectionResetError):
        return "connection reset"
    if isinstance(e, asyncio.IncompleteReadError):
        return "connection closed before the response ended"
    if isinstance(e, ssl.SSLError):
        return f"TLS error: {_one_line(str(e), 200)}"
    if isinstance(e, OSError) and e.strerror:
        return f"connection error: {_one_line(e.strerror, 200)}"
    return f"connection error: {_one_line(str(e) or type(e).__name__, 200)}"


async def _http_attempt(spec: HttpSpec) -> Outcome | _Retry:
    try:
        resp = await _http_request(spec)
    except ssl.SSLCertVerificationError as e:
        # Deterministic: the same certificate fails the same way on every retry.
        return Outcome(ok=False, reason=f"TLS error: {_one_line(str(e), 200)}")
    except (OSError, asyncio.IncompleteReadError) as e:
        return _Retry(_connection_reason(e))
    except _BadResponse as e:
        return Outcome(ok=False, reason=f"bad response: {e}")
    except asyncio.LimitOverrunError:
        return Outcome(ok=False, reason=f"bad response: a line over {_MAX_HEAD} bytes")
    except Exception as e:  # anything unforeseen is a failed call, not a dispatcher crash
        msg = _one_line(str(e), 200)
        return Outcome(ok=False, reason=f"request failed: {type(e).__name__}"
                       + (f": {msg}" if msg else ""))
    status = resp.status
    if 200 <= status < 300:
        text = _text(resp)
        value: Any = text
        if "json" in resp.headers.get("content-type", "").lower():
            try:
                value = jsonlib.loads(text)
            except ValueError:
                value = text  # labelled JSON but is not: hand over the text as is
        return Outcome(ok=True, value=value, detail={"status": status})
    detail = {"status": status, "body": _text(resp)[:_BODY_CHARS]}
    if status == 429 or status >= 500:
        return _Retry(f"HTTP {status}", _retry_after(resp.headers.get("retry-after")), detail)
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


# --- the retry loop ----------------------------------------------------------------


@dataclass(slots=True)
class _Progress:
    """What the retry loop has done so far (read when the timeout interrupts it)."""

    attempts: int = 0
    last_error: str | None = None


async def _attempts(target: HttpSpec | Callable[[], Awaitable[Any]], retry: RetryPolicy,
                    rng: random.Random, before_retry: Callable[[], Awaitable[None]] | None,
                    progress: _Progress) -> Outcome:
    wait = 0.0
    for attempt in range(1, retry.max_attempts + 1):
        if attempt > 1:
            await asyncio.sleep(wait)
            # After the backoff: a retry is a new request against the endpoint's quota,
            # which the dispatcher takes here once the buckets allow it.
            if before_retry is not None:
                await before_retry()
        progress.attempts = attempt
        if isinstance(target, HttpSpec):
            result = await _http_attempt(target)
        else:
            result = await _callable_attempt(target)
        if isinstance(result, Outcome):
            result.attempts = attempt
            return result
        progress.last_error = result.reason
        if attempt == retry.max_attempts:
            plural = "attempt" if attempt == 1 else "attempts"
            return Outcome(ok=False, reason=f"{result.reason} after {attempt} {plural}",
                           attempts=attempt, detail=result.detail)
        wait = retry.delay(attempt, rng, result.retry_after_s)
    raise AssertionError("unreachable: the loop returns on its last attempt")


async def call_api(
    target: HttpSpec | Callable[[], Awaitable[Any]], *, timeout_s: float,
    retry: RetryPolicy = RetryPolicy(), rng: random.Random | None = None,  # noqa: B008 -- frozen
    before_retry: Callable[[], Awaitable[None]] | None = None,
) -> Outcome:
    """Perform one API call, retrying what is worth retrying, within ``timeout_s``.

    Args:
        target: an :class:`HttpSpec`, or an async callable taking no arguments whose
            return value becomes ``Outcome.value``.
        timeout_s: bound on the whole call: every attempt, backoff wait and
            ``before_retry`` together (``math.inf``: none).
        retry: attempts and backoff.
        rng: source of the backoff jitter (default ``random.Random()``; seed one for
            reproducible waits).
        before_retry: awaited before every retry, after the backoff wait (so
            ``attempts - 1`` times); the dispatcher waits there until the endpoint's
            buckets allow another request and takes it. Its exceptions propagate; the
            timeout may cancel it.

    Returns:
        ``Outcome(ok=True, value=..., attempts=n)``; for HTTP ``value`` is the parsed
        JSON body when the response says JSON, else the text, and ``detail`` is
        ``{"status": code}``. Failures: ``"HTTP 404"`` (other 4xx and 3xx, at once, with
        ``detail`` status and the first 500 characters of the body), ``"HTTP 503 after 4
        attempts"``, ``"connection refused after 4 attempts"``, ``"<Exception>:
        <message>"`` for a callable's non-retryable exception, ``"timeout after 2 s"``
        (``detail["last_error"]`` if an attempt had failed before).

    Raises:
        asyncio.CancelledError: when the caller is cancelled (the connection is closed).
        ValueError: for a timeout_s that is not > 0.
    """
    if not timeout_s > 0:  # also rejects NaN
        raise ValueError(f"timeout_s: must be > 0 (got {timeout_s!r})")
    progress = _Progress()
    run = _attempts(target, retry, rng if rng is not None else random.Random(),
                    before_retry, progress)
    try:
        # wait_for (not asyncio.timeout) keeps Python 3.10 working. The attempts run as
        # their own task; only this wait_for's expiry raises TimeoutError here, because
        # an attempt turns its own exceptions (a callable's TimeoutError included) into
        # results.
        return await asyncio.wait_for(run, None if math.isinf(timeout_s) else timeout_s)
    except asyncio.TimeoutError:
        detail = {"last_error": progress.last_error} if progress.last_error else {}
        return Outcome(ok=False, reason=f"timeout after {timeout_s:g} s",
                       attempts=progress.attempts, detail=detail)


__all__ = ["HttpSpec", "RetryPolicy", "RetryableError", "call_api"]
