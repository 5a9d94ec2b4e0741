"""The live dispatcher: real commands on local cores, GPU stand-ins, API calls, faults,
bad input, idempotency, fallback and the journal."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from helpers import COMMAND_PY, cpu, running
from helpers import dispatcher_config as cfg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metasched.core.pools import EndpointSpec
from metasched.core.scheduler import Scheduler
from metasched.errors import ConfigError
from metasched.runtime.api_calls import RetryPolicy
from metasched.runtime.dispatch import Dispatcher, DispatcherConfig
from metasched.runtime.gpu import linear_scorer
from metasched.runtime.journal import Journal
from metasched.runtime.requests import Result
from metasched.runtime.sandbox.config import SandboxConfig

PY = COMMAND_PY  # what a sandbox's user can run (see helpers)
CORES = sorted(os.sched_getaffinity(0))
EP = {"e": EndpointSpec(rpm=6000, max_concurrency=4, tpm=None, window_s=1.0)}


async def dispatch(requests: list[dict], config: DispatcherConfig | None = None, **kw):
    async with Dispatcher(config or cfg(), **kw) as d:
        results = await asyncio.gather(*(d.submit(r) for r in requests))
        return results, d


async def test_cpu_action_runs_with_its_allocation_and_times():
    (r,), d = await dispatch([cpu(PY, "-c", "print('hello')", id="a")])
    assert r.status == "done" and r.stdout.strip() == "hello" and r.exit_code == 0
    assert r.id == "a" and len(r.allocation["cores"]) == 1
    assert r.queued_at <= r.started_at <= r.finished_at
    assert d.state.n_done == 1 and d.state.cpu.free == [len(CORES)]


@pytest.mark.skipif(len(CORES) < 2, reason="needs 2 cores")
@pytest.mark.parametrize("grant", [[CORES[0]], [CORES[1]], CORES[:2]])
async def test_command_cannot_use_cores_it_was_not_granted(grant):
    """The child's affinity is exactly its grant (the dispatcher owns only ``grant``)."""
    code = "import os; print(sorted(os.sched_getaffinity(0)))"
    req = cpu(PY, "-c", code, min_cores=len(grant), max_cores=len(grant))
    (r,), _ = await dispatch([req], cfg(cores=grant))
    assert r.ok, r.reason
    assert json.loads(r.stdout) == sorted(r.allocation["cores"]) == grant


async def test_elastic_grant_sets_thread_variables_to_the_core_count():
    code = "import os; print(len(os.sched_getaffinity(0)), os.environ['OMP_NUM_THREADS'])"
    req = cpu(PY, "-c", code, min_cores=1, max_cores=len(CORES), parallel_fraction=0.95)
    (r,), _ = await dispatch([req])
    n, omp = r.stdout.split()
    assert int(n) == int(omp) == len(r.allocation["cores"]) >= 1


