"""ClusterState: grant legality, start/finish, trajectory holds and the accounting of
busy and held-but-idle resource-seconds."""

from __future__ import annotations

import itertools
import re

import pytest

from metasched.core.actions import (
    AHEAD,
    DONE,
    FAILED,
    PENDING,
    RUNNING,
    Action,
    ActionSpec,
    Grant,
    Trajectory,
)
from metasched.core.metrics import CPU_BUSY, CPU_HELD, GPU_BUSY, GPU_HELD
from metasched.core.pools import ServiceSpec
from metasched.core.state import ClusterState, InvalidGrant

SERVICES = {"rm": ServiceSpec(mem_gb=30, restore_s=4.0, max_batch=3, batch_marginal=0.1),
            "judge": ServiceSpec(mem_gb=60, restore_s=9.0, max_batch=4)}
_ids = itertools.count()


def cpu_spec(true_s=1.0, cores=(1, 1), p=0.0, timeout_s=100.0):
    return ActionSpec("cpu", "x", true_s, true_s, timeout_s, cores[0], cores[1], p)


def gpu_spec(service="rm", true_s=0.5):
    return ActionSpec("gpu", "score", true_s, true_s, 100.0, service=service)


def api_spec(tokens=0, endpoint="e"):
    return ActionSpec("api", "call", 1.0, 1.0, 100.0, endpoint=endpoint, tokens=tokens)


def submit(state, spec, task="t", traj=None):
    a = Action(next(_ids), spec, task, traj, 0, state.t)
    state.submit(a)
    return a


def make_traj(state):
    traj = Trajectory(next(_ids), "t", 0, [], None)
    assert state.open_trajectory(traj)
    return traj


@pytest.fixture
def state(make_cluster):
    """One node of 8 cores, one 80 GB GPU; endpoint e: 60 rpm (1/s, bucket 1),
    600 tpm (10 tokens/s, bucket 10), two calls at once; endpoint tok: requests aplenty,
    600 tpm."""
    cluster = make_cluster(nodes=1, cores=8, endpoints={
        "e": {"rpm": 60, "tpm": 600, "max_concurrency": 2, "window_s": 1.0},
        "tok": {"rpm": 6000, "tpm": 600, "max_concurrency": 10, "window_s": 1.0}})
    return ClusterState(cluster, SERVICES, timeline_dt=4.0)


# ------------------------------------------------------------------ legality


def test_legal_grants_check_none(state):
    assert state.check(Grant(submit(state, cpu_spec(cores=(1, 8))), cores=8, node=0)) is None
    assert state.check(Grant(submit(state, gpu_spec()), device=0)) is None
    assert state.check(Grant(submit(state, api_spec(tokens=10)))) is None


def test_too_many_cores(state):
    other = submit(state, cpu_spec(cores=(3, 3)))
    state.start(Grant(other, cores=3, node=0))
    a = submit(state, cpu_spec(cores=(1, 8)))
    why = state.check(Grant(a, cores=6, node=0))
    assert why is not None and "6 cores" in why and "5 available" in why
    with pytest.raises(InvalidGrant, match="5 available"):
        state.start(Grant(a, cores=6, node=0))
    assert a.status == PENDING and state.cpu.free == [5]  # nothing allocated
    assert state.check(Grant(a, cores=5, node=0)) is None


@pytest.mark.parametrize("cores, needle", [(0, "outside [1, 4]"), (5, "outside [1, 4]")])
def test_cores_outside_action_range(state, cores, needle):
    a = submit(state, cpu_spec(cores=(1, 4)))
    assert needle in state.check(Grant(a, cores=cores, node=0))


def test_missing_node_and_hold_without_trajectory(state):
    a = submit(state, cpu_spec())
    assert "node -1 does not exist" in state.check(Grant(a, cores=1))
    assert "node 1 does not exist" in state.check(Grant(a, cores=1, node=1))
    assert "hold needs a trajectory" in state.check(Grant(a, cores=1, node=0, hold=2))


