"""The event-driven simulator: timeouts, determinism, accounting at every event,
synchronous steps, GPU batching, and runs that cannot make progress."""

from __future__ import annotations

import dataclasses
from functools import cache

import numpy as np
import pytest

from metasched.agents import BASELINES, make_scheduler
from metasched.compose import profile
from metasched.core.metrics import API_REQ, N_COLS
from metasched.core.scheduler import Scheduler
from metasched.errors import ConfigError
from metasched.sim.simulator import SimulationError, Simulator


@cache
def small(name: str, steps: int = 1, trajectories: int = 24):
    w, c = profile(name)
    return dataclasses.replace(w, steps=steps, trajectories_per_step=trajectories), c


class AlwaysWait(Scheduler):
    name = "always_wait"

    def decide(self, state):
        return []


def assert_same_result(a, b):
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert x.shape == y.shape and np.array_equal(x, y), f.name
        else:
            assert x == y, f.name


# ------------------------------------------------------------------ timeouts


def test_timeout_fails_at_start_plus_timeout_and_frees_cores(make_workload, make_cluster):
    # Two 10 s actions with a 3 s timeout compete for a single core.
    w = make_workload({"kind": "cpu", "duration_s": 10.0, "timeout_s": 3.0}, trajectories=2)
    sim = Simulator(w, make_cluster(nodes=1, cores=1), seed=0)
    r = sim.run(make_scheduler("fifo"))
    order = np.argsort(r.start)
    assert r.start[order].tolist() == [1.0, 4.0]  # the second starts when the first is killed
    assert r.end[order].tolist() == [4.0, 7.0]  # start + timeout, not start + 10
    assert not r.ok.any()
    assert r.failure_reasons == {"timeout": 2}
    assert (r.counters["completed"], r.counters["failed"], r.counters["pending"]) == (0, 2, 0)
    assert r.makespan == 7.0
    assert sim.state.cpu.free == [1] and sim.state.cpu.busy == 0


@pytest.mark.parametrize("duration, ok", [(3.0, True), (3.0 + 1e-6, False), (2.0, True)])
def test_timeout_boundary(make_workload, make_cluster, duration, ok):
    w = make_workload({"kind": "cpu", "duration_s": duration, "timeout_s": 3.0})
    r = Simulator(w, make_cluster(), seed=0).run(make_scheduler("fifo"))
    assert r.ok.tolist() == [ok]
    assert r.end[0] - r.start[0] == pytest.approx(min(duration, 3.0))


@pytest.mark.parametrize("reward", [
    {"kind": "api", "endpoint": "e", "duration_s": 10.0, "timeout_s": 2.0},
    {"kind": "gpu", "service": "rm", "duration_s": 10.0, "timeout_s": 2.0},
], ids=["api", "gpu"])
def test_timeout_other_kinds(make_workload, make_cluster, reward):
    r = Simulator(make_workload(reward), make_cluster(), seed=0).run(make_scheduler("fifo"))
    assert r.ok.tolist() == [False]
    assert r.end[0] == r.start[0] + 2.0
    assert r.failure_reasons == {"timeout": 1}


def test_api_slot_freed_after_timeout(make_workload, make_cluster):
    # One concurrency slot: the second call starts when the first is killed at 1 + 2.
    w = make_workload({"kind": "api", "endpoint": "e", "duration_s": 10.0, "timeout_s": 2.0},
                      trajectories=2)
    c = make_cluster(endpoints={"e": {"rpm": 6000, "max_concurrency": 1}})
    r = Simulator(w, c, seed=0).run(make_scheduler("fifo"))
    assert sorted(r.start.tolist()) == [1.0, 3.0]
    assert sorted(r.end.tolist()) == [3.0, 5.0]


# ------------------------------------------------------------------ determinism


@pytest.mark.parametrize("scheduler", ["fifo", "random", "elastic_greedy", "static"])
def test_same_seed_same_result(scheduler):
    w, c = small("mixed")
    a = Simulator(w, c, seed=7).run(make_scheduler(scheduler))
    b = Simulator(w, c, seed=7).run(make_scheduler(scheduler))
    assert len(a.act) > 50
    assert_same_result(a, b)


