"""API executor: performs one web-search / LLM-judge call, with retries, once the
scheduler has started it.

The scheduler decides *when* a call starts (the endpoint's RPM/TPM quotas and
concurrency in ``ClusterState``); :func:`call_api` performs it. A call is either an
:class:`HttpSpec` (a JSON-over-HTTP request) or a user's async callable. 429s, 5xx,
connection errors and :class:`RetryableError` are retried with exponential backoff and
full jitter (or the server's ``Retry-After``); the whole call, retries and waits
included, is bounded by ``timeout_s``; failures come back as an :class:`Outcome`, never
as an exception (except cancellation and misuse of the API itself).

HTTP goes through one pooled ``httpx.AsyncClient`` per dispatcher (:func:`make_client`):

- connections are kept and reused (keep-alive for HTTP/1.1, one multiplexed connection
  for HTTP/2, negotiated by TLS ALPN), instead of a new connection (and TLS handshake)
  per call;
- proxies come from the environment (``HTTP_PROXY``, ``HTTPS_PROXY``, ``ALL_PROXY``,
  ``NO_PROXY``), certificates from the system store (``SSL_CERT_FILE`` / ``SSL_CERT_DIR``
  honoured);
- compressed bodies are decoded; redirects are not followed (a 3xx fails like a 4xx);
- the client has no timeouts of its own: ``timeout_s`` bounds the whole call, and
  cancelling it (on timeout too) closes the attempt's stream at once; a server dripping
  a byte per second cannot keep a call alive past it. A response body over 64 MiB is
  refused.
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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import httpx
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from metasched.errors import ConfigError, validation_error
from metasched.runtime.outcome import Outcome

METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")

# Headers the client writes itself: a user's value would contradict the bytes sent (and
# HTTP/2 forbids the last two).
_MANAGED_HEADERS = frozenset({"content-length", "transfer-encoding", "connection"})
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110 header-name characters
_URL_CHARS = re.compile(r"[\x21-\x7e]+")  # printable ASCII, no spaces: safe in a request line
_BODY_CHARS = 500  # of an error response kept in Outcome.detail["body"]
_MAX_BODY = 64 * 1024 * 1024  # a larger response is refused (memory, not a real API reply)
_USER_AGENT = "metasched"


def _show(value: Any, limit: int = 60) -> str:
    """repr() for an error message: one line (repr escapes newlines), shortened."""
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _one_line(text: str, limit: int = 500) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_url(url: str) -> str:
    if not url.lower().startswith(("http://", "https://")):
        raise ValueError("must start with http:// or https://")
    if not _URL_CHARS.fullmatch(url):
        raise ValueError("must be printable ASCII without spaces (percent-encode other "
                         "characters)")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 -- parsing the port is the check (ValueError if bad)
    except ValueError as e:
        raise ValueError(_one_line(str(e), 80)) from None
    if not parts.hostname:
        raise ValueError("has no host")
    try:
        parts.hostname.encode("idna")  # what the resolver will need (label lengths)
    except UnicodeError:
        raise ValueError("invalid host name") from None
    if parts.username is not None or parts.password is not None:
        raise ConfigError("", "credentials in the URL are not supported; send an "
                          "Authorization header instead")
    return url


def _check_headers(headers: dict[str, str]) -> dict[str, str]:
    for name, value in headers.items():
        if not _TOKEN.fullmatch(name):
            raise ConfigError("", f"invalid header name {_show(name)}")
        if name.lower() in _MANAGED_HEADERS:
            raise ConfigError("", f"{name!r} is set by the client; remove it")
        if any(c in value for c in "\r\n\0") or not value.isascii():
            # Non-ASCII would need an encoding the server may not share; line breaks
            # would inject headers.
            raise ConfigError("", f"value of {name!r} must be ASCII text without line "
                              f"breaks (got {_show(value)})")
    return headers


def _check_json(value: Any) -> Any:
    if value is not None:
        try:
            jsonlib.dumps(value, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as e:
            raise ConfigError("", f"not JSON-serialisable ({type(e).__name__}: "
                              f"{_one_line(str(e), 120)})") from None
    return value


def _default_if_null(default: Any) -> Any:
    return BeforeValidator(lambda v: default if v is None else v)


class HttpSpec(BaseModel):
    """One HTTP request.

    Attributes:
        url: ``http://`` or ``https://`` URL (printable ASCII; no credentials in it).
        method: GET, POST, PUT, PATCH or DELETE (any case; stored upper-case).
        headers: extra request headers; ``Content-Length``, ``Transfer-Encoding`` and
            ``Connection`` are the client's. A ``Content-Type`` given here wins over the
            default for the body.
        json_: sent as the JSON body (``application/json``) when not None (``json`` in
            the JSON form and as a keyword).
        body: sent as a UTF-8 text body (``text/plain``) otherwise.

    Construction validates every field (a pydantic ``ValidationError``, a ValueError);
    :meth:`from_dict` raises a one-line ConfigError naming the field instead. Unknown
    keys are an error. ``HttpSpec(url, **fields)`` takes the URL positionally too.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    url: Annotated[str, Field(strict=True), AfterValidator(_check_url)]
    method: Annotated[Literal[METHODS], BeforeValidator(
        lambda v: "POST" if v is None else v.upper() if isinstance(v, str) else v)] = "POST"
    headers: Annotated[dict[Annotated[str, Field(strict=True)],
                            Annotated[str, Field(strict=True)]],
                       _default_if_null({}), AfterValidator(_check_headers)] = {}
    json_: Annotated[Any, AfterValidator(_check_json)] = Field(None, alias="json")
    body: Annotated[str, Field(strict=True)] | None = None

    def __init__(self, url: str | None = None, /, **fields: Any) -> None:
        if url is not None:
            fields["url"] = url
        super().__init__(**fields)

    @model_validator(mode="after")
    def _one_body(self) -> HttpSpec:
        if self.json_ is not None and self.body is not None:
            raise ConfigError("", "give json or body, not both")
        return self

    @classmethod
    def from_dict(cls, d: Any) -> HttpSpec:
        """Build a spec from a plain mapping (e.g. a request's ``http`` section).

        Raises:
            ConfigError: one line naming the bad field (``http.url: ...``), for a
                missing url, an unknown key or any invalid value.
        """
        try:
            return cls.model_validate(d)
        except ValidationError as e:
            raise validation_error(e.errors(), model=cls, at=("http",)) from None

    def payload(self) -> tuple[bytes | None, str | None]:
        """The body bytes and their default Content-Type (None, None without a body)."""
        if self.json_ is not None:
            return (jsonlib.dumps(self.json_, allow_nan=False).encode(),
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


# --- the retry loop ----------------------------------------------------------------


@dataclass(slots=True)
class _Progress:
    """What the retry loop has done so far (read when the timeout interrupts it)."""

    attempts: int = 0
    last_error: str | None = None


async def _attempts(target: HttpSpec | Callable[[], Awaitable[Any]], retry: RetryPolicy,
                    rng: random.Random, before_retry: Callable[[], Awaitable[None]] | None,
                    progress: _Progress, client: httpx.AsyncClient | None) -> Outcome:
    wait = 0.0
    for attempt in range(1, retry.max_attempts + 1):
        if attempt > 1:
            await asyncio.sleep(wait)
            # After the backoff: a retry is a new request against the endpoint's quota,
            # which the dispatcher takes here once the quota allows it.
            if before_retry is not None:
                await before_retry()
        progress.attempts = attempt
        if isinstance(target, HttpSpec):
            result = await _http_attempt(client, target)
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
    client: httpx.AsyncClient | None = None,
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
            quota allows another request and takes it. Its exceptions propagate; the
            timeout may cancel it.
        client: the pooled client for an :class:`HttpSpec` (see :func:`make_client`;
            default: one made for this call and closed after it).

    Returns:
        ``Outcome(ok=True, value=..., attempts=n)``; for HTTP ``value`` is the parsed
        JSON body when the response says JSON, else the text, and ``detail`` is
        ``{"status": code, "http_version": "HTTP/1.1" or "HTTP/2"}``. Failures: ``"HTTP
        404"`` (other 4xx and 3xx, at once, with ``detail`` status and the first 500
        characters of the body), ``"HTTP 503 after 4 attempts"``, ``"connection refused
        after 4 attempts"``, ``"<Exception>: <message>"`` for a callable's non-retryable
        exception, ``"timeout after 2 s"`` (``detail["last_error"]`` if an attempt had
        failed before).

    Raises:
        asyncio.CancelledError: when the caller is cancelled (the connection is closed).
        ValueError: for a timeout_s that is not > 0.
    """
    if not timeout_s > 0:  # also rejects NaN
        raise ValueError(f"timeout_s: must be > 0 (got {timeout_s!r})")
    progress = _Progress()
    own = make_client() if isinstance(target, HttpSpec) and client is None else None
    run = _attempts(target, retry, rng if rng is not None else random.Random(),
                    before_retry, progress, client or own)
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
    finally:
        if own is not None:
            await own.aclose()


__all__ = ["BadResponse", "HttpSpec", "RetryPolicy", "RetryableError", "call_api",
           "make_client", "parse_retry_after", "read_body", "warm_up"]