def test_action_not_pending(state):
    a = submit(state, cpu_spec())
    state.start(Grant(a, cores=1, node=0))
    assert f"action {a.id} is not pending" in state.check(Grant(a, cores=1, node=0))
    foreign = Action(next(_ids), cpu_spec(), "t", None, 0, 0.0)  # never submitted
    assert "is not pending" in state.check(Grant(foreign, cores=1, node=0))


def test_busy_device(state):
    state.start(Grant(submit(state, gpu_spec()), device=0))
    why = state.check(Grant(submit(state, gpu_spec()), device=0))
    assert why == "device 0 is busy"
    assert "device 1 does not exist" in state.check(Grant(submit(state, gpu_spec()), device=1))


def test_batch_above_max_batch(state):
    a, b, c, d = (submit(state, gpu_spec()) for _ in range(4))
    assert state.check(Grant(a, device=0, batch=(b, c))) is None  # 3 = max_batch
    why = state.check(Grant(a, device=0, batch=(b, c, d)))
    assert "batch of 4 exceeds max_batch 3" in why


def test_wrong_service_batch_member(state):
    a = submit(state, gpu_spec("rm"))
    other = submit(state, gpu_spec("judge"))
    why = state.check(Grant(a, device=0, batch=(other,)))
    assert why == f"batch member {other.id} is not a pending request to rm"
    # A request that already started is not a legal batch member either.
    b, c = submit(state, gpu_spec("rm")), submit(state, gpu_spec("rm"))
    state.start(Grant(b, device=0))
    state.release_device(0)
    assert f"batch member {b.id}" in state.check(Grant(c, device=0, batch=(b,)))
    assert "repeated" in state.check(Grant(a, device=0, batch=(a,)))


def test_api_without_tokens(state):
    a = submit(state, api_spec(tokens=11))  # more than the 10 tokens a window admits
    assert state.check(Grant(a)) == "endpoint e has no free slot or tokens"
    b = submit(state, api_spec(tokens=4))
    state.start(Grant(b))  # spends the only request of the RPM bucket
    c = submit(state, api_spec(tokens=0))
    assert state.check(Grant(c)) == "endpoint e has no free slot or tokens"
    state.advance(1.0)  # one request refilled
    assert state.check(Grant(c)) is None


def test_api_without_tpm_tokens(state):
    a = submit(state, api_spec(tokens=8, endpoint="tok"))
    state.start(Grant(a))  # 2 of 10 tokens left; requests are plentiful
    b = submit(state, api_spec(tokens=5, endpoint="tok"))
    assert state.check(Grant(b)) == "endpoint tok has no free slot or tokens"
    assert state.check(Grant(submit(state, api_spec(tokens=2, endpoint="tok")))) is None
    state.advance(0.999)  # still in the 1 s window: no partial refill, as a bucket has
    assert state.check(Grant(b)) is not None
    state.advance(1.0)  # the 8 tokens charged at 0 leave the window
    assert state.check(Grant(b)) is None


def test_api_without_concurrency_slot(state):
    calls = [submit(state, api_spec()) for _ in range(3)]
    state.start(Grant(calls[0]))
    state.advance(1.0)
    state.start(Grant(calls[1]))
    state.advance(5.0)  # the window has room, but both slots are taken
    assert state.check(Grant(calls[2])) is not None
    state.finish(calls[0], ok=True)
    assert state.check(Grant(calls[2])) is None


# ------------------------------------------------------------------ start / finish


