"""The deadline rule in the simulator: an action still queued at its latest start runs
time-shared on busy cores, and an oversubscribed node runs every action on it at
``cores / demand`` of full speed (metasched.core.deadlines, metasched.sim.sharing)."""

from __future__ import annotations

import pytest

from metasched.agents import make_scheduler
from metasched.core.actions import ActionSpec
from metasched.sim.sampling import IndependentAction, WorkloadInstance
from metasched.sim.simulator import Simulator


def _spec(true_s: float, timeout_s: float, start_by_s: float | None = None) -> ActionSpec:
    return ActionSpec(kind="cpu", name="run", true_s=true_s, est_s=true_s,
                      timeout_s=timeout_s, start_by_s=start_by_s)


def _run(make_workload, make_cluster, specs: list[ActionSpec], cores: int = 2):
    """Run ``specs`` (all arriving at 0) on one node of ``cores`` cores under fifo;
    (end time, ok, shared) per action, by submission order."""
    inst = WorkloadInstance(independent=[IndependentAction(0.0, "t", s) for s in specs])
    w = make_workload({"kind": "cpu", "duration_s": {"median": 1.0, "p90": 2.0},
                       "timeout_s": 60})
    sim = Simulator(w, make_cluster(nodes=1, cores=cores), seed=0, instance=inst,
                    check_invariants=True)
    ended = {}
    finish = sim.state.finish

    def record(a, ok, reason=""):
        ended[a.id] = (round(sim.state.t, 9), ok, a.shared)
        return finish(a, ok, reason)

    sim.state.finish = record
    result = sim.run(make_scheduler("fifo"))
    return [ended[i] for i in range(len(specs))], result, sim


def test_queued_action_shares_busy_cores_at_its_latest_start(make_workload, make_cluster):
    # Two 10 s actions take both cores; the third must start by t=1. From then on three
    # share two cores at 2/3 speed: the first two end at 1 + 9 / (2/3) = 14.5, the third
    # has 10 - 13.5 * 2/3 = 1 s left, alone at full speed: it ends at 15.5.
    ends, result, sim = _run(make_workload, make_cluster,
                             [_spec(10, 60), _spec(10, 60), _spec(10, 60, start_by_s=1.0)])
    assert ends == [(14.5, True, False), (14.5, True, False), (15.5, True, True)]
    assert sim.deadlines.fired == 1
    assert result.counters["completed"] == 3


def test_time_shared_action_ends_by_its_wall_clock_limit(make_workload, make_cluster):
    # The sharer would loop for 100 s; its 10 s limit is wall-clock: it ends failed at
    # 1 + 10 = 11 (before a caller who waits start_by + timeout), and the others, slowed
    # to 2/3 over [1, 11], end at 11 + (9 - 10 * 2/3) = 13.333...
    ends, result, _ = _run(make_workload, make_cluster,
                           [_spec(10, 60), _spec(10, 60), _spec(100, 10, start_by_s=1.0)])
    assert ends[2] == (11.0, False, True)
    assert ends[0] == ends[1] == (pytest.approx(13 + 1 / 3), True, False)
    assert result.counters["failed"] == 1


def test_hundred_loops_on_two_cores_all_answer_by_their_deadline(make_workload, make_cluster):
    # The 100-busy-loop burst: each loops forever under a 10 s limit, and its caller
    # waits limit + 20 s (start_by 20 s). Every one ends by a time limit, each before its
    # deadline of 30 s.
    specs = [_spec(1e6, 10, start_by_s=20.0) for _ in range(100)]
    ends, _, _ = _run(make_workload, make_cluster, specs)
    assert all(not ok for _, ok, _ in ends)
    assert max(t for t, _, _ in ends) <= 30.0
    # Two ran over [0, 10], two over [10, 20]; at 20 two more take the free cores and
    # the other 94 share them.
    assert sum(shared for _, _, shared in ends) == 94


def test_no_deadline_runs_as_before(make_workload, make_cluster):
    # Without start_by_s the third waits for a free core: ends 10, 10, 20.
    ends, _, sim = _run(make_workload, make_cluster, [_spec(10, 60)] * 3)
    assert ends == [(10.0, True, False), (10.0, True, False), (20.0, True, False)]
    assert sim.deadlines is None


def test_a_forked_simulator_moves_its_own_ends(make_workload, make_cluster):
    # The look-ahead forks a simulator by deepcopy: once time-sharing has begun, each
    # copy's moved ends go to its own heap, and both finish as one run would.
    import copy

    specs = [_spec(10, 60), _spec(10, 60), _spec(10, 60, start_by_s=1.0)]
    inst = WorkloadInstance(independent=[IndependentAction(0.0, "t", s) for s in specs])
    w = make_workload({"kind": "cpu", "duration_s": {"median": 1.0, "p90": 2.0},
                       "timeout_s": 60})
    sim = Simulator(w, make_cluster(nodes=1, cores=2), seed=0, instance=inst)
    sched = make_scheduler("fifo")
    sched.reset(sim.state, sim.scheduler_rng())
    assert sim.next_decision()
    for g in sched.decide(sim.state):  # the first two take both cores
        sim.apply(g)
    while not sim.sharing.nodes:  # events up to the third's latest start
        sim._process_instant()
        sim._serve_due()
    assert sim.state.t == 1.0
    fork = copy.deepcopy(sim)
    ends = []
    for s in (sim, fork):
        finished = {}
        finish = s.state.finish

        def record(a, ok, reason="", finished=finished, finish=finish, s=s):
            finished[a.id] = round(s.state.t, 9)
            return finish(a, ok, reason)

        s.state.finish = record
        s.run(make_scheduler("fifo"))
        ends.append(finished)
    assert ends == [{0: 14.5, 1: 14.5, 2: 15.5}] * 2
