"""``backend=ray`` in ``metasched-dispatch`` and ``metasched-serve``: the job file run
through the dispatcher actor from a command-line process that finds the cluster with
``address=auto``, the service in front of the actor over real HTTP on 127.0.0.1 (the
quota proxy's calls made by the actor), and the one-line errors.

Ray runs here as one local node bound to 127.0.0.1 (2 CPUs, one logical GPU served by a
CPU stand-in), started once for the session (conftest). Without the ``ray`` extra the Ray cases
skip, saying so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from helpers import COMMAND_PY, free_port

from metasched.cli.backend_settings import ray_settings
from metasched.errors import ConfigError
from metasched.runtime.api_calls import RetryPolicy
from metasched.runtime.dispatch import DispatcherConfig

PY = COMMAND_PY


def _gone(ray, name: str) -> bool:
    try:
        ray.get_actor(name, namespace="metasched")
    except ValueError:
        return True
    return False


def _dispatch(tmp_path: Path, ray, run: str, *args: str) -> subprocess.CompletedProcess:
    """``metasched-dispatch ... backend=ray`` in a process of its own, finding the
    cluster as ``ray.address=auto`` does (RAY_ADDRESS, as ``ray start`` leaves it)."""
    exe = Path(sys.executable).parent / "metasched-dispatch"
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    return subprocess.run([str(exe), "backend=ray", "scheduler=elastic_greedy",
                           f"hydra.run.dir={tmp_path / run}", *args], capture_output=True,
                          text=True, timeout=240, env=env, cwd=tmp_path)


@pytest.mark.isolation
@pytest.mark.subprocess
def test_dispatch_runs_a_job_file_through_the_actor(ray_cluster, tmp_path):
    """A job file through the actor: results, table and files as on one machine (a
    trajectory's workspace kept across its actions, a bad line rejected alone); the
    actor it started is gone after."""
    _run_job_file(ray_cluster, tmp_path, f"apps-{uuid.uuid4().hex[:8]}")


@pytest.mark.isolation
@pytest.mark.subprocess
@pytest.mark.slow
def test_dispatch_on_ray_resumes_from_its_journal(ray_cluster, tmp_path):
    """Run again on the same journal, the finished ids are answered from it, not run
    again (a new dispatcher actor opens it)."""
    name = f"apps-{uuid.uuid4().hex[:8]}"
    first = _run_job_file(ray_cluster, tmp_path, name)
    journal = tmp_path / "first" / "journal.db"
    p = _dispatch(tmp_path, ray_cluster, "again", "jobs=jobs.jsonl", f"ray.name={name}",
                  f"journal={journal}", "progress=false")
    assert p.returncode == 0, p.stderr
    again = {r["id"]: r for r in map(json.loads, (tmp_path / "again" / "results.jsonl")
                                     .read_text().splitlines())}
    for rid in ("line-1", "line-2", "line-3"):  # the same runs, answered from the journal
        assert again[rid]["started_at"] == first[rid]["started_at"], rid
    assert _gone(ray_cluster, name)


def _run_job_file(ray_cluster, tmp_path: Path, name: str) -> dict[str, dict]:
    """Run a small job file through actor ``name`` (started and stopped by the run);
    its results by id, checked (its callers are marked ``isolation``)."""
    lines = [
        {"kind": "cpu", "argv": [PY, "-c", "open('note', 'w').write('kept')"],
         "timeout_s": 30, "trajectory": "t1"},
        # Turns are not ordered by the dispatcher: the reader waits for the writer's file.
        {"kind": "cpu", "argv": [PY, "-c", "import os, time\n"
                                 "while not os.path.exists('note'): time.sleep(0.05)\n"
                                 "print(open('note').read())"],
         "timeout_s": 30, "trajectory": "t1", "turn": 1},
        {"kind": "cpu", "argv": [PY, "-c", "import sys; sys.exit(3)"], "timeout_s": 30},
        {"kind": "cpu", "timeout_s": 30},  # no argv: rejected alone
    ]
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text("".join(json.dumps(j) + "\n" for j in lines))
    p = _dispatch(tmp_path, ray_cluster, "first", "jobs=jobs.jsonl", f"ray.name={name}",
                  "progress=false")
    assert p.returncode == 0, p.stderr
    assert f"started dispatcher {name!r} on Ray: 1 nodes x 2 cores, 1 GPUs" in p.stderr
    assert "live on Ray" in p.stdout and "| elastic_greedy | 2 | 1 | 1 |" in p.stdout, p.stdout
    # This machine's cores are not what the actions ran on: no measured figure, not 0 %.
    row = next(ln for ln in p.stdout.splitlines() if ln.startswith("| elastic_greedy |"))
    assert row.split("|")[10].strip() == "n/a", row
    first = {r["id"]: r for r in map(json.loads, (tmp_path / "first" / "results.jsonl")
                                     .read_text().splitlines())}
    assert {k: r["status"] for k, r in first.items()} == {
        "line-1": "done", "line-2": "done", "line-3": "failed", "line-4": "rejected"}
    assert first["line-2"]["stdout"].strip() == "kept"
    assert first["line-4"]["reason"].startswith("jobs.jsonl:4: ")
    assert (tmp_path / "first" / "results.md").exists()
    assert _gone(ray_cluster, name)
    return first


class _Upstream(BaseHTTPRequestHandler):
    """429 to the first call of each path, then the request echoed."""

    seen: dict[str, int] = {}

    def do_POST(self):  # noqa: N802 - http.server's naming
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        n = _Upstream.seen[self.path] = _Upstream.seen.get(self.path, 0) + 1
        data = json.dumps({"path": self.path, "body": body.decode(), "seen": n}).encode()
        self.send_response(429 if n == 1 else 200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Retry-After", "0")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.mark.isolation
def test_serve_fronts_the_actor(ray_cluster, tmp_path):
    """The service in front of the dispatcher actor, over HTTP on 127.0.0.1: /run_code
    (stdin, files in and out, a failure), /v1/actions and /v1/actions/{id} (asked of the
    actor once the service keeps no results), /v1/status, /metrics, and the quota
    proxy, whose call the actor makes and retries past the upstream's 429. A second
    client asking for other settings under the name, or a name held by another actor,
    is refused in one line."""
    from metasched.runtime.ray_backend.remote import RaySettings, open_dispatcher
    from metasched.serve import BackgroundServer, ServeConfig, create_app
    from metasched.serve.config import parse_upstreams

    upstream = ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    endpoints, upstreams = parse_upstreams({"search": {
        "rpm": 600, "max_concurrency": 4,
        "url": f"http://127.0.0.1:{upstream.server_address[1]}"}})
    name = f"apps-{uuid.uuid4().hex[:8]}"
    settings = RaySettings(name=name, ahead_per_core=1)
    dcfg = DispatcherConfig(scheduler="elastic_greedy", endpoints=endpoints,
                            retry=RetryPolicy(max_attempts=4, backoff_s=0.05),
                            journal=str(tmp_path / "journal.db"))
    remote = open_dispatcher(settings, dcfg, endpoints=["search"])
    app = create_app(remote, ServeConfig(upstreams=upstreams, languages=["python"],
                                         keep_results=0))
    try:
        with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
            ran = c.post("/run_code", json={
                "code": "import sys; print(sys.stdin.read()[::-1]);"
                        " open('out.txt', 'w').write(open('in.txt').read().upper())",
                "stdin": "olleh", "files": {"in.txt": "aGk="},  # "hi"
                "fetch_files": ["out.txt"]}).json()
            assert ran["status"] == "Success", ran
            assert ran["run_result"]["stdout"] == "hello\n" and ran["files"] == {"out.txt": "SEk="}
            failed = c.post("/run_code", json={"code": "raise SystemExit(4)"}).json()
            assert failed["status"] == "Failed" and failed["run_result"]["return_code"] == 4

            r = c.post("/v1/actions", params={"wait": 30}, json={
                "id": "a1", "kind": "cpu", "argv": [PY, "-c", "print(6 * 7)"],
                "timeout_s": 30})
            assert r.status_code == 200 and r.json()["stdout"] == "42\n", r.text
            looked = c.get("/v1/actions/a1").json()  # kept by none here: the actor's journal
            assert looked["status"] == "done" and looked["stdout"] == "42\n"
            assert c.get("/v1/actions/nope").status_code == 404

            proxied = c.post("/v1/endpoints/search/q", content=b"cats")
            assert proxied.status_code == 200, proxied.text
            assert proxied.json() == {"path": "/q", "body": "cats", "seen": 2}

            status = c.get("/v1/status").json()
            assert status["backend"] == "ray" and status["scheduler"] == "elastic_greedy"
            assert status["ahead_per_core"] == 1  # ray.ahead_per_core reached the actor
            assert status["pools"]["gpu"]["devices"][0]["index"] == 0
            assert "search" in status["pools"]["api"]
            metrics = c.get("/metrics").text
            assert 'metasched_run_code_total{language="python",status="Success"} 1.0' in metrics
            assert 'endpoint="search",status="200"} 1.0' in metrics, metrics

            with pytest.raises(ConfigError, match="scheduler: the running dispatcher"):
                open_dispatcher(settings, DispatcherConfig(scheduler="fifo"))
    finally:
        upstream.shutdown()
        upstream.server_close()
    assert _gone(ray_cluster, name)  # started by the service: stopped with it

    @ray_cluster.remote(num_cpus=0)
    class Impostor:
        def ping(self) -> str:
            return "pong"

    held = f"apps-{uuid.uuid4().hex[:8]}"
    other = Impostor.options(name=held, namespace="metasched").remote()
    ray_cluster.get(other.ping.remote())
    try:
        with pytest.raises(ConfigError, match="ray.name: .* is not a metasched dispatcher"):
            open_dispatcher(RaySettings(name=held), DispatcherConfig(scheduler="elastic_greedy"))
    finally:
        ray_cluster.kill(other)


# ---------------------------------------------------------------------- settings


@pytest.mark.parametrize("cfg, field, message", [
    ({"backend": "k8s"}, "backend", "must be one of local, ray"),
    ({"backend": "ray", "cores": [0, 1]}, "cores", "does not apply with backend=ray"),
    ({"backend": "ray", "gpu_standin": 1}, "gpu_standin", "does not apply with backend=ray"),
    ({"backend": "ray", "compact": 60}, "compact", "does not apply with backend=ray"),
    ({"backend": "ray", "ray": {"submit": "rpc"}}, "ray.submit",
     "must be one of task, daemon, stream"),
    ({"backend": "ray", "ray": {"ahead_per_core": -1}}, "ray.ahead_per_core", "must be >= 0"),
    ({"backend": "ray", "ray": {"ahead_per_core": "two"}}, "ray.ahead_per_core",
     "must be a whole number"),
    ({"backend": "ray", "ray": {"cores_per_node": 0}}, "ray.cores_per_node", ">= 1"),
    ({"backend": "ray", "ray": {"name": ""}}, "ray.name", "must not be empty"),
    ({"backend": "ray", "ray": {"name": " "}}, "ray.name", "must not be empty"),
    ({"backend": "ray", "ray": 3}, "ray", "must be a JSON object"),
    ({"backend": "ray", "ray": {"keep": "yes"}}, "ray.keep", "true or false"),
    ({"backend": "ray", "ray": {"adress": "auto"}}, "ray.adress",
     "unknown field, did you mean address? (expected one of: address,"),
])
def test_bad_backend_settings_are_one_line(cfg, field, message):
    pytest.importorskip("ray", reason="needs the ray extra")
    with pytest.raises(ConfigError) as e:
        ray_settings(cfg)
    assert e.value.field == field and message in str(e.value)


def test_ray_settings_take_submit_and_ahead_per_core():
    pytest.importorskip("ray", reason="needs the ray extra")
    s = ray_settings({"backend": "ray", "ray": {"submit": "stream", "ahead_per_core": 0}})
    assert (s.submit, s.ahead_per_core) == ("stream", 0)
    assert ray_settings({"backend": "ray"}).ahead_per_core is None  # the backend's default


def test_local_backend_needs_no_ray_settings():
    assert ray_settings({"backend": "local", "cores": [0]}) is None
    assert ray_settings({}) is None


def test_the_settings_take_the_backends_default_way():
    pytest.importorskip("ray", reason="needs the ray extra")
    from metasched.runtime.ray_backend import cluster

    assert ray_settings({"backend": "ray"}).submit == cluster.DEFAULT_SUBMIT


def test_ray_not_installed_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(ConfigError, match="backend: ray is not installed here: pip install "
                                          "'metasched\\[ray\\]'"):
        ray_settings({"backend": "ray"})


@pytest.mark.subprocess
def test_no_cluster_at_ray_address_for_auto_is_one_line_at_once(tmp_path):
    """``ray.address=auto`` (the default) with RAY_ADDRESS where nothing listens: one
    line naming it, at once (Ray itself retries for a minute)."""
    pytest.importorskip("ray", reason="needs the ray extra")
    (tmp_path / "jobs.jsonl").write_text('{"kind": "cpu", "argv": ["true"]}\n')
    exe = Path(sys.executable).parent / "metasched-dispatch"
    address = f"127.0.0.1:{free_port()}"
    p = subprocess.run([str(exe), "backend=ray", "jobs=jobs.jsonl",
                        f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path, env={**os.environ, "RAY_ADDRESS": address})
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert lines[0].startswith(f"error: ray.address: no Ray cluster reachable at 'auto' "
                               f"({address}) (Connection refused)"), lines[0]


@pytest.mark.subprocess
def test_no_cluster_at_the_address_is_one_line(tmp_path):
    """Nothing listens at ``ray.address``: one line, at once, exit 2 (metasched-serve
    opens the dispatcher through the same call)."""
    pytest.importorskip("ray", reason="needs the ray extra")
    (tmp_path / "jobs.jsonl").write_text('{"kind": "cpu", "argv": ["true"]}\n')
    exe = Path(sys.executable).parent / "metasched-dispatch"
    address = f"127.0.0.1:{free_port()}"
    p = subprocess.run([str(exe), "backend=ray", f"ray.address={address}", "jobs=jobs.jsonl",
                        f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert lines[0].startswith(f"error: ray.address: no Ray cluster reachable at "
                               f"'{address}'"), lines[0]
