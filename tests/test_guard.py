"""The core's starvation guard (``max_wait_s``): it serves what a scheduler leaves
waiting, within capacity, and bounds every wait."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import shrunk

from metasched.compose import PROFILES
from metasched.core.actions import ActionSpec
from metasched.core.guard import WaitGuard
from metasched.core.scheduler import Scheduler
from metasched.sim.sampling import IndependentAction, WorkloadInstance
from metasched.sim.simulator import SimulationError, Simulator

MAX_WAIT = 5.0


class AlwaysWait(Scheduler):
    name = "always_wait"

    def decide(self, state):
        return []


class Probe(Simulator):
    """Records, per action, since when it could start (checked after every instant and
    every grant) and what it got; checks capacity after every grant."""

    def __init__(self, *args, **kwargs) -> None:
        self.feasible_since: dict[int, float] = {}
        self.at_start: dict[int, tuple[float, float, float | None]] = {}
        super().__init__(*args, **kwargs)

    def _probe(self) -> None:
        st = self.state
        for pend in st.pending.values():
            for a in pend.values():
                if st.feasible(a):
                    self.feasible_since.setdefault(a.id, st.t)
                else:
                    self.feasible_since.pop(a.id, None)

    def _process_instant(self) -> None:
        super()._process_instant()
        self._probe()

    def apply(self, grant) -> None:
        st = self.state
        for a in (grant.action, *grant.batch):
            self.at_start[a.id] = (a.submit_t, st.t, self.feasible_since.get(a.id))
        super().apply(grant)
        self._check_capacity()
        self._probe()

    def _check_capacity(self) -> None:
        st = self.state
        cpu, gpu = st.cpu, st.gpu
        assert all(0 <= f <= c for f, c in zip(cpu.free, cpu.cores, strict=True))
        assert 0 <= cpu.busy <= cpu.total
        assert 0 <= gpu.busy == sum(d.busy for d in gpu.devices) <= gpu.total
        for ep in st.api.endpoints.values():
            assert 0 <= ep.in_flight <= ep.spec.max_concurrency
            assert ep.req >= -1e-9 and ep.tok >= -1e-9


def late_starts(sim: Probe, max_wait: float) -> list[tuple[int, float, float, float | None]]:
    """Actions that started later than ``max_wait`` after submission and later than the
    instant they last became able to start: (id, submit, start, feasible since)."""
    out = []
    for aid, (submit, start, since) in sim.at_start.items():
        bound = submit + max_wait if since is None else max(submit + max_wait, since)
        if start > bound + 1e-9:
            out.append((aid, submit, start, since))
    return out


# ------------------------------------------------------------------ the guard serves


@pytest.mark.parametrize("name", PROFILES)
def test_always_wait_completes_under_the_guard(name):
    w, c = shrunk(name)
    sim = Probe(w, c, 0, max_wait_s=MAX_WAIT, check_invariants=True)
    r = sim.run(AlwaysWait())  # would raise SimulationError without the guard
    n = r.counters["submitted"]
    assert n > 0
    assert r.counters["pending"] == 0
    assert r.counters["completed"] + r.counters["failed"] == n == r.act.size
    assert r.counters["grants"] > 0 and r.counters["guard_fired"] == r.counters["grants"]
    assert len(sim.at_start) == n  # every action was started, by the guard
    assert not np.isnan(r.start).any()


@pytest.mark.parametrize("name", PROFILES)
def test_always_wait_without_guard_raises(name):
    w, c = shrunk(name)
    with pytest.raises(SimulationError, match="nothing left to happen"):
        Simulator(w, c, 0, max_wait_s=None).run(AlwaysWait())


@pytest.mark.parametrize("bad", [0, 0.0, -1.0, -1e-9, float("nan")])
def test_guard_rejects_non_positive_limits(bad, make_workload, make_cluster):
    with pytest.raises(ValueError, match="max_wait_s"):
        WaitGuard(bad)
    w = make_workload({"kind": "cpu", "duration_s": 1.0, "timeout_s": 10.0})
    with pytest.raises(ValueError, match="max_wait_s"):
        Simulator(w, make_cluster(), 0, max_wait_s=bad)


def test_guard_off_and_on_construct():
    assert WaitGuard(None).max_wait_s is None and WaitGuard(None).fired == 0
    assert WaitGuard(0.5).max_wait_s == 0.5


@pytest.mark.parametrize("name", PROFILES)
def test_guard_grants_within_capacity(name):
    w, c = shrunk(name)
    # Grants are checked by the state (InvalidGrant) and capacity by the probe after each.
    sim = Probe(w, c, 1, max_wait_s=1.0, check_invariants=True)
    r = sim.run(AlwaysWait())
    assert r.counters["guard_fired"] > 0 and r.counters["pending"] == 0
    u = r.utilisation()
    assert 0.0 <= u["cpu"] <= 1.0 and 0.0 <= u["gpu"] <= 1.0 and u["api"] <= 1.0 + 1e-9


def test_guard_leaves_a_working_scheduler_alone():
    from metasched.agents import make_scheduler

    w, c = shrunk("rm_math")
    r = Simulator(w, c, 0, max_wait_s=1e6).run(make_scheduler("elastic_greedy"))
    assert r.counters["guard_fired"] == 0 and r.counters["pending"] == 0


# ------------------------------------------------------------------ the wait bound


def test_wait_bounded_minimal(make_workload, make_cluster):
    # Two 1-core actions arrive at t=1 and t=20 on an idle 4-core node.
    w = make_workload({"kind": "cpu", "duration_s": 1.0, "timeout_s": 10.0})
    spec = ActionSpec("cpu", "x", 1.0, 1.0, 10.0)
    inst = WorkloadInstance(independent=[IndependentAction(1.0, "t", spec),
                                         IndependentAction(20.0, "t", spec)])
    sim = Probe(w, make_cluster(), 0, instance=inst, max_wait_s=MAX_WAIT)
    sim.run(AlwaysWait())
    assert sim.at_start[0][2] == 1.0  # it could start from its submission on
    # It should start by t = 1 + 5; it starts at t = 20, when the next action arrives.
    assert late_starts(sim, MAX_WAIT) == []


@pytest.mark.parametrize("name", ["rm_math", "mixed"])
def test_wait_bounded_on_profiles(name):
    w, c = shrunk(name)
    sim = Probe(w, c, 0, max_wait_s=MAX_WAIT)
    sim.run(AlwaysWait())
    assert late_starts(sim, MAX_WAIT) == []


def test_an_idle_cluster_is_not_kept_idle(make_workload, make_cluster):
    """A wait while nothing runs is overridden at once (serve_stalled), not at the
    deadline; a wait while something runs is respected."""
    w = make_workload({"kind": "cpu", "duration_s": 1.0, "timeout_s": 10.0})
    spec = ActionSpec("cpu", "x", 1.0, 1.0, 10.0)
    inst = WorkloadInstance(independent=[IndependentAction(1.0, "t", spec),
                                         IndependentAction(1.5, "t", spec)])
    sim = Probe(w, make_cluster(), 0, instance=inst, max_wait_s=100.0)
    r = sim.run(AlwaysWait())
    assert sim.at_start[0][:2] == (1.0, 1.0)  # idle: served on arrival
    assert sim.at_start[1][:2] == (1.5, 2.0)  # the first runs: waits for its end
    assert r.counters["guard_fired"] == 2


@pytest.mark.parametrize("busy_device", [False, True])
def test_idle_means_nothing_runs_and_no_device_is_busy(busy_device, make_cluster):
    from metasched.core.state import ClusterState

    st = ClusterState(make_cluster(), {})
    st.gpu.busy = int(busy_device)
    assert WaitGuard.idle(st) is not busy_device


# ------------------------------------------------------------------ the guard's cost


class _CountingQueue(dict):
    """A pending queue that counts the entries read through ``values()`` (how the guard
    walks it)."""

    read = 0

    def values(self):
        for a in super().values():
            _CountingQueue.read += 1
            yield a


@pytest.mark.parametrize("kind", ["cpu", "gpu", "api"])
def test_a_pass_over_an_old_queue_reads_what_it_grants_not_the_queue(kind, make_cluster):
    """10,000 actions past the limit, room for a few: each pass of ``overdue`` and
    ``next_deadline`` reads about as many queue entries as it grants (a walk of the whole
    overdue queue at every pass is what made a 100,000-deep live queue crawl)."""
    from metasched.core.actions import Action
    from metasched.core.pools import ServiceSpec
    from metasched.core.state import ClusterState

    n = 10_000
    cluster = make_cluster(nodes=1, cores=4, gpus=2, endpoints={
        "e": {"rpm": 60_000, "max_concurrency": 3, "window_s": 1.0}})
    state = ClusterState(cluster, {"rm": ServiceSpec(mem_gb=1, restore_s=0, max_batch=1)})
    state.pending[kind] = _CountingQueue()
    spec = {"cpu": ActionSpec("cpu", "x", 1.0, 1.0, 100.0),
            "gpu": ActionSpec("gpu", "x", 1.0, 1.0, 100.0, service="rm"),
            "api": ActionSpec("api", "x", 1.0, 1.0, 100.0, endpoint="e")}[kind]
    guard = WaitGuard(MAX_WAIT)
    assert guard.next_deadline(state) is None  # the guard follows the state from here on
    for i in range(n):
        state.submit(Action(i, spec, "t", None, 0, 0.0))
    room = {"cpu": 4, "gpu": 2, "api": 3}[kind]
    state.advance(MAX_WAIT + 1.0)
    reads, granted, running = [], 0, []
    for step in range(50):
        _CountingQueue.read = 0
        assert guard.next_deadline(state) is None  # every pending action is overdue
        grants = guard.overdue(state)
        reads.append(_CountingQueue.read)
        assert len(grants) == (room if step == 0 else 1)  # what the pool has room for
        for g in grants:
            running.extend(state.start(g)[0])
        granted += len(grants)
        state.advance(state.t + 0.5)
        done = running.pop(0)  # one finishes: room for one more
        state.finish(done, True)
        if kind == "gpu":
            state.release_device(done.device)
    assert granted == room + 49 and guard.fired == granted
    assert max(reads) <= room + 2, reads  # not n: the queue was not walked
    # An action arriving now is the next deadline, found without a walk.
    state.submit(Action(n, spec, "t", None, 0, state.t))
    _CountingQueue.read = 0
    assert guard.next_deadline(state) == pytest.approx(state.t + MAX_WAIT)
    assert _CountingQueue.read <= 2
