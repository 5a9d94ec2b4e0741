"""The core's decision step and sandbox queue, as both clocks call them."""

from __future__ import annotations

import pytest

from metasched.core.actions import Action, ActionSpec, SandboxSpec, Trajectory
from metasched.core.decision import DecisionStep
from metasched.core.guard import WaitGuard
from metasched.core.sandbox_queue import SandboxQueue
from metasched.core.state import ClusterState


def _traj(i: int, mem_gb: float | None) -> Trajectory:
    return Trajectory(i, "t", 0, [], None if mem_gb is None else SandboxSpec(mem_gb, 0.0))


def test_sandbox_queue_places_in_order_the_first_blocking(make_cluster):
    state = ClusterState(make_cluster(nodes=1, cores=4, mem_gb=10.0), {})
    first = _traj(0, 6.0)
    assert state.open_trajectory(first)
    q = SandboxQueue(state)
    big, small = _traj(1, 6.0), _traj(2, 2.0)
    q.append(big)
    q.append(small)
    opened: list[int] = []
    q.open_waiting(lambda t: opened.append(t.id))
    assert opened == [] and list(q) == [big, small]  # the small one fits but waits
    state.close_trajectory(first)
    q.open_waiting(lambda t: opened.append(t.id))
    assert opened == [1, 2] and len(q) == 0


def test_sandbox_queue_gives_open_trajectories_their_sandbox(make_cluster):
    """The dispatcher's way: open trajectories get a sandbox; one closed meanwhile
    (no spec) leaves the queue."""
    state = ClusterState(make_cluster(nodes=1, cores=4, mem_gb=10.0), {})
    gone, waiting = _traj(0, None), _traj(1, None)
    for t in (gone, waiting):
        assert state.open_trajectory(t)
    q = SandboxQueue(state)
    q.append(gone)
    q.append(waiting)
    specs = {waiting.id: SandboxSpec(8.0, 0.0)}
    opened: list[int] = []
    q.open_waiting(opened.append, lambda t: specs.get(t.id))
    assert opened == [waiting] and waiting.sandbox == specs[1] and not q


@pytest.mark.parametrize("max_wait_s, asked", [(None, True), (1.0, False)])
def test_decision_step_starts_the_guards_grants_before_asking(make_cluster, max_wait_s,
                                                              asked):
    state = ClusterState(make_cluster(nodes=1, cores=1), {})
    state.submit(Action(0, ActionSpec("cpu", "x", 5.0, 5.0, 60.0), "t", None, 0, 0.0))
    state.advance(2.0)
    started = []

    def start(g):
        started.append(g.action.id)
        state.start(g)

    step = DecisionStep(state, WaitGuard(max_wait_s), start)
    assert step.ready() is asked  # overdue: the guard starts it; nothing left to ask
    assert started == ([] if asked else [0])


def test_decision_step_serves_an_idle_cluster_after_a_wait(make_cluster):
    state = ClusterState(make_cluster(nodes=1, cores=2), {})
    for i in range(3):
        state.submit(Action(i, ActionSpec("cpu", "x", 5.0, 5.0, 60.0), "t", None, 0, 0.0))
    step = DecisionStep(state, WaitGuard(None), lambda g: state.start(g))
    assert step.ready()  # the scheduler would be asked; say it waited
    assert step.serve_idle()  # nothing ran: what fits starts (two of three)
    assert state.n_running == 2 and not step.serve_idle()  # no longer idle
