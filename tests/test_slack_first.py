"""``slack_first``: the trajectories that would lengthen the step first, the rest in
``rate_greedy``'s order (:mod:`metasched.agents.slack_first`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from metasched.agents import BASELINES, ORACLES, PREDICTED, make_scheduler
from metasched.agents.slack_first import SlackFirstOracleScheduler, SlackFirstScheduler
from metasched.compose import profile
from metasched.core.actions import ActionSpec, Turn
from metasched.sim.sampling import TrajectorySpec, WorkloadInstance
from metasched.sim.simulator import Simulator


def _cpu(name: str, true_s: float) -> ActionSpec:
    return ActionSpec(kind="cpu", name=name, true_s=true_s, est_s=true_s, timeout_s=600.0)


LONG_STEP = [  # a long trajectory (5 s, 0.5 s of generation, 50 s) and two short ones
    TrajectorySpec("t", (Turn(0.0, _cpu("L1", 5.0)), Turn(0.5, _cpu("L2", 50.0))), None),
    TrajectorySpec("t", (Turn(0.0, _cpu("M", 3.0)),), None),
    TrajectorySpec("t", (Turn(0.0, _cpu("S", 1.0)),), None)]


def _starts(make_workload, make_cluster, scheduler, trajs=LONG_STEP) -> dict[str, float]:
    """Start time of each action of a hand-made step on one core (``LONG_STEP`` by
    default), every trajectory's first action submitted at 0."""
    w = make_workload({"kind": "cpu", "duration_s": {"median": 1.0, "p90": 2.0},
                       "timeout_s": 60})
    sim = Simulator(w, make_cluster(nodes=1, cores=1), seed=0,
                    instance=WorkloadInstance(steps=[trajs]), check_invariants=True)
    starts = {}
    start = sim.state.start

    def record(g):
        starts[g.action.spec.name] = round(sim.state.t, 9)
        return start(g)

    sim.state.start = record
    sim.run(scheduler)
    return starts


def test_critical_trajectory_first_the_rest_shortest_first(make_workload, make_cluster):
    # The step's horizon is 59 s (all the work on one core); the long trajectory's 55.5 s
    # is within 10% of it, the others are not. So: its first action, then the shortest
    # other (S) while its second action is generated, then its second action ahead of
    # M; critical_path puts M before S, rate_greedy the long trajectory last.
    sf = _starts(make_workload, make_cluster,
                 make_scheduler("slack_first_oracle", margin=0.1, refresh_s=0.01))
    assert sf == {"L1": 0.0, "S": 5.0, "L2": 6.0, "M": 56.0}
    cp = _starts(make_workload, make_cluster, make_scheduler("oracle"))
    assert cp == {"L1": 0.0, "M": 5.0, "L2": 8.0, "S": 58.0}
    rg = _starts(make_workload, make_cluster, make_scheduler("rate_greedy"))
    assert rg == {"S": 0.0, "M": 1.0, "L1": 4.0, "L2": 9.5}


@pytest.mark.parametrize(("rest", "expected"), [("action", {"A1": 0.0, "B": 2.0, "A2": 5.0}),
                                                ("trajectory", {"B": 0.0, "A1": 3.0, "A2": 5.5})])
def test_the_rest_by_action_or_by_trajectory(make_workload, make_cluster, rest, expected):
    # A: 2 s, 0.5 s of generation, 2 s (4.5 s of remaining work); B: 3 s. With margin 0
    # neither is critical (the horizon is their 7 s of work on one core): by action, A's
    # shorter first action goes first; by trajectory, B's smaller remaining work.
    trajs = [TrajectorySpec("t", (Turn(0.0, _cpu("A1", 2.0)), Turn(0.5, _cpu("A2", 2.0))), None),
             TrajectorySpec("t", (Turn(0.0, _cpu("B", 3.0)),), None)]
    s = make_scheduler("slack_first_oracle", margin=0.0, refresh_s=0.01, rest=rest)
    assert _starts(make_workload, make_cluster, s, trajs) == expected


class _News(SlackFirstOracleScheduler):
    """Remaining work that changes while the actions wait: at 0.5 s B's falls and C's
    rises (as siblings' news moves the predictor's readings)."""

    def _sync(self, state) -> None:
        self.now = state.t
        super()._sync(state)

    def remaining_s(self, a) -> float:
        if self.now < 0.5:
            return {"A": 30.0, "B": 20.0, "C": 10.0}[a.spec.name]
        return {"A": 30.0, "B": 1.0, "C": 20.0}[a.spec.name]


@pytest.mark.parametrize(("rekey", "expected"), [(False, {"A": 0.0, "B": 1.0, "C": 2.0}),
                                                 (True, {"A": 0.0, "C": 1.0, "B": 2.0})])
def test_rekey_reads_the_queued_actions_remaining_work_again(make_workload, make_cluster,
                                                             rekey, expected):
    # Three 1 s actions on one core, all critical (margin 1): A first (most remaining
    # work); then, the news in, C before B only where the queue reads it again.
    trajs = [TrajectorySpec("t", (Turn(0.0, _cpu(n, 1.0)),), None) for n in "ABC"]
    s = _News(margin=1.0, refresh_s=0.01, rekey=rekey)
    assert _starts(make_workload, make_cluster, s, trajs) == expected


@pytest.mark.parametrize(("name", "reference"), [("slack_first", "critical_path"),
                                                  ("slack_first_oracle", "oracle")])
@pytest.mark.parametrize("workload", ["retool_grouped", "swe_grouped"])
def test_margin_one_makes_every_trajectory_critical(name, reference, workload):
    """With ``margin=1`` every trajectory is critical: the run is its critical-path
    counterpart's, action for action."""
    w, c = profile(workload)
    w = dataclasses.replace(w, steps=2, trajectories_per_step=32)
    a = Simulator(w, c, 5).run(make_scheduler(name, margin=1.0))
    b = Simulator(w, c, 5).run(make_scheduler(reference))
    for col in ("submit", "start", "end", "ok"):
        assert np.array_equal(getattr(a, col), getattr(b, col)), col


def test_registered_where_it_belongs():
    assert "slack_first" in BASELINES
    assert "slack_first_oracle" in ORACLES and "slack_first_oracle" not in BASELINES
    assert "slack_first_predicted" in PREDICTED


@pytest.mark.parametrize(("kw", "match"), [({"margin": 1.5}, "margin"),
                                           ({"refresh_s": 0.0}, "refresh_s"),
                                           ({"quantile": "p99"}, "quantile"),
                                           ({"rest": "group"}, "rest")])
def test_bad_parameters_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        SlackFirstScheduler(**kw)