@pytest.mark.parametrize("req, reason", [
    (cpu(PY, "-c", "import sys; sys.exit(3)"), "exit code 3"),
    (cpu(PY, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"),
     "killed by SIGSEGV"),
    (cpu(PY, "-c", "import time; time.sleep(30)", timeout_s=0.5), "timeout after 0.5 s"),
    (cpu(PY, "-c", "x = bytearray(2 * 1024**3)", mem_limit_mb=400),
     "memory limit exceeded (400 MB)"),
    (cpu("/nonexistent/program"), "cannot start"),
])
async def test_faults_are_reported_and_cores_come_back(req, reason):
    ok_req = cpu(PY, "-c", "print(1)")
    (bad, good), d = await dispatch([req, ok_req])
    assert bad.status == "failed" and reason in bad.reason
    assert good.ok
    assert d.state.cpu.free == [len(CORES)] and d.state.cpu.busy == 0
    assert sorted(d.backend.free_cores) == CORES
    assert d.stats()["failed"] == 1


@pytest.mark.parametrize("req, reason", [
    ({"kind": "tpu", "timeout_s": 1}, "kind: must be one of"),
    (cpu("/bin/true", min_cores=len(CORES) + 1, max_cores=len(CORES) + 1),
     f"{len(CORES) + 1} cores asked, this dispatcher has {len(CORES)}"),
    (cpu("/bin/true", timeout_s=-1), "timeout_s: must be > 0"),
    ({"kind": "gpu", "service": "nope", "timeout_s": 1}, "unknown service 'nope'"),
    ({"kind": "api", "endpoint": "nope", "timeout_s": 1, "http": {"url": "http://127.0.0.1:9"}},
     "unknown endpoint 'nope'"),
    ({"kind": "api", "endpoint": "e", "timeout_s": 1, "tokens": 10,
      "http": {"url": "http://127.0.0.1:9"}}, None),
])
async def test_bad_input_is_rejected_alone(req, reason):
    async with Dispatcher(cfg(gpu_standin=1, endpoints={
            "e": EndpointSpec(rpm=60, max_concurrency=1, tpm=5, window_s=1.0)}),
            services={"scorer": linear_scorer(4)}) as d:
        bad, good = await asyncio.gather(d.submit(req), d.submit(cpu("/bin/true")))
    assert bad.status == "rejected" and "\n" not in bad.reason
    assert reason is None or reason in bad.reason, bad.reason
    assert good.ok


async def test_gpu_request_without_nvml_fails_fast_with_a_clear_error(monkeypatch):
    import pynvml

    def no_nvml():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_nvml)
    (r,), d = await dispatch([{"kind": "gpu", "argv": ["/bin/true"], "timeout_s": 1}])
    assert r.status == "rejected" and "no GPU" in r.reason and "NVML" in r.reason
    assert d.devices == [] and d.state.gpu.total == 0


async def test_gpu_service_batches_on_a_standin_device_and_scores_correctly():
    pytest.importorskip("torch", reason="the example scorer is a torch module")
    svc = linear_scorer(4, seed=1)
    model = svc.load()
    payloads = [[1.0, 2.0], [0.5, 0.0, 1.0], [3.0], [0.0, 0.0, 0.0, 1.0]]
    reqs = [{"kind": "gpu", "service": "scorer", "payload": p, "timeout_s": 30} for p in payloads]
    results, d = await dispatch(reqs, cfg(gpu_standin=1), services={"scorer": svc})
    want = svc.infer(model, payloads)
    assert [r.status for r in results] == ["done"] * 4
    assert [r.value for r in results] == pytest.approx(want, abs=1e-6)
    assert all(r.allocation["device"] == 0 for r in results)
    assert d.state.gpu.busy == 0 and d.state.gpu.restores == 1


async def test_gpu_command_sees_only_its_device():
    code = "import os; print(repr(os.environ.get('CUDA_VISIBLE_DEVICES')))"
    (r,), _ = await dispatch([{"kind": "gpu", "argv": [PY, "-c", code], "timeout_s": 30}],
                             cfg(gpu_standin=1))
    assert r.ok and r.stdout.strip() == "''"  # a stand-in: no GPU visible


async def test_gpu_command_runs_on_cores_counted_in_the_cpu_pool():
    """A gpu command gets ``min_cores`` cores, runs on them only, and the scheduler sees
    them busy meanwhile (a cpu action needing every core waits for it)."""
    n = len(CORES)
    code = "import os, time; print(sorted(os.sched_getaffinity(0))); time.sleep(1)"

    async with Dispatcher(cfg(gpu_standin=1)) as d:
        gpu = asyncio.ensure_future(d.submit({"kind": "gpu", "argv": [PY, "-c", code],
                                              "timeout_s": 30, "min_cores": 1}))
        for _ in range(200):
            await asyncio.sleep(0.01)
            if d.state.cpu.busy:
                break
        busy, free = d.state.cpu.busy, d.state.cpu.free[0]
        wide = await d.submit(cpu("/bin/true", min_cores=n, max_cores=n))
        g = await gpu
    assert g.ok, g.stderr
    assert len(g.allocation["cores"]) == 1 and json.loads(g.stdout) == g.allocation["cores"]
    assert busy == 1 and free == n - 1
    assert wide.ok and wide.started_at >= g.finished_at - 0.05  # it waited for the core


