"""``rate_greedy``'s rules on hand-built states: GPU service and batch by requests served
per device-second, evictions of services in demand, deferred evicting restores; API
order by quota, then trajectory progress; and the CPU order, from estimates alone."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

from metasched.agents import make_scheduler
from metasched.agents.rate_greedy import RateGreedyScheduler, best_prefix
from metasched.core.actions import Action, ActionSpec, Grant, Trajectory
from metasched.core.pools import ServiceSpec
from metasched.core.state import ClusterState

_ids = itertools.count()
# Two services that do not fit one 80 GB device together.
SERVICES = {"small": ServiceSpec(mem_gb=30, restore_s=4.0, max_batch=8, batch_marginal=0.1),
            "big": ServiceSpec(mem_gb=60, restore_s=10.0, max_batch=8, batch_marginal=0.1)}


def gpu(service: str, est: float, true: float | None = None) -> ActionSpec:
    return ActionSpec("gpu", "score", est if true is None else true, est, 300.0,
                      service=service)


def submit(state: ClusterState, spec: ActionSpec, traj: Trajectory | None = None) -> Action:
    a = Action(next(_ids), spec, "t", traj, traj.turn if traj else 0, state.t)
    state.submit(a)
    return a


@pytest.fixture
def state(make_cluster):
    cluster = make_cluster(nodes=1, cores=4, gpus=1, gpu_mem_gb=80.0, endpoints={
        "e": {"rpm": 60, "max_concurrency": 1, "window_s": 1.0}})
    return ClusterState(cluster, SERVICES)


def decide(state: ClusterState, **params) -> list[Grant]:
    s = make_scheduler("rate_greedy", **params)
    s.reset(state, np.random.default_rng(0))
    return s.decide(state)


def make_resident(state: ClusterState, service: str, t: float = 0.0) -> None:
    state.gpu.make_resident(service, 0, t)


def test_best_prefix_maximises_requests_per_second():
    svc = ServiceSpec(mem_gb=1, restore_s=0, max_batch=8, batch_marginal=0.1)
    q = [Action(i, gpu("small", e), "t", None, 0, 0.0) for i, e in enumerate([1, 1, 1, 10])]
    # Three 1 s requests: 3 / 1.2 s; adding the 10 s one: 4 / 13 s.
    assert best_prefix(q, svc, 0.0) == (3, pytest.approx(1.2))
    # Behind a long setup the long request is worth taking along.
    assert best_prefix(q, svc, 100.0)[0] == 4


def test_batch_is_the_shortest_queued_requests(state):
    make_resident(state, "small")
    long = submit(state, gpu("small", 9.0))
    short = [submit(state, gpu("small", 0.2)) for _ in range(3)]
    (g,) = decide(state)
    assert {g.action.id, *(b.id for b in g.batch)} == {a.id for a in short}
    assert long.id not in {b.id for b in g.batch}


def test_service_by_rate_not_by_age(state):
    make_resident(state, "small")
    submit(state, gpu("big", 1.0))  # oldest; its restore evicts "small", not in demand
    state.advance(100.0)  # ("small" was last used long ago)
    small = [submit(state, gpu("small", 0.5)) for _ in range(2)]
    (g,) = decide(state)
    assert g.action.id in {a.id for a in small}  # 2 / 0.55 s beats 1 / 11 s


def test_restore_that_evicts_a_service_in_demand_is_charged_and_deferred(state):
    make_resident(state, "small")
    state.advance(1.0)
    big = [submit(state, gpu("big", 1.0)) for _ in range(3)]
    queued_small = submit(state, gpu("small", 50.0))
    run = submit(state, ActionSpec("cpu", "x", 100.0, 100.0, 200.0))
    state.start(Grant(run, cores=1, node=0))  # something runs: a wait idles nothing
    state.advance(2.0)
    # "big" must evict "small", which has a queued request: its setup is 10 + 4 s, and
    # its 3 requests (3 / 15.2 s) beat the resident one's 1 / 50 s ...
    (g,) = decide(state, defer=0.0)
    assert g.action in big
    # ... but they have waited 3 request-seconds, well short of 8 x 14 s: the restore
    # waits and the resident service is served meanwhile.
    (g,) = decide(state)
    assert g.action is queued_small


def test_evicting_restore_is_not_deferred_when_the_cluster_is_idle(state):
    make_resident(state, "small")
    state.advance(1.0)
    big = [submit(state, gpu("big", 1.0)) for _ in range(3)]
    submit(state, gpu("small", 50.0))
    (g,) = decide(state)
    assert g.action in big  # nothing runs: a wait would only delay everything


def test_api_order_quota_then_progress_then_shortest(state):
    short_far = Trajectory(next(_ids), "t", 0, [], None)
    short_far.turn = 3
    near = Trajectory(next(_ids), "t", 0, [], None)
    near.turn = 1
    api = ActionSpec("api", "call", 1.0, 1.0, 30.0, endpoint="e")
    first = submit(state, replace(api, est_s=0.5), near)
    far_long = submit(state, replace(api, est_s=5.0), short_far)
    far_short = submit(state, replace(api, est_s=2.0), short_far)
    s = RateGreedyScheduler()
    s.reset(state, np.random.default_rng(0))
    keys = {a.id: s._api_key(state.api.endpoints["e"].spec, a)
            for a in (first, far_long, far_short)}
    assert sorted(keys, key=keys.get) == [far_short.id, far_long.id, first.id]
    (g,) = s.decide(state)  # one slot: the furthest trajectory's shorter call
    assert g.action is far_short


def test_cpu_order_credits_progress_and_endgame_serves_the_furthest_behind(state):
    behind = Trajectory(next(_ids), "t", 0, [], None)
    ahead = Trajectory(next(_ids), "t", 0, [], None)
    behind.turn, ahead.turn = 1, 5
    cpu = ActionSpec("cpu", "x", 1.0, 1.0, 30.0)
    a_behind = submit(state, replace(cpu, est_s=1.0), behind)
    a_ahead = submit(state, replace(cpu, est_s=2.5), ahead)
    s = RateGreedyScheduler(progress_s=0.5)
    assert s._cpu_key(a_ahead) < s._cpu_key(a_behind)  # 2.5 - 2.5 < 1.0 - 0.5
    plain = RateGreedyScheduler(progress_s=0.0)
    assert plain._cpu_key(a_behind) < plain._cpu_key(a_ahead)
    s._late = True  # the step's last trajectories: fewest turns first
    assert s._cpu_key(a_behind) < s._cpu_key(a_ahead)


@pytest.mark.parametrize("params, field", [({"defer": -1}, "defer"),
                                           ({"endgame": 2.0}, "endgame"),
                                           ({"recent_s": -5}, "recent_s")])
def test_bad_parameters_are_one_line_errors(params, field):
    from metasched.errors import ConfigError

    with pytest.raises(ConfigError, match=field):
        make_scheduler("rate_greedy", **params)


@pytest.mark.parametrize("seed", range(5))
def test_reads_estimates_only(make_cluster, seed):
    """The same queues with the true durations shuffled get the same decisions."""
    rng = np.random.default_rng(seed)
    cluster = make_cluster(nodes=2, cores=4, gpus=2, gpu_mem_gb=80.0, endpoints={
        "e": {"rpm": 120, "max_concurrency": 3, "window_s": 1.0}})
    cpu = [ActionSpec("cpu", "x", 1.0, float(e), 60.0, 1, int(k), 0.8)
           for e, k in zip(rng.lognormal(0, 1, 12), rng.integers(1, 5, 12), strict=True)]
    gpus = [gpu(str(rng.choice(["small", "big"])), float(e)) for e in rng.lognormal(0, 1, 12)]
    api = [ActionSpec("api", "call", 1.0, float(e), 30.0, endpoint="e")
           for e in rng.lognormal(0, 1, 6)]
    specs = cpu + gpus + api
    turns = rng.integers(0, 6, len(specs))

    def grants(true_s):
        st = ClusterState(cluster, SERVICES)
        st.gpu.make_resident("small", 0, 0.0)
        for i, (spec, n) in enumerate(zip(specs, turns, strict=True)):
            traj = Trajectory(1000 + i, "t", 0, [], None)
            traj.turn = int(n)
            st.submit(Action(i, replace(spec, true_s=float(true_s[i])), "t", traj, 0, 0.0))
        st.advance(5.0)
        return [(g.action.id, g.cores, g.node, g.device, tuple(b.id for b in g.batch))
                for g in decide(st)]

    true_a = rng.lognormal(0, 2, len(specs))
    first = grants(true_a)
    assert first == grants(rng.permutation(true_a)) and len(first) >= 5