@pytest.mark.parametrize("scheduler", ["fifo", "random"])
def test_different_seed_different_result(scheduler):
    w, c = small("mixed")
    a = Simulator(w, c, seed=7).run(make_scheduler(scheduler))
    b = Simulator(w, c, seed=8).run(make_scheduler(scheduler))
    assert a.submit.shape != b.submit.shape or not np.array_equal(a.submit, b.submit)
    assert a.makespan != b.makespan


def test_schedulers_see_the_same_workload_for_a_seed():
    """Common random numbers: the scheduler's generator is separate from the workload's."""
    w, c = small("mixed")
    a = Simulator(w, c, seed=3).run(make_scheduler("fifo"))
    b = Simulator(w, c, seed=3).run(make_scheduler("random"))
    assert np.array_equal(np.sort(a.lower_bound), np.sort(b.lower_bound))
    assert sorted(a.task.tolist()) == sorted(b.task.tolist())


# ------------------------------------------------------------------ accounting


def run_counting_invariants(w, c, scheduler, min_actions):
    sim = Simulator(w, c, seed=0, check_invariants=True)
    assert sim.instance.n_actions >= min_actions
    state = sim.state
    builtin = state.check_invariant
    calls = [0]

    def checked():
        calls[0] += 1
        builtin()
        # Independently of the counters: every finished action was recorded once.
        assert len(state.metrics.ok) + state.n_pending + state.n_running == state.n_submitted

    state.check_invariant = checked
    r = sim.run(make_scheduler(scheduler))
    assert calls[0] >= sim.n_events  # checked at every event
    n = r.counters["submitted"]
    assert n == sim.instance.n_actions
    assert n == r.counters["completed"] + r.counters["failed"]
    assert r.counters["pending"] == 0
    assert len(r.act) == n
    assert r.counters["completed"] == int(r.ok.sum())
    return r


@pytest.mark.slow  # ~15 s; the 10k case below checks every event under every heuristic
def test_accounting_invariant_every_event_100k_actions():
    w, c = profile("mixed")  # every pool kind; ~5,300 actions per step
    r = run_counting_invariants(dataclasses.replace(w, steps=21), c, "elastic_greedy", 100_000)
    assert r.counters["events"] >= 200_000


@pytest.mark.parametrize("scheduler", BASELINES)
def test_accounting_invariant_every_event_10k_actions(scheduler):
    w, c = small("mixed", steps=2, trajectories=256)
    run_counting_invariants(w, c, scheduler, 10_000)


def test_timeline_matches_totals():
    w, c = small("mixed")
    r = Simulator(w, c, seed=1, timeline_dt=5.0).run(make_scheduler("elastic_greedy"))
    assert r.timeline.shape[1] == N_COLS
    assert r.timeline.shape[0] == pytest.approx(np.ceil(r.makespan / 5.0), abs=1)
    assert np.allclose(r.timeline.sum(axis=0)[:API_REQ], r.totals[:API_REQ], rtol=1e-9)
    assert r.timeline[:, API_REQ].sum() == r.totals[API_REQ] == int((r.kind == 2).sum())


# ------------------------------------------------------------------ steps


def test_synchronous_steps_exact(make_workload, make_cluster):
    # Each step: 1 s generation, then a 2 s reward; the next step starts at its end.
    w = make_workload({"kind": "cpu", "duration_s": 2.0, "timeout_s": 10.0},
                      trajectories=2, steps=3)
    r = Simulator(w, make_cluster(), seed=0).run(make_scheduler("fifo"))
    assert r.step_start.tolist() == [0.0, 3.0, 6.0]
    assert r.step_end.tolist() == [3.0, 6.0, 9.0]
    assert sorted(r.submit.tolist()) == [1.0, 1.0, 4.0, 4.0, 7.0, 7.0]


