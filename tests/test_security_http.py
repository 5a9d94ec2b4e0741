"""Attacks on the HTTP service, each refused or confined with a one-line answer: a quota
proxy path that climbs out of the endpoint's base path, deeply nested JSON, a lone
surrogate, clients that never finish their headers or body, more connections than the
cap, and a ``fetch_files`` path the sandbox cannot read. Real servers on 127.0.0.1 and
real sandboxes."""

from __future__ import annotations

import http.client
import json
import select
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from serve_helpers import serving

from metasched.runtime.dispatch import DispatcherConfig
from metasched.serve import ServeConfig
from metasched.serve.config import parse_upstreams


def _one_line(r: httpx.Response | http.client.HTTPResponse, status: int, body: bytes) -> str:
    """The ``detail`` of a one-line error answer of ``status``."""
    assert getattr(r, "status_code", getattr(r, "status", None)) == status, body
    doc = json.loads(body)
    assert list(doc) == ["detail"] and isinstance(doc["detail"], str), doc
    assert "\n" not in doc["detail"] and "Traceback" not in doc["detail"]
    return doc["detail"]


# --- the quota proxy's path stays below the endpoint's base path --------------------

class _Recorder(BaseHTTPRequestHandler):
    """Answers 200 to everything, and records each path it is asked for."""

    protocol_version = "HTTP/1.1"
    seen: list[str] = []

    def _handle(self) -> None:
        _Recorder.seen.append(self.path)
        body = b'{"ok": true}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _handle  # noqa: N815

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def proxy():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{httpd.server_address[1]}/api/v1"
    endpoints, upstreams = parse_upstreams({"search": {
        "rpm": 6000, "max_concurrency": 4, "url": base,
        "headers": {"Authorization": "Bearer upstream-key"}}})
    dcfg = DispatcherConfig(scheduler="elastic_greedy", endpoints=endpoints)
    with serving(dcfg, ServeConfig(upstreams=upstreams, languages=[])) as s:
        yield s
    httpd.shutdown()
    httpd.server_close()