def test_start_and_finish_return_cores(state):
    a = submit(state, cpu_spec(cores=(2, 6)))
    b = submit(state, cpu_spec())
    started, delay = state.start(Grant(a, cores=5, node=0))
    assert started == (a,) and delay == 0.0
    assert a.status == RUNNING and a.cores == 5 and a.node == 0 and a.start_t == 0.0
    assert state.cpu.free == [3] and state.cpu.busy == 5
    assert state.n_running == 1 and state.n_pending == 1
    state.start(Grant(b, cores=1, node=0))
    assert state.cpu.free == [2] and state.cpu.busy == 6
    state.advance(2.5)
    state.finish(a, ok=True)
    assert a.status == DONE and a.end_t == 2.5
    assert state.cpu.free == [7] and state.cpu.busy == 1
    state.finish(b, ok=False, reason="timeout")
    assert b.status == FAILED and b.reason == "timeout"
    assert state.cpu.free == [8] and state.cpu.busy == 0
    assert (state.n_done, state.n_failed, state.n_running) == (1, 1, 0)
    assert state.busy_by_task[("cpu", "t")] == 0
    assert state.metrics.reasons == {"timeout": 1}
    state.check_invariant()


def test_gpu_start_batch_restore_and_release(state):
    a, b, c = (submit(state, gpu_spec()) for _ in range(3))
    started, delay = state.start(Grant(a, device=0, batch=(b, c)))
    assert started == (a, b, c)
    assert delay == 4.0  # first use: the service is restored
    assert all(x.status == RUNNING and x.device == 0 for x in started)
    assert state.n_pending == 0 and state.n_running == 3 and state.gpu.busy == 1
    for x in started:
        state.finish(x, ok=True)
    assert state.gpu.devices[0].busy  # the device is freed by release_device only
    state.release_device(0)
    assert not state.gpu.devices[0].busy and state.gpu.busy == 0
    _, delay = state.start(Grant(submit(state, gpu_spec()), device=0))
    assert delay == 0.0  # resident now
    assert state.gpu.restores == 1


def test_submit_sets_lower_bound(state):
    # Best case: max cores the node allows (8 of 16), capped by the timeout.
    a = submit(state, cpu_spec(true_s=10.0, cores=(1, 16), p=0.5))
    assert a.lower_bound_s == pytest.approx(10.0 * (0.5 + 0.5 / 8))
    b = submit(state, cpu_spec(true_s=10.0, timeout_s=3.0))
    assert b.lower_bound_s == 3.0
    assert submit(state, gpu_spec(true_s=0.7)).lower_bound_s == 0.7
    assert state.n_submitted == 3


def test_check_invariant_detects_broken_accounting(state):
    submit(state, cpu_spec())
    state.check_invariant()
    state.n_done += 1
    with pytest.raises(AssertionError, match="accounting broken"):
        state.check_invariant()


# ------------------------------------------------------------------ trajectory holds


def test_hold_keeps_cores_reserved_until_trajectory_closes(state):
    traj = make_traj(state)
    a = submit(state, cpu_spec(), traj=traj)
    state.start(Grant(a, cores=1, node=0, hold=4))
    assert traj.held_cores == 4 and traj.node == 0
    assert state.cpu.free == [4] and state.cpu.held == 4
    assert state.cpu.busy == 1 and state.cpu.held_busy == 1
    state.finish(a, ok=True)
    # The action ended, the reservation did not.
    assert state.cpu.free == [4] and state.cpu.held == 4
    assert state.cpu.busy == 0 and state.cpu.held_busy == 0
    # The trajectory's next action runs on its held cores even when the pool is empty.
    hog = submit(state, cpu_spec(cores=(4, 4)))
    state.start(Grant(hog, cores=4, node=0))
    assert state.cpu.free == [0]
    b = submit(state, cpu_spec(cores=(1, 4)), traj=traj)
    assert b.node == 0  # bound to the trajectory's node
    assert state.cpu_feasible(b)
    assert state.check(Grant(b, cores=4)) is None
    assert state.check(Grant(b, cores=4, hold=5)) is not None  # would need a free core
    state.start(Grant(b, cores=4))
    assert state.cpu.free == [0] and state.cpu.held_busy == 4 and state.cpu.busy == 8
    state.finish(b, ok=True)
    assert state.cpu.free == [0] and state.cpu.held == 4
    state.close_trajectory(traj)
    assert state.cpu.free == [4] and state.cpu.held == 0 and traj.held_cores == 0
    assert traj.id not in state.trajectories
    state.finish(hog, ok=True)
    assert state.cpu.free == [8]