def test_pause_between_steps(make_workload, make_cluster):
    # As above, with the trainer's pause of 5 s between steps (not part of a step).
    w = make_workload({"kind": "cpu", "duration_s": 2.0, "timeout_s": 10.0},
                      trajectories=2, steps=3)
    r = Simulator(dataclasses.replace(w, step_gap_s=5.0), make_cluster(), seed=0).run(
        make_scheduler("fifo"))
    assert r.step_start.tolist() == [0.0, 8.0, 16.0]
    assert r.step_end.tolist() == [3.0, 11.0, 19.0]


@pytest.mark.parametrize("fresh, ends", [
    (False, [2.0, 12.0, 22.0]),  # each step's calls wait for the last step's to leave
    (True, [2.0, 4.0, 6.0]),     # every step on a service started anew: its quota full
])
def test_fresh_quotas_each_step(make_workload, make_cluster, fresh, ends):
    # Two trajectories a step, each a 1 s search as its reward after 1 s of generation;
    # the quota admits 2 calls in any 10 s, so a step's calls use a window's allowance.
    w = make_workload({"kind": "api", "endpoint": "e", "duration_s": 1.0, "timeout_s": 100.0},
                      trajectories=2, steps=3)
    c = make_cluster(endpoints={"e": {"rpm": 12, "max_concurrency": 4, "window_s": 10.0}})
    r = Simulator(dataclasses.replace(w, step_fresh_quotas=fresh), c, seed=0).run(
        make_scheduler("fifo"))
    assert r.step_end.tolist() == pytest.approx(ends, abs=1e-6)


@pytest.mark.parametrize("stages, end", [
    ([["a", "a"]], 5.0),   # submitted together at 1 s: both done at 3 s, reward 4-5 s
    (["a", "a"], 7.0),     # one after the other: 1-3 s, 3-5 s, reward 6-7 s
])
def test_turn_groups_submit_stages_in_order_and_a_stage_together(make_workload, make_cluster,
                                                                  stages, end):
    from conftest import _workload_dict

    from metasched.sim.workload_config import parse_workload

    d = _workload_dict({"kind": "cpu", "duration_s": 1.0, "timeout_s": 10.0}, turns=1,
                       actions={"a": {"kind": "cpu", "prob": 1.0, "duration_s": 2.0,
                                      "timeout_s": 10.0}})
    d["tasks"]["t"]["turn_groups"] = [{"prob": 1.0, "actions": stages}]
    r = Simulator(parse_workload(d), make_cluster(), seed=0).run(make_scheduler("fifo"))
    assert r.step_end.tolist() == [end]
    assert r.counters["completed"] == 3


@pytest.mark.parametrize("stages, b_submit, end", [
    # a chain a -> b beside c: b as soon as a ends (2 s), c 1-5 s, reward 6-7 s
    ([[["a", "b"], "c"]], 2.0, 7.0),
    # a and c together, then b: b once both have ended (5 s), reward 7.5-8.5 s
    ([["a", "c"], "b"], 5.0, 8.5),
])
def test_a_chain_goes_on_when_its_own_action_ends(make_cluster, stages, b_submit, end):
    from conftest import _workload_dict

    from metasched.sim.workload_config import parse_workload

    acts = {n: {"kind": "cpu", "prob": p, "duration_s": d, "timeout_s": 10.0}
            for n, p, d in [("a", 0.5, 1.0), ("b", 0.25, 1.5), ("c", 0.25, 4.0)]}
    d = _workload_dict({"kind": "cpu", "duration_s": 1.0, "timeout_s": 10.0}, turns=1,
                       actions=acts)
    d["tasks"]["t"]["turn_groups"] = [{"prob": 1.0, "actions": stages}]
    r = Simulator(parse_workload(d), make_cluster(), seed=0).run(make_scheduler("fifo"))
    run_s = r.end - r.start
    assert r.counters["completed"] == 4
    assert r.submit[np.isclose(run_s, 1.5)].tolist() == [b_submit]
    assert r.step_end.tolist() == [end]