class _JsonHandler(BaseHTTPRequestHandler):
    """A quiet test server's handler that answers with JSON."""

    def reply(self, status: int, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


class _Flaky(_JsonHandler):
    calls = 0

    def do_POST(self):  # noqa: N802 - http.server's naming
        type(self).calls += 1
        n = int(self.headers.get("Content-Length", 0))
        body = json.loads(self.rfile.read(n))
        status = 429 if type(self).calls <= 2 else 200
        self.reply(status, json.dumps({"echo": body}).encode())


async def test_api_call_retries_on_429_and_charges_the_quota_per_attempt():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/search"
        req = {"kind": "api", "endpoint": "e", "timeout_s": 20,
               "http": {"url": url, "json": {"q": "x"}}}
        (r,), d = await dispatch([req], cfg(endpoints=EP, retry=RetryPolicy(4, 0.01, 0.05)))
    finally:
        server.shutdown()
    assert r.ok and r.value == {"echo": {"q": "x"}} and r.attempts == 3
    ep = d.state.api.endpoints["e"]
    assert ep.requests == 3 and ep.in_flight == 0


class _Port(_JsonHandler):
    protocol_version = "HTTP/1.1"  # keep-alive
    # Each answer in one write: two small writes on a kept-alive connection wait out the
    # client's delayed ACK (40 ms) under Nagle.
    wbufsize = -1

    def do_POST(self):  # noqa: N802 - http.server's naming
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.reply(200, json.dumps({"port": self.client_address[1]}).encode())


async def test_api_calls_share_the_dispatchers_pooled_connection():
    """One HTTP client per dispatcher: calls one after another reuse its connection (the
    server sees one client port), and closing the dispatcher closes the client."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Port)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    req = {"kind": "api", "endpoint": "e", "timeout_s": 20,
           "http": {"url": f"http://127.0.0.1:{server.server_address[1]}/"}}

    try:
        async with Dispatcher(cfg(endpoints=EP)) as d:
            out = [await d.submit(req) for _ in range(4)]
            client = d.http
        results = out
    finally:
        server.shutdown()
    assert all(r.ok for r in results)
    assert len({r.value["port"] for r in results}) == 1
    assert client.is_closed


async def test_api_callable():
    async def call():
        await asyncio.sleep(0.01)
        return {"score": 1}
    async with Dispatcher(cfg(endpoints=EP)) as d:
        r = await d.submit({"kind": "api", "endpoint": "e", "timeout_s": 5}, call=call)
    assert r.ok and r.value == {"score": 1}


async def test_same_id_runs_once():
    async with Dispatcher(cfg()) as d:
        req = cpu(PY, "-c", "import uuid; print(uuid.uuid4())", id="once")
        a, b = await asyncio.gather(d.submit(req), d.submit(req))
    assert a is b and a.ok and len(a.stdout.strip()) == 36
    assert d.state.n_submitted == 1 and d.state.n_done == 1  # it ran once


async def test_accepted_requests_are_journaled_before_the_ack_and_results_after(tmp_path):
    db = tmp_path / "j.db"

    async with Dispatcher(cfg(journal=db)) as d:
        fut = d.accept(cpu("/bin/true", id="k1"))
        d.flush()  # otherwise committed at the end of this loop turn
        with Journal(db, lock=False) as j:  # another connection sees it committed
            assert j.status("k1") == "queued"
        r = await fut
    with Journal(db) as j:
        assert j.status("k1") == "finished"
        assert json.loads(j.result("k1"))["status"] == r.status == "done"

    async def again():  # a finished id is answered from the journal, not run again
        async with Dispatcher(cfg(journal=db)) as d:
            out = await d.submit(cpu("/bin/true", id="k1"))
            other = await d.submit(cpu("/bin/false", id="k1"))  # another request, same id
            return out, other, d.state.n_submitted
    r2, other, n = await again()
    assert r2.ok and r2.finished_at == r.finished_at and n == 0
    assert other.status == "rejected" and other.reason.startswith(
        "id: 'k1' was accepted before with a different request")


async def test_journal_holds_running_process_groups_and_every_start(tmp_path):
    """A running command's start (with its process group) is committed within
    ``journal_delay_s``; a command that starts and ends within one group commit gets
    its start recorded in the same update as its result."""
    db = tmp_path / "j.db"

    async with Dispatcher(cfg(journal=db)) as d:
        slow = d.accept(cpu("/bin/sleep", "1", id="slow"))
        quick = await d.submit(cpu("/bin/true", id="quick"))
        await asyncio.sleep(0.2)  # well past journal_delay_s (5 ms)
        with Journal(db, lock=False) as j:
            orphans = j.orphans()
        slow = await slow
    assert slow.ok and quick.ok
    assert [k for k, _ in orphans] == ["slow"] and orphans[0][1] > 0
    rows = sqlite3.connect(db).execute(
        "SELECT key, state, attempts, pid, started_at IS NOT NULL FROM requests ORDER BY seq")
    assert rows.fetchall() == [("slow", "finished", 1, None, 1), ("quick", "finished", 1, None, 1)]


class _Broken(Scheduler):
    name = "broken"

    def decide(self, state):
        raise RuntimeError("boom")


async def test_failing_policy_falls_back_to_elastic_greedy(caplog):
    results, d = await dispatch([cpu("/bin/true") for _ in range(5)], scheduler=_Broken())
    assert all(r.ok for r in results)
    assert "boom" in d.fallback_reason and d.scheduler.name == "elastic_greedy"
    assert sum("falling back" in m for m in caplog.messages) == 1  # logged once


async def test_unloadable_checkpoint_falls_back(tmp_path):
    (tmp_path / "metadata.json").write_text("{not json")
    results, d = await dispatch([cpu("/bin/true")], cfg(scheduler=str(tmp_path)))
    assert results[0].ok and d.scheduler.name == "elastic_greedy"
    assert "cannot load scheduler" in d.fallback_reason


async def test_shipped_policy_runs_live_and_observations_have_the_env_shapes():
    async with Dispatcher(DispatcherConfig(sample_interval_s=0.05)) as d:
        futs = [d.accept(cpu(PY, "-c", "import time; time.sleep(0.2)", min_cores=1,
                             max_cores=2, trajectory=f"t{i % 3}", turn=i // 3,
                             reward=i >= 5))
                for i in range(8)]
        obs = d.observe()
        results = await asyncio.gather(*futs)
    assert not d.fallback_reason, d.fallback_reason
    assert d.scheduler.name.endswith("checkpoints/default")
    assert all(r.ok for r in results)
    enc = d.encoder
    assert obs["slots"].shape == (enc.cfg.k_slots * 24,)
    assert obs["action_mask"].shape == (enc.cfg.n_actions,)
    assert d.stats()["decision_latency_us"]["p50"] > 0
    assert d.state.trajectories == {}  # each closed when its reward action ended


def _hypothesis_values():
    return st.one_of(st.none(), st.booleans(), st.integers(-3, 2 ** 40),
                     st.floats(allow_nan=True), st.text(max_size=4),
                     st.lists(st.sampled_from(["/bin/true", "", "x"]), max_size=2))


_KEYS = ["id", "kind", "task", "trajectory", "turn", "reward", "timeout_s", "est_s", "argv",
         "min_cores", "max_cores", "service", "payload", "endpoint", "tokens", "http", "junk"]


@settings(max_examples=25, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.lists(st.one_of(
    st.dictionaries(st.sampled_from(_KEYS), _hypothesis_values(), max_size=6),
    st.fixed_dictionaries({"kind": st.sampled_from(["cpu", "gpu", "api", "tpu"]),
                           "timeout_s": st.sampled_from([-1, 0, 5, 1e9])},
                          optional={k: _hypothesis_values() for k in _KEYS[8:]}),
    st.builds(lambda: cpu("/bin/true"))), min_size=40, max_size=40))
async def test_generated_bad_input_never_stops_the_dispatcher(requests):
    """1,000 generated requests (25 x 40): each is rejected with a one-line reason, fails,
    or runs; a valid request after each batch is always served."""
    async with Dispatcher(cfg(gpu_standin=1, endpoints=EP),
                          services={"scorer": linear_scorer(4)}) as d:
        out = await asyncio.gather(*(d.submit(r) for r in requests))
        last = await d.submit(cpu("/bin/true"))
    assert last.ok
    for r in out:
        assert r.status in ("done", "failed", "rejected")
        assert r.status == "done" or (r.reason and "\n" not in r.reason)
    assert d.state.cpu.busy == 0 and d.state.n_running == 0


async def test_cost_model_learns_what_the_policy_sees():
    """After a signature has run, the next action's estimate is the measured duration
    (one-core seconds), not the caller's hint."""
    async with Dispatcher(cfg()) as d:
        req = cpu(PY, "-c", "import time; time.sleep(0.3)", name="nap", est_s=50.0)
        await d.submit(req)
        d.accept(dict(req, id="next"))  # queued at once (no journal)
        seen = [a.spec.est_s for a in d.state.pending["cpu"].values()]
        est = d.cost.estimate("cpu:default:nap")
    assert 0.3 <= est < 5.0
    assert seen == [est]


@pytest.mark.parametrize("demand, guard_fired", [({"cpu": {"swe": 10.0}}, 0), ({}, 1)],
                         ids=["told", "unknown"])
async def test_task_demand_sizes_the_partitioning_baselines(demand, guard_fired):
    """task_isolated partitions cores by the demand it is told (as the simulator tells it
    from the workload); told nothing, it has no partition, and only the guard's
    idle-cluster rule starts the action."""
    (r,), d = await dispatch([cpu("/bin/true", task="swe")],
                             cfg(scheduler="task_isolated", task_demand=demand))
    assert r.ok
    assert d.state.task_demand["cpu"] == demand.get("cpu", {})
    assert d.guard.fired == guard_fired


async def test_request_estimates_are_what_the_scheduler_sees():
    """estimates="given": the caller's est_s stands after the signature has run (as
    each action's own estimate does in simulation); without one, the cost model's."""
    async with Dispatcher(cfg(estimates="given")) as d:
        req = cpu("/bin/true", name="nap", est_s=50.0)
        await d.submit(req)
        d.accept(dict(req, id="next", est_s=7.0))
        d.accept({k: v for k, v in req.items() if k != "est_s"} | {"id": "bare"})
        seen, learned = ({a.spec.est_s for a in d.state.pending["cpu"].values()},
                         d.cost.estimate("cpu:default:nap"))
    assert seen == {7.0, learned} and learned < 5.0
    with pytest.raises(ConfigError, match="estimates"):
        Dispatcher(cfg(estimates="exact"))


async def test_cgroup_parent_that_is_not_a_cgroup_falls_back_to_affinity(tmp_path, caplog):
    sandbox = SandboxConfig(cgroups="v2", cgroup_parent=str(tmp_path))
    (r,), d = await dispatch([cpu("/bin/true")], cfg(sandbox=sandbox))
    assert r.ok and d.sandboxes.tree is None
    assert any("sandbox cgroups incomplete" in m and "not a cgroup v2 directory" in m
               and "CPU affinity" in m for m in caplog.messages)


async def test_standin_gpu_utilisation_is_sampled():
    async with Dispatcher(cfg(gpu_standin=2), services={"s": linear_scorer(4)}) as d:
        await d.submit({"kind": "gpu", "service": "s", "payload": [1.0], "timeout_s": 30})
        await asyncio.sleep(0.12)
        d = d
    assert len(d.backend.monitor.last_gpu) == 2 and "gpu" in d.stats()["measured_utilisation"]


async def test_restart_fails_what_cannot_run_here_and_runs_the_rest(tmp_path):
    """A journaled request for a service the new dispatcher lacks, or an api callable
    (not replayable), ends failed with the reason; the others run."""
    db = tmp_path / "j.db"

    async def first():
        d = Dispatcher(cfg(journal=db, gpu_standin=1, endpoints=EP),
                       services={"scorer": linear_scorer(4)})
        await d.start()

        async def never():
            await asyncio.Event().wait()
        d.accept({"id": "g", "kind": "gpu", "service": "scorer", "payload": [1.0],
                  "timeout_s": 30})
        d.accept({"id": "a", "kind": "api", "endpoint": "e", "timeout_s": 30}, call=never)
        d.accept(cpu("/bin/true", id="c"))
        d.flush()
        d.loop.closed = True  # stop here as a crash would: nothing more runs or is recorded
        d.journal.close()

    await first()

    async def second():
        async with Dispatcher(cfg(journal=db)) as d:
            return await d.accept(cpu("/bin/true", id="c"))  # resubmitted: deduplicated
    assert (await second()).ok
    with Journal(db) as j:
        out = {k: Result.from_json(j.result(k)) for k in "ga"}
    assert out["g"].status == "failed" and "cannot run here" in out["g"].reason
    assert "no GPU" in out["g"].reason
    assert out["a"].status == "failed" and "not replayable" in out["a"].reason


class _AlwaysWait(Scheduler):
    name = "always_wait"

    def decide(self, state):
        return []


async def test_idle_cluster_rule_holds_live_as_in_simulation():
    """A scheduler that always waits: the first action is served on arrival (idle
    cluster), the second when the first has ended, as the simulator does."""
    async with Dispatcher(cfg(cores=CORES[:1]), scheduler=_AlwaysWait()) as d:
        a, b = await asyncio.gather(
            d.submit(cpu(PY, "-c", "import time; time.sleep(0.3)")),
            d.submit(cpu("/bin/true")))
    assert a.ok and b.ok and d.guard.fired == 2
    assert b.started_at >= a.finished_at - 1e-3


async def test_policy_that_cannot_see_this_machine_falls_back():
    """More GPU services than the per-action policy's observation holds: elastic_greedy,
    and the reason (the shipped meta-policy reads no such observation)."""
    services = {f"s{i}": linear_scorer(4, seed=i) for i in range(4)}  # + the command one
    (r,), d = await dispatch([cpu("/bin/true")],
                             DispatcherConfig(scheduler="checkpoints/per_action",
                                              gpu_standin=1, sample_interval_s=0.05),
                             services=services)
    assert r.ok and d.scheduler.name == "elastic_greedy"
    assert "GPU services: 5 exceed the observation's 4" in d.fallback_reason


async def test_idle_trajectories_are_closed_and_their_held_cores_return():
    """static holds cores for a trajectory; without a reward action the trajectory is
    closed after trajectory_idle_s and the cores come back."""
    async with Dispatcher(cfg(scheduler="static", trajectory_idle_s=0.2,
                              sample_interval_s=0.05)) as d:
        await d.submit(cpu("/bin/true", trajectory="t", turn=0))
        held = d.state.cpu.held
        await asyncio.sleep(0.5)
        later, trajs = d.state.cpu.held, dict(d.state.trajectories)
    assert held > 0 and later == 0 and trajs == {}


@pytest.mark.parametrize("parallel", [1, 3])
async def test_held_cores_are_the_trajectorys_own_and_its_parallel_actions_share_them(parallel):
    """static holds one core per trajectory: a trajectory's actions, parallel ones too,
    run on that core, the other cores stay free for other trajectories, and the core
    returns to the pool when the trajectory closes."""
    async with Dispatcher(cfg(scheduler="static",
                              scheduler_params={"cores_per_sandbox": 1})) as d:
        first = await asyncio.gather(*(d.submit(cpu(
            PY, "-c", "import time; time.sleep(0.2)", trajectory="t", turn=0))
            for _ in range(parallel)))
        free_while_held = sorted(d.backend.free_cores)
        other = await d.submit(cpu("/bin/true", trajectory="u", turn=0))
        last = await d.submit(cpu("/bin/true", trajectory="t", turn=1, reward=True))
        await d.submit(cpu("/bin/true", trajectory="u", turn=1, reward=True))
        free_after = sorted(d.backend.free_cores)
    assert all(r.status == "done" for r in [*first, other, last])
    held = {tuple(r.allocation["cores"]) for r in first}
    assert len(held) == 1 and held == {tuple(last.allocation["cores"])}
    assert free_while_held == sorted(set(CORES) - set(held.pop()))
    assert free_after == CORES


def test_unusable_cores_are_a_config_error():
    from metasched.errors import ConfigError

    with pytest.raises(ConfigError, match="not usable here"):
        Dispatcher(cfg(cores=[max(CORES) + 1]))


class _BrokenWait:
    async def wait(self):
        raise RuntimeError("bug")


@pytest.mark.parametrize("where", ["start", "wait"])
async def test_an_executor_bug_fails_its_action_instead_of_hanging(monkeypatch, where):
    import metasched.runtime.dispatch.executors.local as mod

    def broken(*args, **kwargs):
        if where == "start":
            raise RuntimeError("bug")
        return _BrokenWait()

    monkeypatch.setattr(mod, "launch", broken)  # where the dispatcher starts commands
    (r, s), d = await dispatch([cpu("/bin/true"), cpu("/bin/true")])
    assert r.status == s.status == "failed" and r.reason == "internal error: RuntimeError: bug"
    assert d.state.cpu.busy == 0 and sorted(d.backend.free_cores) == CORES


class _Recorder(_JsonHandler):
    """Records when each request arrived (by the request's path) and how many were in
    flight; answers after ``delay`` seconds."""

    arrivals: dict[str, float] = {}
    in_flight = 0
    peak = 0
    delay = 0.0
    lock = threading.Lock()

    def do_POST(self):  # noqa: N802 - http.server's naming
        import time as _time

        cls = type(self)
        with cls.lock:
            cls.arrivals[self.path] = _time.monotonic()
            cls.in_flight += 1
            cls.peak = max(cls.peak, cls.in_flight)
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        _time.sleep(cls.delay)
        # Out of flight before the answer leaves: once the client has it, it may start
        # the next call, which could otherwise arrive before this thread counts down.
        with cls.lock:
            cls.in_flight -= 1
        self.reply(200, b"{}")


@pytest.mark.parametrize("rpm, window_s, concurrency, delay", [
    (1200, 0.5, 64, 0.0),   # the window binds: 10 in any 0.5 s, bursts included
    (60000, 1.0, 3, 0.1),   # concurrency binds: at most 3 in flight
])
async def test_live_api_calls_keep_to_the_quota(rpm, window_s, concurrency, delay):
    """The dispatcher starts calls as the endpoint's window allows (to within 2 ms on its
    own clock): no ``window_s`` holds more than the allowance, however the calls bunch.
    The server sees them so, give or take the client's latency: 20 ms, plus how much the
    time from a call's start to its arrival varied in this run (a burst's first calls
    open their connections together; under load that spreads)."""
    _Recorder.arrivals, _Recorder.in_flight, _Recorder.peak = {}, 0, 0
    _Recorder.delay = delay
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    spec = EndpointSpec(rpm=rpm, max_concurrency=concurrency, window_s=window_s)
    try:
        reqs = [{"kind": "api", "endpoint": "e", "timeout_s": 30, "id": str(i),
                 "http": {"url": f"{url}/{i}"}} for i in range(30)]
        results, _ = await dispatch(reqs, cfg(endpoints={"e": spec}))
    finally:
        server.shutdown()
    assert all(r.ok for r in results)
    assert _Recorder.peak <= concurrency
    cap = int(spec.req_capacity)

    def gaps(times: list[float]) -> list[float]:  # call k after call k - cap (sorted)
        ts = sorted(times)
        return [b - a for a, b in zip(ts, ts[cap:], strict=False)]

    assert min(gaps([r.started_at for r in results]), default=window_s) >= window_s - 0.002
    latency = [_Recorder.arrivals[f"/{r.id}"] - r.started_at for r in results]  # + offset
    spread = max(latency) - min(latency)  # the clocks' offset cancels
    assert (min(gaps(list(_Recorder.arrivals.values())), default=window_s)
            >= window_s - 0.02 - spread)


async def test_per_action_measurements_are_bounded_in_a_long_lived_dispatcher():
    reqs = [cpu("/bin/true") for _ in range(12)] + [cpu("/bin/false")]
    results, d = await dispatch(reqs, cfg(metrics_window=5))
    r = d.run_result()
    assert r.act.size == 5  # the most recent five
    assert r.counters["completed"] == 12 and r.counters["failed"] == 1  # all counted
    assert r.failure_reasons == {"exit code 1": 1}


async def test_enqueue_returns_once_the_request_is_durable(tmp_path):
    db = tmp_path / "j.db"

    async with Dispatcher(cfg(journal=db)) as d:
        fut = await d.enqueue(cpu("/bin/true", id="e1"))
        with Journal(db, lock=False) as j:  # committed before enqueue returned
            assert j.status("e1") in ("queued", "running")
        bad = await d.enqueue({"kind": "tpu"})
        assert bad.done() and bad.result().status == "rejected"
        r = await fut
    assert r.ok


async def test_close_without_drain_kills_commands_whose_task_never_ran(tmp_path):
    """Commands start when scheduled, before their task first runs (in a sandbox: the
    spawn request is on its way to the sandbox server); one whose waiting task is
    cancelled before it first runs is still killed and cleaned up by close()."""
    marker = f"{30 + os.getpid() % 1000 / 1000:.3f}"  # this test's own sleep

    def sleeping() -> list:
        return running(["sleep", marker])

    d = Dispatcher(cfg(workdir=str(tmp_path)))
    await d.start()
    d.accept(cpu("sleep", marker, id="long"))
    d.schedule()  # as a completion would: the command starts now
    (proc,) = d.executors.commands
    assert not proc.not_started
    for _ in range(500):  # blocking: no loop turn, so the task does not run
        if sleeping():
            break
        time.sleep(0.01)
    assert sleeping(), "the command did not start"
    await d.close(drain=False)  # cancels the task before its first step
    for _ in range(200):  # killed (and reaped by whoever started it)
        if not sleeping():
            break
        await asyncio.sleep(0.01)
    d = d
    assert sleeping() == []
    assert d.executors.commands == set() and list(tmp_path.iterdir()) == []


async def test_cgroups_without_favordynmods_are_a_note_on_the_confinement_line(caplog):
    """A cgroup mount without ``favordynmods`` is harmless (milliseconds after an idle
    spell): said as a note in the one sandboxes line, not as a warning of its own."""
    import logging

    caplog.set_level(logging.INFO)
    (r,), d = await dispatch([cpu("/bin/true")])
    if d.sandboxes.tree is None:
        pytest.skip("no writable cgroups here")
    assert r.ok
    assert not any("favordynmods" in rec.getMessage() for rec in caplog.records
                   if rec.levelno >= logging.WARNING)
    line = next(m for m in caplog.messages if m.startswith("sandboxes: "))
    favordynmods = d.sandboxes.hierarchies.favordynmods
    assert ("note: mounted without favordynmods" in line) is not favordynmods
    assert "\n" not in line
