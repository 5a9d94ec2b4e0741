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

The parts: :mod:`.api_spec` (the HTTP request), :mod:`.api_retry` (the retry policy)
and :mod:`.api_http` (the client and one attempt).
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx

from metasched.runtime.api_http import (
    BadResponse,
    _callable_attempt,
    _http_attempt,
    make_client,
    parse_retry_after,
    read_body,
    warm_up,
)
from metasched.runtime.api_retry import RetryableError, RetryPolicy
from metasched.runtime.api_spec import HttpSpec
from metasched.runtime.outcome import Outcome

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