def test_a_trajectorys_turns_are_its_agent_turns(make_cluster):
    """Schedulers read a trajectory's turns as the dispatcher counts them (a request's
    turn number): a group of several actions is one turn, not one per action."""
    from conftest import _workload_dict

    from metasched.agents.queue import FifoScheduler
    from metasched.sim.workload_config import parse_workload

    seen: list[tuple[str, int]] = []

    class Watching(FifoScheduler):
        def decide(self, state):
            seen.extend((a.spec.name, a.traj.turn) for q in state.pending.values()
                        for a in q.values() if a.traj)
            return super().decide(state)

    acts = {n: {"kind": "cpu", "prob": 0.5, "duration_s": 1.0, "timeout_s": 10.0}
            for n in ("a", "b")}
    d = _workload_dict({"kind": "cpu", "duration_s": 1.0, "timeout_s": 10.0}, turns=3,
                       actions=acts)
    d["tasks"]["t"]["turn_groups"] = [{"prob": 1.0, "actions": [[["a", "b"], "a"], "b"]}]
    r = Simulator(parse_workload(d), make_cluster(), seed=0).run(Watching())
    assert r.counters["completed"] == 3 * 4 + 1
    assert sorted({turn for _, turn in seen}) == [1, 2, 3, 4]  # 3 agent turns, the reward


@pytest.mark.parametrize("name, steps", [("coding", 3), ("rm_math", 4)])
def test_synchronous_steps_on_profile(name, steps):
    w, c = small(name, steps=steps, trajectories=6)
    r = Simulator(w, c, seed=2).run(make_scheduler("elastic_greedy"))
    assert len(r.step_start) == len(r.step_end) == steps
    assert r.step_start[0] == 0.0
    assert np.array_equal(r.step_start[1:], r.step_end[:-1])  # no gap, no overlap
    assert (r.step_s > 0).all()
    assert r.makespan == r.step_end[-1]
    # Every action lives inside one step, and a step ends with its last action.
    step = np.searchsorted(r.step_end, r.submit, side="left")
    assert (r.submit >= r.step_start[step]).all()
    assert (r.end <= r.step_end[step]).all()
    for k in range(steps):
        assert r.end[step == k].max() == r.step_end[k]


# ------------------------------------------------------------------ GPU batching


@pytest.mark.parametrize("scheduler", BASELINES)
def test_gpu_requests_are_batched(make_workload, make_cluster, scheduler):
    """32 requests arrive at t = 1 on one device (max_batch 8, marginal 0.05, restore 4 s):
    4 batches of 8, each taking 0.5 x (1 + 0.05 x 7) = 0.675 s, the first after a restore."""
    w = make_workload({"kind": "gpu", "service": "rm", "duration_s": 0.5, "timeout_s": 300},
                      trajectories=32)
    r = Simulator(w, make_cluster(), seed=0).run(make_scheduler(scheduler))
    assert r.counters["submitted"] == 32 and r.ok.all()
    assert r.counters["grants"] == 4  # fewer batches than requests
    assert r.counters["gpu_restores"] == 1
    ends = np.unique(r.end)
    assert ends == pytest.approx([5.675, 6.35, 7.025, 7.7])
    assert [int((r.end == e).sum()) for e in ends] == [8, 8, 8, 8]


def test_gpu_batches_on_profile():
    w, c = small("rm_math", trajectories=64)
    r = Simulator(w, c, seed=0).run(make_scheduler("fifo"))
    n_gpu = int((r.kind == 1).sum())
    n_cpu = int((r.kind == 0).sum())
    assert n_gpu == 64  # one reward request per trajectory
    # Every cpu action is one grant; the gpu requests took fewer grants than requests.
    assert r.counters["grants"] - n_cpu < n_gpu


# ------------------------------------------------------------------ no progress


