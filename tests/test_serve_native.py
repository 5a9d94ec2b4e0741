"""The service's native API: /v1/actions, /v1/status, /v1/health, /v1/ping, /metrics,
the bearer token, the body limit, trajectory headers."""

from __future__ import annotations

import warnings

import httpx
import pytest
from serve_helpers import serving

from metasched.errors import ConfigError
from metasched.runtime.dispatch import DispatcherConfig
from metasched.serve import ServeConfig

ECHO = {"kind": "cpu", "argv": ["echo", "hi"], "timeout_s": 10}
TOKEN = "t0ken-of-at-least-16-chars"


@pytest.fixture(scope="module")
def served():
    with serving() as s:
        yield s


@pytest.fixture
def http(served):
    with httpx.Client(base_url=served.url, timeout=30) as c:
        yield c


def test_ping_and_health(http):
    assert http.get("/v1/ping").json() == "pong"
    h = http.get("/v1/health")
    assert h.status_code == 200 and h.json() == {"status": "ok", "scheduler": "elastic_greedy"}


def test_submit_and_wait_returns_the_result(http):
    r = http.post("/v1/actions", json=ECHO, params={"wait": 10})
    assert r.status_code == 200
    doc = r.json()
    assert (doc["status"], doc["exit_code"], doc["stdout"]) == ("done", 0, "hi\n")
    assert doc["allocation"]["cores"] and doc["finished_at"] >= doc["queued_at"]


def test_submit_answers_once_durable_then_lookup_long_polls(http):
    r = http.post("/v1/actions", json={**ECHO, "argv": ["sleep", "0.3"], "id": "slow-1"})
    assert r.status_code == 202 and r.json() == {"id": "slow-1", "status": "queued"}
    assert http.get("/v1/actions/slow-1").json()["status"] in ("queued", "running")
    done = http.get("/v1/actions/slow-1", params={"wait": 10}).json()
    assert done["id"] == "slow-1" and done["status"] == "done"
    assert http.get("/v1/actions/slow-1").json()["status"] == "done"  # kept after


def test_unknown_id_is_404(http):
    r = http.get("/v1/actions/never-submitted")
    assert r.status_code == 404 and "never-submitted" in r.json()["detail"]


@pytest.mark.parametrize("body, message", [
    ({**ECHO, "timeout_s": -1}, "timeout_s: must be > 0 (got -1)"),
    ({**ECHO, "colour": "red"}, "colour: unknown field"),
    ({**ECHO, "min_cores": 99}, "min_cores: 99 cores asked"),
    ({"kind": "gpu", "service": "rm", "timeout_s": 1}, "kind: gpu request, but"),
])
def test_rejected_requests_are_422_with_a_line_naming_the_field(http, body, message):
    r = http.post("/v1/actions", json=body, params={"wait": 5})
    assert r.status_code == 422
    doc = r.json()
    assert doc["status"] == "rejected" and message in doc["reason"] and "\n" not in doc["reason"]


@pytest.mark.parametrize("headers, message", [
    ({"X-Turn": "three"}, "X-Turn: must be a whole number (got 'three')"),
    ({"X-Turn": "-1"}, "X-Turn: must be >= 0"),
    ({"X-Reward": "maybe"}, "X-Reward: must be true or false (got 'maybe')"),
    ({"X-Trajectory-Id": ""}, "X-Trajectory-Id: must not be empty"),
    ({"X-Trajectory-Id": "t", "X-Prompt-Id": ""}, "X-Prompt-Id: must not be empty"),
])
def test_bad_trajectory_headers_are_422_naming_the_header(http, headers, message):
    r = http.post("/v1/actions", json=ECHO, headers=headers)
    assert r.status_code == 422 and r.json()["detail"].startswith(message)


def test_the_openapi_document_shows_the_request_schema(http):
    """/v1/actions documents the body with the schema the dispatcher validates with."""
    from metasched.runtime.requests import Request

    post = http.get("/openapi.json").json()["paths"]["/v1/actions"]["post"]
    schema = post["requestBody"]["content"]["application/json"]["schema"]
    assert set(schema["properties"]) == set(Request.model_fields) - {"call"}
    assert schema["required"] == ["kind"]  # timeout_s: the dispatcher's default
    http_spec = next(s for s in schema["properties"]["http"]["anyOf"] if "properties" in s)
    assert set(http_spec["properties"]) == {"url", "method", "headers", "json", "body"}
    assert "$defs" not in str(schema)


