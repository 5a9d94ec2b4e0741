"""The API executor against a real HTTP server on 127.0.0.1 and against callables:
values, retries, backoff, Retry-After, before_retry, the overall timeout, cancellation,
and HttpSpec validation."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from helpers import free_port
from hypothesis import given
from hypothesis import strategies as st

from metasched.runtime.api_calls import (
    HttpSpec,
    RetryableError,
    RetryPolicy,
    call_api,
    make_client,
)

FAST = RetryPolicy(max_attempts=4, backoff_s=0.001, max_backoff_s=0.01)


class _Handler(BaseHTTPRequestHandler):
    """Routes by the first path segment; later segments make per-test counters."""

    protocol_version = "HTTP/1.1"
    hits: Counter[str] = Counter()
    # Each answer in one write: two small writes on a kept-alive connection wait out the
    # client's delayed ACK (40 ms) under Nagle.
    wbufsize = -1
    lock = threading.Lock()

    def log_message(self, format: str, *args: object) -> None:  # keep test output clean
        pass

    def _count(self) -> int:
        with self.lock:
            self.hits[self.path] += 1
            return self.hits[self.path]

    def _send(self, status: int, body: bytes = b"", ctype: str = "application/json",
              headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def _handle(self) -> None:
        n = self._count()
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length).decode() if length else ""
        route = self.path.split("/")[1].split("?")[0]
        if route == "json":
            echo = {"method": self.command, "path": self.path, "body": body,
                    "ctype": self.headers.get("Content-Type"),
                    "x": self.headers.get("X-Test"), "port": self.client_address[1]}
            self._send(200, json.dumps(echo).encode())
        elif route == "text":
            self._send(200, "héllo".encode(), "text/plain; charset=utf-8")
        elif route == "badjson":
            self._send(200, b"{not json", "application/json")
        elif route == "flaky429":  # 429 twice, then 200
            if n <= 2:
                self._send(429, b'{"error": "slow down"}')
            else:
                self._send(200, b'{"n": %d}' % n)
        elif route == "503":
            self._send(503, b"x" * 2000, "text/plain")
        elif route == "404":
            self._send(404, b"no such thing", "text/plain")
        elif route == "slow":
            time.sleep(1.5)
            self._send(200, b"{}")
        elif route == "retryafter":  # 503 + Retry-After: <segment 3> once, then 200
            if n == 1:
                self._send(503, b"", headers={"Retry-After": self.path.split("/")[3]})
            else:
                self._send(200, b'"done"')
        elif route == "chunked":
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for piece in (b'{"a": ', b"[1, 2, 3", b"]}"):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\n\r\n")
        elif route == "eof":  # HTTP/1.0 style: no length, the body ends at close
            self.close_connection = True
            self.wfile.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil close")
        elif route == "hangup":  # closes without answering the first time
            if n == 1:
                self.close_connection = True
                return
            self._send(200, b'"back"')
        else:
            self._send(500, b"unknown route")

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _handle


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


_ids = iter(range(10**9))


def _unique(base: str, route: str) -> str:
    """A URL whose per-path counter no other test shares."""
    return f"{base}/{route}/{next(_ids)}"


# --- HTTP --------------------------------------------------------------------------


async def test_post_json_round_trip(server: str) -> None:
    spec = HttpSpec(f"{server}/json?q=1", headers={"X-Test": "yes"}, json={"k": [1, "é"]})
    out = await call_api(spec, timeout_s=5)
    assert out.ok and out.attempts == 1 and out.reason == ""
    assert out.detail == {"status": 200, "http_version": "HTTP/1.1"}
    assert out.value["method"] == "POST" and out.value["path"] == "/json?q=1"
    assert json.loads(out.value["body"]) == {"k": [1, "é"]}
    assert out.value["ctype"] == "application/json" and out.value["x"] == "yes"


@pytest.mark.parametrize("method", ["GET", "PUT", "PATCH", "DELETE"])
async def test_methods_and_raw_body(server: str, method: str) -> None:
    body = None if method in ("GET", "DELETE") else "raw text"
    out = await call_api(HttpSpec(f"{server}/json", method=method, body=body), timeout_s=5)
    assert out.ok and out.value["method"] == method
    assert out.value["body"] == (body or "")


async def test_text_chunked_and_eof_bodies(server: str) -> None:
    text = await call_api(HttpSpec(f"{server}/text", method="GET"), timeout_s=5)
    assert text.ok and text.value == "héllo"
    chunked = await call_api(HttpSpec(f"{server}/chunked", method="GET"), timeout_s=5)
    assert chunked.ok and chunked.value == {"a": [1, 2, 3]}
    eof = await call_api(HttpSpec(f"{server}/eof", method="GET"), timeout_s=5)
    assert eof.ok and eof.value == "until close"
    bad = await call_api(HttpSpec(f"{server}/badjson", method="GET"), timeout_s=5)
    assert bad.ok and bad.value == "{not json"  # labelled JSON but is not: the text


async def test_429_twice_then_ok_awaits_before_retry(server: str) -> None:
    calls = 0

    async def before_retry() -> None:
        nonlocal calls
        calls += 1

    out = await call_api(HttpSpec(_unique(server, "flaky429")), timeout_s=5, retry=FAST,
                         before_retry=before_retry)
    assert out.ok and out.attempts == 3 and out.value == {"n": 3}
    assert calls == out.attempts - 1


async def test_503_always_gives_up_after_max_attempts(server: str) -> None:
    calls = 0

    async def before_retry() -> None:
        nonlocal calls
        calls += 1

    out = await call_api(HttpSpec(f"{server}/503"), timeout_s=5, retry=FAST,
                         before_retry=before_retry)
    assert not out.ok and out.reason == "HTTP 503 after 4 attempts" and out.attempts == 4
    assert out.detail["status"] == 503 and out.detail["body"] == "x" * 500
    assert calls == 3


async def test_single_attempt_reason(server: str) -> None:
    out = await call_api(HttpSpec(f"{server}/503"), timeout_s=5,
                         retry=RetryPolicy(max_attempts=1))
    assert out.reason == "HTTP 503 after 1 attempt" and out.attempts == 1


async def test_404_fails_at_once(server: str) -> None:
    calls = 0

    async def before_retry() -> None:
        nonlocal calls
        calls += 1

    out = await call_api(HttpSpec(f"{server}/404", method="GET"), timeout_s=5, retry=FAST,
                         before_retry=before_retry)
    assert not out.ok and out.reason == "HTTP 404" and out.attempts == 1 and calls == 0
    assert out.detail == {"status": 404, "body": "no such thing"}


async def test_backoff_waits_follow_the_seeded_jitter(server: str) -> None:
    policy = RetryPolicy(max_attempts=4, backoff_s=0.1, max_backoff_s=0.15)
    rng = random.Random(7)
    expected = [policy.delay(k, rng) for k in (1, 2, 3)]
    assert expected[2] <= 0.15  # capped: 0.1 * 2**2 = 0.4 > max_backoff_s
    t0 = time.monotonic()
    out = await call_api(HttpSpec(f"{server}/503"), timeout_s=10, retry=policy,
                         rng=random.Random(7))
    elapsed = time.monotonic() - t0
    assert out.attempts == 4
    assert elapsed >= sum(expected) - 0.005  # lower bound only: the waits happened


def test_delay_is_exponential_full_jitter_capped() -> None:
    class Top(random.Random):
        def random(self) -> float:
            return 0.999999

    policy = RetryPolicy(backoff_s=0.5, max_backoff_s=3.0)
    tops = [policy.delay(k, Top()) for k in range(1, 7)]
    assert tops[:3] == pytest.approx([0.5, 1.0, 2.0], rel=1e-5)
    assert tops[3:] == pytest.approx([3.0] * 3, rel=1e-5)
    rng = random.Random(1)
    assert all(0 <= policy.delay(k, rng) <= 3.0 for k in range(1, 2000, 7))
    assert policy.delay(10**6, rng) <= 3.0  # no overflow for huge attempt numbers
    assert policy.delay(1, rng, retry_after_s=100) == 3.0  # Retry-After capped too
    assert policy.delay(1, rng, retry_after_s=-5) == 0.0


async def test_retry_after_header_is_honoured(server: str) -> None:
    slow_backoff = RetryPolicy(max_attempts=3, backoff_s=0.0, max_backoff_s=5.0)
    t0 = time.monotonic()
    out = await call_api(HttpSpec(_unique(server, "retryafter") + "/0.4"), timeout_s=5,
                         retry=slow_backoff)
    assert out.ok and out.value == "done" and out.attempts == 2
    assert time.monotonic() - t0 >= 0.39  # backoff_s is 0: only Retry-After waited


async def test_retry_after_integer_and_cap(server: str) -> None:
    t0 = time.monotonic()
    out = await call_api(HttpSpec(_unique(server, "retryafter") + "/1"), timeout_s=5,
                         retry=RetryPolicy(backoff_s=0.0))
    assert out.ok and time.monotonic() - t0 >= 0.99
    capped = RetryPolicy(backoff_s=0.0, max_backoff_s=0.2)
    t0 = time.monotonic()
    out = await call_api(HttpSpec(_unique(server, "retryafter") + "/3600"), timeout_s=5,
                         retry=capped)
    elapsed = time.monotonic() - t0
    assert out.ok and elapsed >= 0.19
    assert elapsed < 3  # loose: the hour-long Retry-After was capped to 0.2 s


async def test_connection_refused_is_retried() -> None:
    port = free_port()  # a port nobody listens on (bound, then released)
    calls = 0

    async def before_retry() -> None:
        nonlocal calls
        calls += 1

    out = await call_api(HttpSpec(f"http://127.0.0.1:{port}/x"), timeout_s=5,
                         retry=RetryPolicy(max_attempts=3, backoff_s=0.001),
                         before_retry=before_retry)
    assert not out.ok and out.reason == "connection refused after 3 attempts"
    assert out.attempts == 3 and calls == 2


async def test_hangup_is_retried(server: str) -> None:
    out = await call_api(HttpSpec(_unique(server, "hangup")), timeout_s=5, retry=FAST)
    assert out.ok and out.value == "back" and out.attempts == 2


async def test_timeout_bounds_a_slow_response(server: str) -> None:
    t0 = time.monotonic()
    out = await call_api(HttpSpec(f"{server}/slow"), timeout_s=0.3)
    elapsed = time.monotonic() - t0
    assert not out.ok and out.reason == "timeout after 0.3 s" and out.attempts == 1
    assert 0.29 <= elapsed < 1.2  # loose upper bound: the server takes 1.5 s


async def test_timeout_bounds_retries_and_backoff(server: str) -> None:
    policy = RetryPolicy(max_attempts=1000, backoff_s=0.05, max_backoff_s=0.1)
    calls = 0

    async def before_retry() -> None:
        nonlocal calls
        calls += 1

    t0 = time.monotonic()
    out = await call_api(HttpSpec(f"{server}/503"), timeout_s=0.5, retry=policy,
                         before_retry=before_retry)
    elapsed = time.monotonic() - t0
    assert not out.ok and out.reason == "timeout after 0.5 s"
    assert out.attempts >= 2 and calls in (out.attempts - 1, out.attempts)
    assert out.detail == {"last_error": "HTTP 503"}
    assert 0.49 <= elapsed < 3


async def test_timeout_covers_before_retry(server: str) -> None:
    async def quota_never_refills() -> None:
        await asyncio.sleep(3600)

    out = await call_api(HttpSpec(f"{server}/503"), timeout_s=0.3, retry=FAST,
                         before_retry=quota_never_refills)
    assert out.reason == "timeout after 0.3 s" and out.attempts == 1


async def test_cancellation_propagates(server: str) -> None:
    async def main() -> None:
        task = asyncio.create_task(call_api(HttpSpec(f"{server}/slow"), timeout_s=30))
        await asyncio.sleep(0.1)
        task.cancel()
        await task

    t0 = time.monotonic()
    with pytest.raises(asyncio.CancelledError):
        await main()
    assert time.monotonic() - t0 < 1.2  # did not wait for the 1.5 s response


def _self_signed(tmp_path) -> tuple[str, str]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return str(cert), str(key)


needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None,
                                   reason="needs the openssl CLI")


@needs_openssl
async def test_https(tmp_path) -> None:
    """A self-signed server: refused by the default (verifying) context without retry;
    accepted by a client that trusts its certificate."""
    cert, key = _self_signed(tmp_path)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    httpd.socket = server_ctx.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        spec = HttpSpec(f"https://127.0.0.1:{httpd.server_address[1]}/json", json=[1])
        out = await call_api(spec, timeout_s=5, retry=FAST)
        assert not out.ok and out.reason.startswith("TLS error") and out.attempts == 1
        assert "certificate verify failed" in out.reason

        async def trusting():
            async with make_client(verify=ssl.create_default_context(cafile=cert)) as c:
                return await call_api(spec, timeout_s=5, retry=FAST, client=c)
        out = await trusting()
        assert out.ok and out.value["body"] == "[1]"
    finally:
        httpd.shutdown()
        httpd.server_close()


async def test_one_client_reuses_its_connection(server: str) -> None:
    """Calls through one pooled client share a kept-alive connection (the server sees
    them come from one client port); calls without one each open their own."""
    async def pooled():
        async with make_client() as c:
            return [await call_api(HttpSpec(f"{server}/json"), timeout_s=5, client=c)
                    for _ in range(3)]

    async def unpooled():
        return [await call_api(HttpSpec(f"{server}/json"), timeout_s=5) for _ in range(3)]
    assert len({r.value["port"] for r in await pooled()}) == 1
    assert len({r.value["port"] for r in await unpooled()}) == 3


class _Proxy(BaseHTTPRequestHandler):
    """A forward proxy that answers every request itself, with what it was asked."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        body = json.dumps({"proxied": self.path}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