@pytest.mark.timeout(30)
@pytest.mark.parametrize("reward", [
    {"kind": "cpu", "duration_s": 1.0, "timeout_s": 10.0},
    {"kind": "gpu", "service": "rm", "duration_s": 1.0, "timeout_s": 10.0},
    {"kind": "api", "endpoint": "e", "duration_s": 1.0, "timeout_s": 10.0},
], ids=["cpu", "gpu", "api"])
def test_always_waiting_scheduler_raises(make_workload, make_cluster, reward):
    w = make_workload(reward, trajectories=3, steps=2)
    sim = Simulator(w, make_cluster(), seed=0)
    with pytest.raises(SimulationError, match="3 actions pending"):
        sim.run(AlwaysWait())
    assert sim.n_waits >= 1 and sim.state.n_grants == 0


def test_illegal_grant_raises(make_workload, make_cluster):
    from metasched.core.actions import Grant
    from metasched.core.state import InvalidGrant

    class TooGreedy(Scheduler):
        def decide(self, state):
            return [Grant(a, cores=99, node=0) for a in state.pending["cpu"].values()]

    w = make_workload({"kind": "cpu", "duration_s": 1.0, "timeout_s": 10.0, "cores": [1, 128]})
    with pytest.raises(InvalidGrant):
        Simulator(w, make_cluster(), seed=0).run(TooGreedy())


# ------------------------------------------------------------------ regressions


@pytest.mark.timeout(30)
@pytest.mark.parametrize("scheduler", ["fifo", "elastic_greedy"])
@pytest.mark.parametrize("window_s, starts", [
    (1.0, [1.0, 2.0, 3.0]),  # one call in any 1 s: each waits for the one before to leave
    (60.0, [1.0, 1.0, 1.0]),  # 60 in any minute: all three at once
])
def test_api_calls_waiting_for_the_quota_window_complete(make_workload, make_cluster,
                                                         scheduler, window_s, starts):
    # 60 rpm; three calls at t = 1.
    w = make_workload({"kind": "api", "endpoint": "e", "duration_s": 0.1, "timeout_s": 10.0},
                      trajectories=3)
    c = make_cluster(endpoints={"e": {"rpm": 60, "max_concurrency": 10, "window_s": window_s}})
    r = Simulator(w, c, seed=0).run(make_scheduler(scheduler))
    assert sorted(r.start.tolist()) == pytest.approx(starts)


@pytest.mark.timeout(30)
def test_sandbox_without_cpu_nodes_is_an_error(make_workload, make_cluster):
    from metasched.sim.workload_config import check_compatible

    w = make_workload({"kind": "api", "endpoint": "e", "duration_s": 0.1, "timeout_s": 10.0},
                      sandbox={"mem_gb": 0, "startup_s": 0}, trajectories=2)
    c = make_cluster(nodes=0, cores=0, mem_gb=0.0)
    with pytest.raises((ConfigError, SimulationError)):
        check_compatible(w, c)
        Simulator(w, c, seed=0).run(make_scheduler("fifo"))


def test_api_utilisation_at_most_one_with_burst(make_workload, make_cluster):
    # 60 rpm over a 10 s window: 10 calls start at once, the run lasts 1.1 s.
    w = make_workload({"kind": "api", "endpoint": "e", "duration_s": 0.1, "timeout_s": 10.0},
                      trajectories=10)
    c = make_cluster(endpoints={"e": {"rpm": 60, "max_concurrency": 10, "window_s": 10.0}})
    r = Simulator(w, c, seed=0).run(make_scheduler("fifo"))
    assert r.ok.all() and r.makespan == pytest.approx(1.1)
    assert 0.0 <= r.utilisation()["api"] <= 1.0


# ------------------------------------------------------------------ what the live clock has


class SeenSpecs(Scheduler):
    """fifo that records every pending action's spec when it is first asked about it."""

    name = "seen_specs"

    def __init__(self) -> None:
        self.inner = make_scheduler("fifo")
        self.specs: dict[int, object] = {}

    def reset(self, state, rng) -> None:
        self.inner.reset(state, rng)

    def decide(self, state):
        for kind in ("cpu", "gpu", "api"):
            for a in state.pending[kind].values():
                self.specs.setdefault(a.id, a.spec)
        return self.inner.decide(state)