@pytest.mark.parametrize("content, message", [
    (b"{not json", "body: not valid JSON"),
    (b"[1, 2]", "body: must be a JSON object"),
    (b"\xff\xfe", "body: not valid UTF-8"),
])
def test_bodies_that_are_not_a_request_are_422(http, content, message):
    r = http.post("/v1/actions", content=content)
    assert r.status_code == 422 and r.json()["detail"].startswith(message)


def test_trajectory_headers_fill_the_request(served, http):
    before = len(served.dispatcher.state.trajectories)
    r = http.post("/v1/actions", json=ECHO, params={"wait": 10},
                  headers={"X-Trajectory-Id": "hdr-traj", "X-Turn": "3", "X-Task": "swe",
                           "X-Prompt-Id": "p-2"})
    assert r.json()["status"] == "done"
    trajs = served.dispatcher.state.trajectories
    assert len(trajs) == before + 1
    t = max(trajs.values(), key=lambda t: t.id)
    assert (t.task, t.turn, t.prompt) == ("swe", 4, "p-2")  # the next turn after turn 3
    alone = http.post("/v1/actions", json=ECHO, headers={"X-Prompt-Id": "p-2"})
    assert alone.status_code == 422
    assert alone.json()["reason"] == ("request: prompt: only a trajectory answers a prompt "
                                      "(give its trajectory too)")
    bad = http.post("/v1/actions", json=ECHO, headers={"X-Turn": "three"})
    assert bad.status_code == 422 and bad.json()["detail"].startswith("X-Turn: must be")


def test_status_names_pools_queue_and_policy(http):
    s = http.get("/v1/status").json()
    assert s["scheduler"] == "elastic_greedy" and s["fallback"] == ""
    assert set(s["queue"]) == {"cpu", "gpu", "api"}
    assert s["pools"]["cpu"]["cores"] and s["pools"]["cpu"]["free"] >= 0
    assert "cpu" in s["granted_utilisation"] and "cpu" in s["measured_utilisation"]
    assert s["service"]["ready"] is True


def _leaves(node, path=""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, f"{path}.{k}" if path else k)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _leaves(v, f"{path}[{i}]")
    else:
        yield path, node


def test_status_repeats_no_string_under_two_keys(http):
    """A string (the sandboxes' description, ~400 characters) is said once: a renamed
    counter's old name points at the new one instead of repeating its value."""
    s = http.get("/v1/status").json()
    seen: dict[str, str] = {}
    for path, value in _leaves(s):
        if isinstance(value, str) and len(value) > 20:
            assert value not in seen, f"{path} repeats {seen[value]}: {value[:60]!r}"
            seen[value] = path
    assert s["sandboxes"] and s["renamed"] == {"confinement": "sandboxes",
                                               "queued_at_node": "ahead_at_node"}


def test_metrics_count_requests_and_read_the_dispatcher(http):
    http.post("/v1/actions", json=ECHO, params={"wait": 10})
    text = http.get("/metrics").text
    assert 'metasched_http_requests_total{route="/v1/actions",status="200"}' in text
    done = next(line for line in text.splitlines() if line.startswith("metasched_done_total"))
    assert float(done.split()[-1]) >= 1
    assert "metasched_cores " in text and 'metasched_queued{kind="cpu"}' in text
    assert 'metasched_action_completion_seconds_count{kind="cpu"}' in text


def test_journal_answers_results_the_service_no_longer_keeps(tmp_path):
    dcfg = DispatcherConfig(scheduler="elastic_greedy", journal=tmp_path / "j.db")
    scfg = ServeConfig(keep_results=0, languages=[])
    with serving(dcfg, scfg) as s, httpx.Client(base_url=s.url) as c:
        assert c.post("/v1/actions", json={**ECHO, "id": "kept"},
                      params={"wait": 10}).json()["status"] == "done"
        assert c.get("/v1/actions/kept").json()["stdout"] == "hi\n"