def test_hold_grows_but_never_shrinks(state):
    traj = make_traj(state)
    a = submit(state, cpu_spec(cores=(1, 8)), traj=traj)
    state.start(Grant(a, cores=2, node=0, hold=2))
    state.finish(a, ok=True)
    b = submit(state, cpu_spec(cores=(1, 8)), traj=traj)
    state.start(Grant(b, cores=3, hold=5))  # grows the reservation to 5
    assert traj.held_cores == 5 and state.cpu.free == [3] and state.cpu.held_busy == 3
    state.finish(b, ok=True)
    c = submit(state, cpu_spec(cores=(1, 8)), traj=traj)
    state.start(Grant(c, cores=1, hold=1))  # a smaller hold keeps the 5
    assert traj.held_cores == 5 and state.cpu.free == [3]
    state.finish(c, ok=True)
    state.close_trajectory(traj)
    assert state.cpu.free == [8] and state.cpu.held == 0


def test_sandbox_memory_held_for_trajectory_life(make_cluster):
    from metasched.core.actions import SandboxSpec

    state = ClusterState(make_cluster(nodes=2, cores=4, mem_gb=10.0), {})
    trajs = [Trajectory(i, "t", 0, [], SandboxSpec(mem_gb=6.0, startup_s=0.0))
             for i in range(3)]
    assert state.open_trajectory(trajs[0]) and state.open_trajectory(trajs[1])
    assert {trajs[0].node, trajs[1].node} == {0, 1}
    assert not state.open_trajectory(trajs[2])  # 4 GB left per node
    state.close_trajectory(trajs[0])
    assert state.open_trajectory(trajs[2]) and trajs[2].node == trajs[0].node


# ------------------------------------------------------------------ accounting


def test_advance_integrates_busy_and_held_idle_core_seconds(state):
    """A hand-computed scenario on one 8-core node (timeline buckets of 4 s):

    - a0, no trajectory, 3 cores over [0, 10): busy 30.
    - a1 of trajectory T, 1 core holding 4, over [0, 2): busy 2, held-idle 3 x 2 = 6.
    - T holds its 4 cores idle over [2, 5): held-idle 12.
    - a2 of T on 2 of its held cores over [5, 6): busy 2, held-idle 2 x 1 = 2.
    - T closes at 6: nothing held after.
    Totals: busy 34, held-idle 20.
    """
    traj = make_traj(state)
    a0 = submit(state, cpu_spec(cores=(3, 3)))
    state.start(Grant(a0, cores=3, node=0))
    a1 = submit(state, cpu_spec(), traj=traj)
    state.start(Grant(a1, cores=1, node=0, hold=4))
    state.advance(2.0)
    state.finish(a1, ok=True)
    state.advance(5.0)
    a2 = submit(state, cpu_spec(cores=(1, 4)), traj=traj)
    state.start(Grant(a2, cores=2))
    state.advance(6.0)
    state.finish(a2, ok=True)
    state.close_trajectory(traj)
    state.advance(10.0)
    state.finish(a0, ok=True)
    tot = state.metrics.totals
    assert tot[CPU_BUSY] == pytest.approx(34.0)
    assert tot[CPU_HELD] == pytest.approx(20.0)
    tl = state.metrics.timeline
    assert len(tl) == 3
    # [0, 4): busy 12 + 2, held 6 + 8;  [4, 8): busy 12 + 2, held 4 + 2;  [8, 10): busy 6.
    assert [row[CPU_BUSY] for row in tl] == pytest.approx([14.0, 14.0, 6.0])
    assert [row[CPU_HELD] for row in tl] == pytest.approx([14.0, 6.0, 0.0])
    state.advance(10.0)  # a clock that does not move adds nothing
    state.advance(9.0)
    assert tot[CPU_BUSY] == pytest.approx(34.0)