def test_max_cores_above_the_node_is_capped_as_live(make_workload, make_cluster):
    """A 1-16 core action on a 4-core node is a 1-4 core action (the dispatcher caps
    requests the same way): its estimates, observation and lower bound say 4 cores."""
    from metasched.agents import make_advisor
    from metasched.core.observation import SLOT_FEATURES, ObsConfig, ObservationEncoder

    w = make_workload({"kind": "cpu", "duration_s": 10.0, "timeout_s": 100.0,
                       "cores": [1, 16], "parallel_fraction": 0.9})
    sim = Simulator(w, make_cluster(cores=4), seed=0)
    assert sim.next_decision()
    (a,) = sim.state.pending["cpu"].values()
    assert (a.spec.min_cores, a.spec.max_cores) == (1, 4)
    assert a.lower_bound_s == pytest.approx(10.0 * (0.1 + 0.9 / 4))
    enc = ObservationEncoder(sim.state, ObsConfig(), make_advisor(ObsConfig()))
    row = enc.observe(sim.state)["slots"][:len(SLOT_FEATURES)]
    assert row[SLOT_FEATURES.index("max_cores_frac")] == 1.0


@pytest.mark.parametrize("duration, timeout, ok", [(2.0, 10.0, True), (2.0, 2.2, False)])
def test_launch_s_adds_to_every_cpu_run(make_workload, make_cluster, duration, timeout, ok):
    w = make_workload({"kind": "cpu", "duration_s": duration, "timeout_s": timeout})
    cluster = dataclasses.replace(make_cluster(), cpu_launch_s=0.5)
    r = Simulator(w, cluster, seed=0).run(make_scheduler("fifo"))
    assert r.ok.tolist() == [ok]
    assert r.end[0] - r.start[0] == pytest.approx(min(duration + 0.5, timeout))
    assert r.lower_bound[0] == pytest.approx(min(duration + 0.5, timeout))


def test_launch_s_drawn_per_action_around_its_median(make_workload, make_cluster):
    """With a 90th percentile the start-up is log-normal per action, from the run's own
    generator: deterministic for a seed, and the workload drawn as without it."""
    from metasched.core.cluster_config import launch_sigma

    w = make_workload({"kind": "cpu", "duration_s": 1.0, "timeout_s": 100.0},
                      actions={"x": {"kind": "cpu", "prob": 1.0, "duration_s": 1.0,
                                     "timeout_s": 100.0}}, turns=400)
    jittered = dataclasses.replace(make_cluster(cores=4), cpu_launch_s=0.5,
                                   cpu_launch_sigma=launch_sigma(0.5, 1.0))
    a = Simulator(w, jittered, seed=0).run(make_scheduler("fifo"))
    b = Simulator(w, jittered, seed=0).run(make_scheduler("fifo"))
    assert_same_result(a, b)
    launch = a.end - a.start - 1.0
    assert np.median(launch) == pytest.approx(0.5, rel=0.1)
    assert np.percentile(launch, 90) == pytest.approx(1.0, rel=0.15)
    plain = Simulator(w, make_cluster(cores=4), seed=0)
    assert plain.instance.steps == Simulator(w, jittered, seed=0).instance.steps


def test_without_a_cost_model_schedulers_see_the_profile_estimates(make_workload, make_cluster):
    w = make_workload({"kind": "cpu", "duration_s": 2.0, "timeout_s": 100.0},
                      actions={"x": {"kind": "cpu", "prob": 1.0, "duration_s": 2.0,
                                     "timeout_s": 100.0}}, turns=4, estimate_error=0.5)
    sim = Simulator(w, make_cluster(), seed=3)
    rec = SeenSpecs()
    sim.run(rec)
    profile_est = [t.action.est_s for t in sim.instance.steps[0][0].turns]
    assert [rec.specs[i].est_s for i in sorted(rec.specs)] == profile_est
    assert len(set(profile_est)) == len(profile_est)  # noisy, one per action