def test_token_is_required_except_for_liveness():
    scfg = ServeConfig(token=TOKEN, languages=[])
    with serving(config=scfg) as s, httpx.Client(base_url=s.url) as c:
        assert c.get("/v1/ping").json() == "pong" and c.get("/v1/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong-token-of-sixteen"},
                        {"Authorization": TOKEN}):
            r = c.post("/v1/actions", json=ECHO, headers=headers)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        ok = c.post("/v1/actions", json=ECHO, params={"wait": 10},
                    headers={"Authorization": f"Bearer {TOKEN}"})
        assert ok.status_code == 200 and ok.json()["status"] == "done"


@pytest.mark.parametrize("kw, message", [
    ({"host": "0.0.0.0"}, "token: listening on 0.0.0.0 needs a token"),
    ({"host": "192.168.1.5"}, "token: listening on 192.168.1.5 needs a token"),
    ({"token": "short"}, "token: must be at least 16"),
    ({"port": 70000}, "port: must be >= 0 and <= 65535"),
    ({"max_body_mb": 0}, "max_body_mb: must be > 0"),
    ({"header_timeout_s": 0}, "header_timeout_s: must be > 0"),
    ({"body_timeout_s": -1}, "body_timeout_s: must be > 0"),
    ({"max_connections": 0}, "max_connections: must be >= 1"),
])
def test_bad_settings_are_one_line(kw, message):
    with pytest.raises(ConfigError, match=message):
        ServeConfig(**kw)


def test_loopback_addresses_need_no_token():
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.5"):
        ServeConfig(host=host)
    ServeConfig(host="0.0.0.0", token=TOKEN)


def test_bodies_over_the_limit_are_413_declared_or_streamed():
    scfg = ServeConfig(max_body_mb=0.01, languages=[])
    with serving(config=scfg) as s, httpx.Client(base_url=s.url) as c:
        big = {**ECHO, "argv": ["echo", "x" * 20_000]}
        assert c.post("/v1/actions", json=big).status_code == 413

        def chunks():
            for _ in range(30):
                yield b" " * 1000
        r = c.post("/v1/actions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and "over 10485 bytes" in r.json()["detail"]
        assert c.post("/v1/actions", json=ECHO, params={"wait": 10}).status_code == 200



def test_the_openapi_document_builds_without_warnings():
    """Every route has its own operation id (the quota proxy serves five methods)."""
    from metasched.serve.app import create_app

    app = create_app(lambda: None, ServeConfig())  # the factory is called only on start
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        paths = app.openapi()["paths"]
    proxy = paths["/v1/endpoints/{name}/{path}"]
    assert {op["operationId"] for op in proxy.values()} == {
        f"proxy_{m}" for m in ("get", "post", "put", "patch", "delete")}


def test_a_prompt_id_is_its_clients_alone():
    tokens = {"a": "a" * 16 + "-client-token", "b": "b" * 16 + "-client-token"}
    with serving(config=ServeConfig(languages=[], tokens=tokens)) as s:
        def act(client: str, trajectory: str, how: str) -> None:
            auth = {"Authorization": f"Bearer {tokens[client]}"}
            if how == "header":
                r = httpx.post(f"{s.url}/v1/actions", json={
                    "kind": "cpu", "argv": ["true"], "trajectory": trajectory},
                    headers={**auth, "X-Prompt-Id": "shared"}, timeout=60)
            else:
                r = httpx.post(f"{s.url}/v1/actions", json={
                    "kind": "cpu", "argv": ["true"], "trajectory": trajectory,
                    "prompt": "shared"}, headers=auth, timeout=60)
            assert r.status_code in (200, 202), r.text

        act("a", "ta1", "body")
        act("a", "ta2", "header")
        act("b", "tb1", "body")  # names a's prompt id: a group of its own
        prompts = {t: s.dispatcher.trajectories.get(t).prompt for t in ("ta1", "ta2", "tb1")}
        assert prompts["ta1"] == prompts["ta2"] != prompts["tb1"]