def test_advance_counts_reserved_but_unused_partition(state):
    """A task partition of 4 cores: idle units are those its task does not use."""
    state.reserve("cpu", "p", 4)
    a = submit(state, cpu_spec(), task="p")
    state.start(Grant(a, cores=1, node=0))
    b = submit(state, cpu_spec(cores=(2, 2)), task="other")  # other tasks do not count
    state.start(Grant(b, cores=2, node=0))
    state.advance(2.0)  # p uses 1 of 4: 3 idle x 2 s
    state.finish(a, ok=True)
    state.advance(3.0)  # p uses 0 of 4: 4 idle x 1 s
    assert state.metrics.totals[CPU_HELD] == pytest.approx(10.0)
    assert state.metrics.totals[CPU_BUSY] == pytest.approx(3.0 * 2 + 2.0 * 1)


def test_reserved_device_busy_with_other_task_is_not_idle(state):
    state.reserve_device(0, "owner")  # the only device belongs to task "owner" ...
    g = submit(state, gpu_spec(), task="guest")
    state.start(Grant(g, device=0))  # ... but a "guest" batch runs on it
    state.advance(1.0)
    tot = state.metrics.totals
    assert tot[GPU_BUSY] == pytest.approx(1.0)
    # One device for one second: busy and held-but-idle together cannot exceed 1.
    assert tot[GPU_BUSY] + tot[GPU_HELD] <= 1.0 + 1e-9


# ---------------------------------------------------------------------- handing ahead


@pytest.fixture
def piped(make_cluster):
    """Two nodes of 2 cores; each may hold 2 actions ahead of its free cores."""
    s = ClusterState(make_cluster(nodes=2, cores=2), {})
    s.ahead_per_node = 2
    return s


def fill(state, n):
    """Submit ``n`` one-core cpu actions."""
    return [submit(state, cpu_spec()) for _ in range(n)]


def test_handed_ahead_is_neither_queued_nor_running_and_takes_no_free_core(piped):
    a, b, c = fill(piped, 3)
    piped.start(Grant(a, cores=1, node=0))
    assert piped.check_ahead(b, 0, 1) == "node 0 can start it now (a grant, not a hand-off)"
    piped.start(Grant(b, cores=1, node=0))
    piped.hand_ahead(c, 0, 1)
    assert c.status == AHEAD and c.id not in piped.pending["cpu"]
    assert (piped.n_pending, piped.n_ahead, piped.n_running) == (0, 1, 2)
    assert list(piped.ahead[0]) == [c] and piped.cpu.free == [0, 2] and piped.cpu.busy == 2
    piped.check_invariant()


def test_a_finish_starts_the_nodes_queue_in_order_on_the_cores_it_leaves(piped):
    a, b, c, d, e = fill(piped, 5)
    for x in (a, b):
        piped.start(Grant(x, cores=1, node=0))
    piped.hand_ahead(c, 0, 1)
    piped.hand_ahead(d, 0, 1)
    assert piped.check_ahead(e, 0, 1) == "node 0 holds 2 actions ahead, its most"
    piped.advance(1.0)
    assert piped.finish(a, True) == [c]
    assert c.status == RUNNING and c.start_t == 1.0 and piped.cpu.free[0] == 0
    assert piped.finish(b, True) == [d]
    assert piped.finish(c, True) == [] and piped.cpu.free[0] == 1  # queue empty: free again
    assert piped.cpu.busy == 1 and (piped.n_ahead, piped.n_running) == (0, 1)
    piped.check_invariant()


