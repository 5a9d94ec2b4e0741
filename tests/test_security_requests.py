"""Attacks through what a request may ask, each refused or confined with a one-line
answer: a workspace template given as a host path (``/etc``, to read ``/etc/shadow``),
at every front door; an api call over HTTP to a host-local address; a memory hog
without a memory limit; a request above the per-request caps; another client's
trajectory (its actions, its close, its results).
Real services on 127.0.0.1, real sandboxes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml
from sandbox_helpers import needs_controllers, needs_isolation
from serve_helpers import serving

from metasched.client import Client
from metasched.errors import ConfigError
from metasched.runtime.dispatch import Dispatcher, DispatcherConfig
from metasched.runtime.limits import RequestLimits
from metasched.runtime.sandbox.config import SandboxConfig
from metasched.serve import ServeConfig
from metasched.serve.config import parse_upstreams

ROOT = Path(__file__).resolve().parents[1]
SHADOW = {"kind": "cpu", "trajectory": "t", "workspace_template": "/etc",
          "argv": ["head", "/workspace/shadow"], "timeout_s": 30}
ECHO = {"kind": "cpu", "argv": ["echo", "hi"], "timeout_s": 10}
ALICE, BOB = "alice-token-0123456789", "bob-token-9876543210xx"


pytestmark = pytest.mark.isolation


def dcfg(templates: dict | None = None, **kw) -> DispatcherConfig:
    kw.setdefault("scheduler", "elastic_greedy")
    sandbox = {"templates": templates} if templates else {}
    return DispatcherConfig(sandbox=SandboxConfig(isolation="bwrap", **sandbox), **kw)


def one_line(text: str) -> str:
    assert "\n" not in text and "Traceback" not in text, text
    return text


def shadow_line() -> str:
    return Path("/etc/shadow").read_text().splitlines()[0]


# ---------------------------------------------------------------- templates by name


@pytest.fixture(scope="module")
def plain():
    """A service with the default settings (no templates, the default limits)."""
    needs_isolation()
    with serving(dcfg()) as s, httpx.Client(base_url=s.url, timeout=60) as http:
        yield http


def test_template_path_over_http_is_refused_and_shadow_stays_unread(plain):
    r = plain.post("/v1/actions", json=SHADOW, params={"wait": 30})
    assert r.status_code == 422, r.text
    assert one_line(r.json()["reason"]) == ("workspace_template: unknown template '/etc' "
                                            "(configured: none: sandbox.templates is empty)")
    assert shadow_line() not in r.text


def test_a_configured_template_is_named(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "hello.txt").write_text("hi\n")
    with serving(dcfg({"repo": str(repo), "other": str(repo)})) as s, \
            httpx.Client(base_url=s.url, timeout=60) as http:
        named = http.post("/v1/actions", params={"wait": 30}, json={
            **SHADOW, "workspace_template": "repo", "argv": ["cat", "/workspace/hello.txt"]})
        path = http.post("/v1/actions", params={"wait": 30}, json={
            **SHADOW, "trajectory": "u", "workspace_template": str(repo)})
    assert named.status_code == 200 and named.json()["stdout"] == "hi\n", named.text
    reason = one_line(path.json()["reason"])
    assert reason.startswith("workspace_template: unknown template '/"), reason
    assert reason.endswith(" (configured: other, repo)"), reason


@pytest.mark.parametrize("door", [
    "python", pytest.param("job_file", marks=pytest.mark.subprocess), "client"])
async def test_template_path_is_refused_at_every_front_door(door, tmp_path):
    if door == "python":
        async with Dispatcher(dcfg()) as d:
            r = (await d.submit(SHADOW)).to_dict()
    elif door == "client":
        with serving(dcfg()) as s, Client(s.url) as c:
            r = c.run(SHADOW).__dict__
    else:
        jobs = tmp_path / "jobs.jsonl"
        jobs.write_text(json.dumps(SHADOW) + "\n")
        subprocess.run([sys.executable, "-m", "metasched.cli.dispatch_app", f"jobs={jobs}",
                        "scheduler=elastic_greedy", "sandbox.isolation=bwrap",
                        "progress=false", f"hydra.run.dir={tmp_path / 'out'}"],
                       cwd=ROOT, check=True, capture_output=True, timeout=120,
                       env={**os.environ, "METASCHED_CONFIG_DIR": str(ROOT / "configs")})
        r = json.loads((tmp_path / "out" / "results.jsonl").read_text().splitlines()[0])
    assert r["status"] == "rejected", r
    reason = one_line(r["reason"]).removeprefix("jobs.jsonl:1: ")  # the job file's line
    assert reason == ("workspace_template: unknown template '/etc' (configured: none: "
                      "sandbox.templates is empty)")
    assert shadow_line() not in r["stdout"]


@pytest.mark.parametrize("templates, message", [
    ({"etc": "/nonexistent/dir"}, "sandbox.templates.etc: /nonexistent/dir: no such file"),
    ({"../x": "/tmp"}, "sandbox.templates: '../x': a name is letters"),
    ({"x": 3}, "sandbox.templates.x: must be a path (got 3)"),
])
def test_templates_are_checked_at_start(templates, message):
    with pytest.raises(ConfigError) as e:
        SandboxConfig.from_dict({"templates": templates})
    assert one_line(str(e.value)).startswith(message), str(e.value)


@pytest.mark.parametrize("field, value", [
    ("workspace_template", "/root"), ("workspace_template", "../../etc"),
    ("cgroup_parent", "/sys/fs/cgroup"), ("uid", 0), ("uid_range", [0, 1]),
    ("hide", []), ("workdir", "/"), ("journal", "/tmp/j.db"), ("cores", [0]),
    ("device", 0), ("isolation", "none"), ("cwd", "/root"),
])
def test_no_request_field_names_a_host_resource(plain, field, value):
    """The template path is the one such field there was; the others guard the audit
    of the request schema (each was refused already, as an unknown field)."""
    r = plain.post("/v1/actions", params={"wait": 30}, json={
        "kind": "cpu", "trajectory": f"t-{field}-{value}", "argv": ["id"], "timeout_s": 10,
        field: value})
    assert r.status_code == 422, r.text
    reason = one_line(r.json()["reason"]).removeprefix("request: ")
    assert reason.startswith(f"{field}: "), r.text
    assert "uid=0" not in r.text


@pytest.fixture(scope="module")
def with_endpoints():
    """A service with two endpoints: ``search`` proxied to a url, ``judge`` without."""
    specs, upstreams = parse_upstreams({
        "search": {"rpm": 600, "max_concurrency": 4, "url": "http://127.0.0.1:9/api"},
        "judge": {"rpm": 600, "max_concurrency": 4}})
    with serving(DispatcherConfig(scheduler="elastic_greedy", endpoints=specs),
                 ServeConfig(languages=[], upstreams=upstreams)) as s, \
            httpx.Client(base_url=s.url, timeout=60) as http:
        yield s.url, http


@pytest.mark.parametrize("endpoint, path, message", [
    ("judge", "{own}/v1/status", "http.url: over HTTP an api request calls only its "
     "endpoint's configured url (endpoints.<name>.url); endpoint 'judge' has none"),
    ("search", "{own}/v1/status", "http.url: must lie under endpoint search's url "
     "(http://127.0.0.1:9/api/...; no dot segments)"),
    ("search", "http://127.0.0.1:9/api/../admin", "http.url: must lie under"),
    ("search", "http://127.0.0.1:9/api/..%2fadmin", "http.url: must lie under"),
])
def test_an_api_request_over_http_calls_only_its_endpoints_url(with_endpoints, endpoint,
                                                               path, message):
    own, http = with_endpoints
    r = http.post("/v1/actions", params={"wait": 30}, json={
        "kind": "api", "endpoint": endpoint, "timeout_s": 5,
        "http": {"url": path.format(own=own), "method": "GET"}})
    assert r.status_code == 422, r.text
    assert r.json()["status"] == "rejected" and r.json()["value"] is None
    assert one_line(r.json()["reason"]).startswith(message), r.text


# ---------------------------------------------------------------- memory and caps


HOG = "b = b'x' * (256 << 20)\nprint('allocated', len(b))\n"  # 256 MiB, every page written


def test_run_code_without_memory_limit_dies_under_the_default_cap():
    needs_controllers("memory")
    config = dcfg(limits=RequestLimits(mem_mb=64))
    with serving(config, ServeConfig(languages=["python"])) as s, \
            httpx.Client(base_url=s.url, timeout=120) as http:
        r = http.post("/run_code", json={"code": HOG, "language": "python"})
        hog = http.post("/v1/actions", params={"wait": 60}, json={
            "kind": "cpu", "argv": ["python3", "-c", HOG], "timeout_s": 30})
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["status"] == "Failed", doc
    assert "allocated" not in doc["run_result"]["stdout"]
    assert hog.json()["status"] == "failed" and "allocated" not in hog.json()["stdout"]


def test_the_real_default_memory_cap_is_below_3_gb():
    for name in ("serve.yaml", "dispatch.yaml"):
        limits = yaml.safe_load((ROOT / "configs" / name).read_text())["limits"]
        assert RequestLimits.from_dict(limits) == RequestLimits()
    assert RequestLimits().mem_mb < 3000
    assert DispatcherConfig().limits.mem_mb == RequestLimits().mem_mb


@pytest.mark.parametrize("fields, message", [
    ({"mem_limit_mb": 20000}, "mem_limit_mb: 20000 MiB asked; a request may ask at most "
     "16384 (limits.max_mem_mb)"),
    ({"timeout_s": 100000}, "timeout_s: 100000 s asked; a request may ask at most 86400 "
     "(limits.max_timeout_s)"),
    ({"cpu_time_s": 100000}, "cpu_time_s: 100000 s asked; a request may ask at most 86400 "
     "(limits.max_cpu_time_s)"),
    ({"trajectory": "big", "workspace_mb": 10000}, "workspace_mb: 10000 MB asked; a "
     "request may ask at most 8192 (limits.max_workspace_mb)"),
    ({"pids_max": 100000}, "pids_max: 100000 asked; a request may ask at most 16384 "
     "(limits.max_pids)"),
])
def test_a_request_above_the_default_caps_is_refused(plain, fields, message):
    r = plain.post("/v1/actions", json={**ECHO, **fields}, params={"wait": 30})
    assert r.status_code == 422, r.text
    assert one_line(r.json()["reason"]) == message


def test_run_code_above_the_default_memory_cap_is_422(plain):
    r = plain.post("/run_code", json={"code": "print(1)", "memory_limit_MB": 20000})
    assert r.status_code == 422, r.text
    assert one_line(r.json()["detail"]) == ("memory_limit_MB: 20000 MiB asked; a request "
                                            "may ask at most 16384 (limits.max_mem_mb)")


CAPS = RequestLimits(max_cores=1, max_mem_mb=512, max_timeout_s=60, max_cpu_time_s=30,
                     max_workspace_mb=256, max_pids=100, mem_mb=128)


@pytest.mark.parametrize("fields, message", [
    ({"min_cores": 2}, "min_cores: 2 cores asked; a request may ask at most 1 "
     "(limits.max_cores)"),
    ({"mem_limit_mb": 4096}, "mem_limit_mb: 4096 MiB asked; a request may ask at most 512 "
     "(limits.max_mem_mb)"),
    ({"timeout_s": 3600}, "timeout_s: 3600 s asked; a request may ask at most 60 "
     "(limits.max_timeout_s)"),
    ({"cpu_time_s": 31}, "cpu_time_s: 31 s asked"),
    ({"trajectory": "w", "workspace_mb": 512}, "workspace_mb: 512 MB asked"),
    ({"pids_max": 1000}, "pids_max: 1000 asked; a request may ask at most 100"),
])
def test_a_request_above_the_caps_is_refused(fields, message):
    with serving(dcfg(limits=CAPS)) as s, httpx.Client(base_url=s.url, timeout=60) as http:
        r = http.post("/v1/actions", json={**ECHO, **fields}, params={"wait": 30})
        status = http.get("/v1/status").json()
    assert r.status_code == 422, r.text
    assert one_line(r.json()["reason"]).startswith(message), r.text
    assert status["limits"] == CAPS.to_dict()


@pytest.mark.parametrize("body, message", [
    ({"memory_limit_MB": 4096}, "memory_limit_MB: 4096 MiB asked; a request may ask at "
     "most 512 (limits.max_mem_mb)"),
    ({"run_timeout": 3600}, "run_timeout: 3600 s asked; a request may ask at most 60 "
     "(limits.max_timeout_s)"),
    ({"compile_timeout": 61}, "compile_timeout: 61 s asked"),
])
def test_run_code_above_the_caps_is_422(body, message):
    with serving(dcfg(limits=CAPS)) as s, httpx.Client(base_url=s.url, timeout=60) as http:
        r = http.post("/run_code", json={"code": "print(1)", **body})
    assert r.status_code == 422, r.text
    assert one_line(r.json()["detail"]).startswith(message), r.text


async def test_python_api_above_the_caps_is_rejected():
    async with Dispatcher(dcfg(limits=CAPS)) as d:
        r = await d.submit({**ECHO, "mem_limit_mb": 4096})
    assert r.status == "rejected" and one_line(r.reason).startswith("mem_limit_mb: 4096")


# ---------------------------------------------------------------- trajectory ownership


@pytest.fixture(scope="module")
def two_clients():
    config = ServeConfig(languages=[], tokens={"alice": ALICE, "bob": BOB})
    with serving(DispatcherConfig(scheduler="elastic_greedy"), config) as s, \
            httpx.Client(base_url=s.url, timeout=60, headers={
                "Authorization": f"Bearer {ALICE}"}) as alice, \
            httpx.Client(base_url=s.url, timeout=60, headers={
                "Authorization": f"Bearer {BOB}"}) as bob:
        yield alice, bob


def _open(alice: httpx.Client, trajectory: str) -> str:
    r = alice.post("/v1/actions", params={"wait": 30}, json={
        **ECHO, "trajectory": trajectory, "id": f"{trajectory}-1"})
    assert r.status_code == 200 and r.json()["status"] == "done", r.text
    return r.json()["id"]


@pytest.mark.parametrize("attack", ["close", "act", "act_by_header", "run_code", "read",
                                    "same_id"])
def test_another_client_cannot_touch_a_trajectory(two_clients, attack):
    alice, bob = two_clients
    rid = _open(alice, f"mine-{attack}")
    name = f"mine-{attack}"
    if attack == "close":
        r = bob.post(f"/v1/trajectories/{name}/close")
    elif attack == "act":
        r = bob.post("/v1/actions", json={**ECHO, "trajectory": name}, params={"wait": 30})
    elif attack == "act_by_header":
        r = bob.post("/v1/actions", json=ECHO, headers={"X-Trajectory-Id": name},
                     params={"wait": 30})
    elif attack == "run_code":
        r = bob.post("/run_code", json={"code": "print(1)", "trajectory": name})
    elif attack == "read":
        r = bob.get(f"/v1/actions/{rid}")
    else:
        r = bob.post("/v1/actions", json={**ECHO, "id": rid}, params={"wait": 30})
    expected = 404 if attack == "read" else 403
    assert r.status_code == expected, r.text
    detail = one_line(r.json()["detail"])
    assert detail == (f"id: {rid!r} is not known here" if attack == "read" else
                      f"id: {rid!r} belongs to another client" if attack == "same_id" else
                      f"trajectory: {name!r} belongs to another client")
    # The owner still may: read, act, close.
    assert alice.get(f"/v1/actions/{rid}").json()["status"] == "done"
    assert alice.post(f"/v1/trajectories/{name}/close").status_code == 200