async def test_proxies_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), _Proxy)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        for var in ("NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy"):
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{proxy.server_address[1]}")
        # A host that does not resolve: only the proxy can answer for it.
        spec = HttpSpec("http://upstream.invalid/v1/search?q=x", method="GET")
        out = await call_api(spec, timeout_s=5, retry=FAST)
        assert out.ok and out.value == {"proxied": "http://upstream.invalid/v1/search?q=x"}
        monkeypatch.setenv("NO_PROXY", "upstream.invalid")  # ... unless it is excluded
        out = await call_api(spec, timeout_s=5, retry=RetryPolicy(max_attempts=1))
        assert not out.ok and out.reason.startswith("connection error")
    finally:
        proxy.shutdown()
        proxy.server_close()


async def _h2_app(scope, receive, send) -> None:
    """An ASGI app answering with the HTTP version and client port it saw."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):  # the request's body, read to its end
        pass
    body = json.dumps({"http_version": scope["http_version"],
                       "port": scope["client"][1]}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


@needs_openssl
async def test_http2_through_a_real_h2_server(tmp_path) -> None:
    """Against hypercorn over TLS (ALPN h2): the calls speak HTTP/2, and calls made at
    once through one client share one connection (multiplexed streams)."""
    hypercorn = pytest.importorskip("hypercorn")
    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    cert, key = _self_signed(tmp_path)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    port = sock.getsockname()[1]
    config = Config()
    config.bind = [f"fd://{sock.detach()}"]  # the server's from here on
    config.certfile, config.keyfile = cert, key
    config.alpn_protocols = ["h2", "http/1.1"]
    config.accesslog = config.errorlog = None
    stop = threading.Event()
    loop = asyncio.new_event_loop()

    async def until_stopped() -> None:
        while not stop.is_set():
            await asyncio.sleep(0.05)

    thread = threading.Thread(target=lambda: loop.run_until_complete(
        serve(_h2_app, config, shutdown_trigger=until_stopped)), daemon=True)
    thread.start()
    url = f"https://127.0.0.1:{port}/score"
    try:
        async def calls():
            async with make_client(verify=ssl.create_default_context(cafile=cert)) as c:
                first = await call_api(HttpSpec(url, method="GET"), timeout_s=10, client=c)
                rest = await asyncio.gather(*(call_api(HttpSpec(url, json={"i": i}),
                                                       timeout_s=10, client=c)
                                              for i in range(8)))
                return [first, *rest]
        out = await calls()
        assert all(r.ok for r in out), [r.reason for r in out]
        assert {r.detail["http_version"] for r in out} == {"HTTP/2"}
        assert {r.value["http_version"] for r in out} == {"2"}
        assert len({r.value["port"] for r in out}) == 1  # one connection for all nine
        assert hypercorn.__name__ == "hypercorn"
    finally:
        stop.set()
        thread.join(10)
        loop.close()


async def test_bad_timeout_is_a_usage_error() -> None:
    async def f() -> int:
        return 1

    for bad in (0, -1, float("nan")):
        with pytest.raises(ValueError, match="timeout_s"):
            await call_api(f, timeout_s=bad)


# --- callables ---------------------------------------------------------------------


async def test_callable_value() -> None:
    async def f() -> dict:
        return {"answer": 42}

    out = await call_api(f, timeout_s=1)
    assert out.ok and out.value == {"answer": 42} and out.attempts == 1


async def test_callable_retryable_then_ok_uses_retry_after() -> None:
    n = 0

    async def f() -> str:
        nonlocal n
        n += 1
        if n == 1:
            raise RetryableError("rate limited", retry_after_s=0.2)
        return "ok"

    calls = 0

    async def before_retry() -> None:
        nonlocal calls
        calls += 1

    t0 = time.monotonic()
    out = await call_api(f, timeout_s=5, retry=RetryPolicy(backoff_s=0.0),
                         before_retry=before_retry)
    assert out.ok and out.value == "ok" and out.attempts == 2 and calls == 1
    assert time.monotonic() - t0 >= 0.19


async def test_callable_retryable_exhausted() -> None:
    async def f() -> None:
        raise RetryableError("judge overloaded")

    out = await call_api(f, timeout_s=5, retry=RetryPolicy(max_attempts=3, backoff_s=0.001))
    assert not out.ok and out.reason == "judge overloaded after 3 attempts"
    assert out.attempts == 3


async def test_callable_other_exception_is_one_line_failure() -> None:
    async def f() -> None:
        raise ValueError("bad\ninput")

    async def g() -> None:
        raise KeyError

    out = await call_api(f, timeout_s=1, retry=FAST)
    assert not out.ok and out.reason == "ValueError: bad input" and out.attempts == 1
    assert (await call_api(g, timeout_s=1)).reason == "KeyError"


async def test_callable_raising_timeout_error_is_its_own_failure() -> None:
    async def f() -> None:
        raise TimeoutError("upstream")

    out = await call_api(f, timeout_s=5)
    assert out.reason == "TimeoutError: upstream"


async def test_callable_timeout() -> None:
    async def f() -> None:
        await asyncio.sleep(3600)

    out = await call_api(f, timeout_s=0.2)
    assert out.reason == "timeout after 0.2 s" and out.attempts == 1 and out.detail == {}


# --- HttpSpec validation -------------------------------------------------------------


def test_from_dict_valid() -> None:
    spec = HttpSpec.from_dict({"url": "https://api.example.com/v1/search?q=x",
                               "method": "get", "headers": {"Authorization": "Bearer t"}})
    assert spec.method == "GET" and spec.headers["Authorization"] == "Bearer t"
    assert HttpSpec.from_dict({"url": "http://h", "json": {"a": 1}}).method == "POST"
    assert HttpSpec.from_dict({"url": "http://[::1]:8080/x", "method": None}).method == "POST"


@pytest.mark.parametrize(("d", "field"), [
    ({"url": "ftp://x"}, "http.url"),
    ({"url": 3}, "http.url"),
    ({}, "http.url"),
    ({"url": "http://"}, "http.url"),
    ({"url": "http://h/a b"}, "http.url"),
    ({"url": "http://h:99999/"}, "http.url"),
    ({"url": "http://u:p@h/"}, "http.url"),
    ({"url": "http://" + "a" * 64 + ".com/"}, "http.url"),
    ({"url": "http://h", "method": "HEAD"}, "http.method"),
    ({"url": "http://h", "method": 1}, "http.method"),
    ({"url": "http://h", "headers": ["a"]}, "http.headers"),
    ({"url": "http://h", "headers": {"Bad Name": "v"}}, "http.headers"),
    ({"url": "http://h", "headers": {"X": "a\r\nInjected: 1"}}, "http.headers"),
    ({"url": "http://h", "headers": {"X": 1}}, "http.headers"),
    ({"url": "http://h", "headers": {"Content-Length": "5"}}, "http.headers"),
    ({"url": "http://h", "json": {"a": {1, 2}}}, "http.json"),
    ({"url": "http://h", "json": float("nan")}, "http.json"),
    ({"url": "http://h", "body": b"bytes"}, "http.body"),
    ({"url": "http://h", "body": "x", "json": 1}, "http:"),
    ({"url": "http://h", "timeout": 3},
     "http.timeout: unknown field (expected one of: body, headers, json, method, url)"),
    ([("url", "http://h")], "http: must be a JSON object"),
])
def test_from_dict_rejects(d: object, field: str) -> None:
    with pytest.raises(ValueError) as info:
        HttpSpec.from_dict(d)  # type: ignore[arg-type]
    msg = str(info.value)
    assert msg.startswith(field) and "\n" not in msg


def test_from_dict_message_example() -> None:
    with pytest.raises(ValueError, match=r"^http.url: must start with http:// or https:// "
                                         r"\(got 'ftp://x'\)$"):
        HttpSpec.from_dict({"url": "ftp://x"})


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                 max_size=3),
    max_leaves=8)
_values = _json | st.binary(max_size=5) | st.dictionaries(
    st.text(max_size=5) | st.integers(), st.text(max_size=8) | st.integers(), max_size=3)
_keys = st.sampled_from(["url", "method", "headers", "json", "body"]) | st.text(max_size=6)
_urls = st.sampled_from(["http://h/x", "https://a.b:8443/p?q", "http://", "ftp://x",
                         "HTTP://h", "http://[::1]/", "http://h:0", "http://h:x/"]) \
    | st.text(max_size=12).map(lambda s: "http://" + s)


@given(st.dictionaries(_keys, _values, max_size=5), st.none() | _urls)
def test_from_dict_returns_a_spec_or_raises_value_error(d: dict, url: str | None) -> None:
    if url is not None:
        d = {**d, "url": url}
    try:
        spec = HttpSpec.from_dict(d)
    except ValueError as e:
        assert "\n" not in str(e) and str(e).startswith("http")
    else:
        assert spec.method in ("GET", "POST", "PUT", "PATCH", "DELETE")
        assert spec.url.lower().startswith(("http://", "https://"))
        body, _ = spec.payload()  # a valid spec can always be encoded
        assert body is None or isinstance(body, bytes)