def _get_as_is(url: str, path: str) -> tuple[http.client.HTTPResponse, bytes]:
    """GET ``path`` exactly as written (as ``curl --path-as-is`` sends it)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r, r.read()
    finally:
        conn.close()


@pytest.mark.parametrize("tail", [
    "..%2f..%2fadmin",              # the reported one: encoded slashes
    "../../admin",                  # plain dot segments
    "%2e%2e/%2e%2e/admin",          # encoded dots
    "a/../../../admin",             # down one, up three
    "..%5c..%5cadmin",              # backslashes, which some servers read as "/"
    "%252e%252e%252fadmin",         # encoded twice
    "admin%00.json",                # a NUL
])
def test_proxy_path_that_climbs_out_of_the_base_is_400_and_never_forwarded(proxy, tail):
    before = len(_Recorder.seen)
    r, body = _get_as_is(proxy.url, f"/v1/endpoints/search/{tail}")
    assert _one_line(r, 400, body).startswith("path: ")
    assert _Recorder.seen[before:] == []


def test_proxy_path_within_the_base_is_resolved_there(proxy):
    _Recorder.seen.clear()
    r, _ = _get_as_is(proxy.url, "/v1/endpoints/search/a/./b/../c%20d?q=1")
    assert r.status == 200
    assert _Recorder.seen == ["/api/v1/a/c%20d?q=1"]


# --- JSON bodies: depth and lone surrogates, on every JSON route --------------------

@pytest.fixture(scope="module")
def served():
    with serving(config=ServeConfig(languages=["python"])) as s:
        yield s


ROUTES = ["/v1/actions?wait=30", "/run_code"]
JSON = {"Content-Type": "application/json"}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("nesting", ["[" * 100_000, '{"a":' * 50_000 + "1" + "}" * 50_000,
                                     "[" * 200 + "]" * 200])
def test_deeply_nested_json_is_422_in_one_line(served, route, nesting):
    r = httpx.post(served.url + route, content=nesting, headers=JSON, timeout=60)
    assert _one_line(r, 422, r.content) == "body: nested deeper than 64 levels"


@pytest.mark.parametrize("route, body, field", [
    ("/run_code", '{"code": "print(1)\\ud800"}', "body.code"),
    ("/run_code", '{"code": "print(1)", "fetch_files": ["\\udfff"]}', "body.fetch_files[0]"),
    ("/v1/actions?wait=30", '{"kind": "cpu", "argv": ["echo", "\\ud800"], "timeout_s": 5}',
     "body.argv[1]"),
    ("/v1/actions?wait=30", '{"kind": "cpu", "argv": ["true"], "timeout_s": 5, '
     '"env": {"\\ud800": "x"}}', "body.env"),
])
def test_a_lone_surrogate_is_422_in_one_line(served, route, body, field):
    r = httpx.post(served.url + route, content=body, headers=JSON, timeout=60)
    assert _one_line(r, 422, r.content).startswith(f"{field}: ")
    assert "lone surrogate" in r.json()["detail"]


def test_a_surrogate_pair_is_text_and_runs(served):
    r = httpx.post(served.url + "/run_code", content='{"code": "print(\\"\\ud83d\\ude00\\")"}',
                   headers=JSON, timeout=60)
    assert r.status_code == 200 and r.json()["run_result"]["stdout"] == "\U0001F600\n"


# --- fetch_files: what can be read comes back, the rest is named --------------------

def test_fetch_files_with_an_unreadable_path_returns_the_others(served):
    code = ("import os\nopen('a.txt', 'w').write('kept')\n"
            "open('secret.txt', 'w').write('x')\nos.chmod('secret.txt', 0)\n"
            "os.mkdir('d')\n")
    r = httpx.post(served.url + "/run_code", json={
        "code": code, "fetch_files": ["a.txt", "secret.txt", "missing.txt", "d",
                                      "/etc/shadow"]}, timeout=60)
    doc = r.json()
    assert r.status_code == 200 and doc["status"] == "Success", doc
    assert doc["files"] == {"a.txt": "a2VwdA=="}  # base64 of "kept"
    assert doc["fetch_errors"] == {"secret.txt": "Permission denied",
                                   "missing.txt": "not found", "d": "not a regular file",
                                   "/etc/shadow": "not found"}  # not in a sandbox's root
    assert "Traceback" not in doc["message"]


# --- slow clients, and too many connections -----------------------------------------

def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    return s


def _answer_then_closed(s: socket.socket) -> bytes:
    """What the server sends before it closes the connection."""
    s.settimeout(10)
    data = b""
    while chunk := s.recv(4096):
        data += chunk
    return data


def test_clients_that_never_finish_their_headers_are_cut_off_while_others_are_served():
    timeout_s, clients = 2.0, 300
    with serving(config=ServeConfig(languages=[], header_timeout_s=timeout_s)) as s:
        # Slow loris: each client sends a header line every 0.25 s and never the end.
        socks = [_connect(s.url) for _ in range(clients)]
        t0 = time.monotonic()
        for sock in socks:
            sock.sendall(b"GET /v1/ping HTTP/1.1\r\nHost: x\r\n")
        answers: dict[socket.socket, bytes] = {}
        cut_at: list[float] = []
        served_at = None
        while time.monotonic() - t0 < timeout_s + 5.0 and len(answers) < clients:
            waiting = [x for x in socks if x not in answers]
            readable, _, _ = select.select(waiting, [], [], 0)
            for sock in readable:  # the server answered: read to its close
                answers[sock] = _answer_then_closed(sock)
                cut_at.append(time.monotonic() - t0)
            for sock in waiting:
                if sock not in answers:
                    sock.sendall(b"X-Slow: 1\r\n")
            if served_at is None:  # meanwhile, an ordinary client
                r = httpx.get(s.url + "/v1/ping", timeout=5)
                assert r.status_code == 200 and r.json() == "pong"
                served_at = time.monotonic() - t0
            time.sleep(0.25)
        for sock in socks:
            sock.close()
        assert served_at is not None and served_at < timeout_s
        # Each was answered 408 and closed once its headers ran past the deadline.
        assert len(answers) == clients
        assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers.values())
        assert next(iter(answers.values())).endswith(
            b'{"detail": "headers: not received within 2 s"}')
        assert timeout_s - 0.1 < min(cut_at) and max(cut_at) < timeout_s + 3.0
        assert httpx.get(s.url + "/v1/ping", timeout=5).status_code == 200


def test_a_body_that_never_comes_is_cut_off():
    with serving(config=ServeConfig(languages=[], body_timeout_s=1.0)) as s:
        sock = _connect(s.url)
        t0 = time.monotonic()
        sock.sendall(b"POST /v1/actions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 100\r\n\r\n{\"kind\"")
        answer = _answer_then_closed(sock)
        sock.close()
        assert 0.9 < time.monotonic() - t0 < 5
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 ")
        assert json.loads(body) == {"detail": "body: not received within 1 s"}


def test_connections_beyond_the_cap_are_refused_at_once():
    with serving(config=ServeConfig(languages=[], max_connections=20)) as s:
        held = [_connect(s.url) for _ in range(20)]
        time.sleep(0.2)  # all 20 accepted
        t0 = time.monotonic()
        extra = _connect(s.url)
        answer = _answer_then_closed(extra)  # answered and closed, not left open
        extra.close()
        assert time.monotonic() - t0 < 2
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 ")
        assert json.loads(body) == {"detail": "connections: 20 already open here"}
        for sock in held:
            sock.close()
        time.sleep(0.2)
        assert httpx.get(s.url + "/v1/ping", timeout=5).status_code == 200