def test_a_wide_action_ahead_keeps_the_freed_cores_for_itself(piped):
    """Strictly in order, as the node runs its queue: a 2-core action waits for both
    cores, and the one freed first is not granted to anything else meanwhile."""
    a, b = fill(piped, 2)
    wide = submit(piped, cpu_spec(cores=(2, 2)))
    small = submit(piped, cpu_spec())
    piped.start(Grant(a, cores=1, node=0))
    piped.hand_ahead(wide, 0, 2)  # one core free, fewer than it needs: kept for it
    assert piped.cpu.free[0] == 0 and piped.ahead_claim[0] == 1
    piped.hand_ahead(small, 0, 1)
    assert piped.check(Grant(b, cores=1, node=0)) is not None  # no core of node 0 is free
    assert piped.check(Grant(b, cores=1, node=1)) is None  # node 1's are
    assert piped.finish(a, True) == [wide]
    assert piped.cpu.busy == 2 and piped.ahead_claim[0] == 0
    assert piped.finish(wide, True) == [small] and piped.cpu.free[0] == 1
    piped.check_invariant()


def test_a_result_before_its_predecessors_leaves_the_queue_without_cores(piped):
    """The node started it on cores the state still counts as its predecessor's; its
    result arrived first (or it never ran): no core is freed twice."""
    a, b, c = fill(piped, 3)
    piped.start(Grant(a, cores=1, node=0))
    piped.start(Grant(b, cores=1, node=0))
    piped.hand_ahead(c, 0, 1)
    piped.advance(2.0)
    assert piped.finish(c, False, "cancelled") == []
    assert c.status == FAILED and c.start_t == 2.0 and not piped.ahead[0]
    assert piped.cpu.free[0] == 0 and piped.cpu.busy == 2
    piped.finish(a, True)
    piped.finish(b, True)
    assert piped.cpu.free[0] == 2 and piped.cpu.busy == 0
    piped.check_invariant()


@pytest.mark.parametrize("case, needle", [
    ("off", "holds 0 actions ahead"),
    ("node", "node 5 does not exist"),
    ("cores", "cores 3 outside"),
    ("pinned", "runs on node 0 (its sandbox's)"),
    ("held", "trajectories hold cores"),
])
def test_hand_ahead_refuses_what_the_node_could_not_hold(piped, case, needle):
    a, b = fill(piped, 2)
    piped.start(Grant(a, cores=1, node=0))
    piped.start(Grant(submit(piped, cpu_spec()), cores=1, node=0))
    node, cores = 0, 1
    if case == "off":
        piped.ahead_per_node = 0
    elif case == "node":
        node = 5
    elif case == "cores":
        cores = 3
    elif case == "pinned":
        b.node, node = 0, 1
    elif case == "held":
        traj = make_traj(piped)
        piped.start(Grant(submit(piped, cpu_spec(), traj=traj), cores=1, node=1, hold=1))
    with pytest.raises(InvalidGrant, match=re.escape(needle)):
        piped.hand_ahead(b, node, cores)
    assert b.status == PENDING and piped.n_ahead == 0


def test_fill_ahead_hands_in_submission_order_up_to_each_nodes_limit(piped):
    acts = fill(piped, 10)
    for i, a in enumerate(acts[:4]):
        piped.start(Grant(a, cores=1, node=i // 2))
    handed = piped.fill_ahead()
    assert handed == acts[4:8]  # 2 per node, the oldest first
    assert [len(q) for q in piped.ahead] == [2, 2] and piped.n_pending == 2
    assert not piped.decision_possible()
    piped.check_invariant()


def test_fill_ahead_leaves_actions_a_free_core_can_take(piped):
    """The scheduler decides over free cores: only what cannot start now is handed."""
    acts = fill(piped, 3)
    assert piped.fill_ahead() == []
    piped.start(Grant(acts[0], cores=1, node=0))
    assert piped.fill_ahead() == [] and piped.n_pending == 2