def test_cost_model_estimates_are_learned_from_measured_runs(make_workload, make_cluster):
    """With the dispatcher's cost model, an action's estimate is the hint until its
    signature has run, then the measured run in one-core seconds (Amdahl undone, the
    command start-up included, as live)."""
    from metasched.core.cost_model import CostModel

    action = {"kind": "cpu", "prob": 1.0, "duration_s": 4.0, "timeout_s": 100.0,
              "cores": [2, 2], "parallel_fraction": 0.5}
    w = make_workload({"kind": "cpu", "duration_s": 1.0, "timeout_s": 100.0},
                      actions={"x": action}, turns=3, estimate_error=0.5)
    cluster = dataclasses.replace(make_cluster(), cpu_launch_s=0.3)
    model = CostModel(alpha=1.0)
    sim = Simulator(w, cluster, seed=3, cost_model=model)
    rec = SeenSpecs()
    sim.run(rec)
    seen = [rec.specs[i] for i in sorted(rec.specs)]
    hints = [t.action.est_s for t in sim.instance.steps[0][0].turns]
    run_s = 0.3 + 4.0 * (0.5 + 0.5 / 2)  # measured on its 2 cores
    learned = run_s / (0.5 + 0.5 / 2)
    assert [s.name for s in seen] == ["x", "x", "x", "reward"]
    assert seen[0].est_s == hints[0]
    assert [s.est_s for s in seen[1:3]] == pytest.approx([learned, learned])
    assert seen[3].est_s == hints[3]  # the reward's signature has not run yet
    assert model.count == {"cpu:t:x": 3, "cpu:t:reward": 1}
    assert all(s.true_s == t.action.true_s for s, t in zip(
        seen, sim.instance.steps[0][0].turns, strict=True))


def test_cost_model_learns_gpu_batches_without_the_restore(make_workload, make_cluster):
    from metasched.core.cost_model import CostModel

    w = make_workload({"kind": "gpu", "service": "rm", "duration_s": 1.0, "timeout_s": 100.0},
                      steps=2, estimate_error=0.5)
    model = CostModel(alpha=1.0)
    sim = Simulator(w, make_cluster(), seed=0, cost_model=model)
    rec = SeenSpecs()
    r = sim.run(rec)
    first, second = (rec.specs[i] for i in sorted(rec.specs))
    assert r.end[0] - r.start[0] == pytest.approx(4.0 + 1.0)  # restore, then the batch
    assert second.est_s == pytest.approx(1.0)
    assert first.est_s == sim.instance.steps[0][0].turns[0].action.est_s


@pytest.mark.parametrize("scheduler", ["fifo", "elastic_greedy", "static"])
def test_pipelined_nodes_account_for_every_action_at_every_event(scheduler):
    """With ``ahead_per_core`` the same state hands cpu actions to full nodes, which
    start them as cores free: every action ends once, no node runs more than its cores,
    and the accounting holds at every event (a scheduler holding cores for trajectories
    gets no hand-offs: their actions start on the held cores)."""
    w, c = small("coding", trajectories=64)
    c = dataclasses.replace(c, cpu_nodes=2, cores_per_node=4)  # busy enough to queue
    sim = Simulator(w, c, seed=0, check_invariants=True, ahead_per_core=1)
    state = sim.state
    builtin = state.check_invariant
    most_ahead = [0]

    def checked():
        builtin()
        assert min(state.cpu.free) >= 0 and state.cpu.busy <= state.cpu.total
        assert all(len(q) <= state.ahead_per_node for q in state.ahead)
        most_ahead[0] = max(most_ahead[0], state.n_ahead)

    state.check_invariant = checked
    r = sim.run(make_scheduler(scheduler))
    assert r.counters["submitted"] == sim.instance.n_actions == len(r.act)
    assert r.counters["completed"] + r.counters["failed"] == r.counters["submitted"]
    assert state.n_ahead == 0 and not any(state.ahead)
    if scheduler == "static":
        assert most_ahead[0] == 0
    else:
        assert most_ahead[0] >= 1
