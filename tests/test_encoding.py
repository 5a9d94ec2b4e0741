"""The observation encoder: layout, slot order, backlog, allocation levels, grants, caps,
and one encoding for simulated and hand-driven (live) states."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import numpy as np
import pytest
from helpers import shrunk

import metasched.sim.simulator as simulator_module
from metasched.agents import make_advisor, make_scheduler
from metasched.compose import PROFILES
from metasched.core.actions import Action, ActionSpec, Grant, Trajectory
from metasched.core.observation import (
    KIND_NAMES,
    SLOT_FEATURES,
    F,
    ObsConfig,
    ObservationEncoder,
    batch_levels,
    cpu_levels,
    pool_features,
)
from metasched.core.pools import ServiceSpec
from metasched.core.scheduler import Scheduler
from metasched.core.state import ClusterState
from metasched.envs.scheduling import ActionSchedulingEnv
from metasched.sim.simulator import Simulator

SMALL = ObsConfig(k_slots=4, levels=4, max_nodes=2, max_devices=2, max_services=2,
                  max_endpoints=2)
SERVICES = {"rm": ServiceSpec(mem_gb=30, restore_s=4.0, max_batch=8, batch_marginal=0.05)}
_ids = itertools.count()


def col(name: str) -> int:
    return SLOT_FEATURES.index(name)


def cpu_spec(est=1.0, cores=(1, 1), p=0.0):
    return ActionSpec("cpu", "x", est, est, 100.0, cores[0], cores[1], p)


def gpu_spec(est=0.5):
    return ActionSpec("gpu", "score", est, est, 100.0, service="rm")


def api_spec(est=1.0, tokens=0):
    return ActionSpec("api", "call", est, est, 100.0, endpoint="e", tokens=tokens)


def submit_at(state: ClusterState, t: float, spec: ActionSpec, traj=None) -> Action:
    state.advance(t)
    a = Action(next(_ids), spec, "t", traj, 0, state.t)
    state.submit(a)
    return a


@pytest.fixture
def state(make_cluster):
    """One 8-core node, one 80 GB GPU (service ``rm``), endpoint ``e``."""
    return ClusterState(make_cluster(nodes=1, cores=8), SERVICES)


def decision_states(name: str, n: int, seed: int = 0, wait_prob: float = 0.6,
                    load: float = 0.1, cfg: ObsConfig | None = None):
    """Yields (sim, encoder) at up to ``n`` decision points of a run that waits with
    probability ``wait_prob`` (so queues build up) and otherwise applies
    ``elastic_greedy``'s first grant (the guard serves actions past 120 s)."""
    w, c = shrunk(name, load)
    sim = Simulator(w, c, seed, max_wait_s=120.0)
    cfg = cfg or ObsConfig()
    enc = ObservationEncoder(sim.state, cfg, make_advisor(cfg))
    sched = make_scheduler("elastic_greedy")
    sched.reset(sim.state, sim.scheduler_rng())
    rng = np.random.default_rng(seed)
    for _ in range(n):
        if not sim.next_decision():
            return
        yield sim, enc
        grants = [] if rng.random() < wait_prob else sched.decide(sim.state)
        if grants:
            sim.apply(grants[0])
        else:
            sim.wait()


# ------------------------------------------------------------------ layout


@pytest.mark.parametrize("cfg", [ObsConfig(), SMALL, ObsConfig(k_slots=3, levels=2)],
                         ids=["default", "small", "k3l2"])
def test_layout_sizes(make_cluster, cfg):
    st = ClusterState(make_cluster(nodes=2, cores=8, gpus=2), SERVICES)
    obs = ObservationEncoder(st, cfg, make_advisor(cfg)).observe(st)
    assert F == len(SLOT_FEATURES) and SLOT_FEATURES[-1] == "present"
    assert obs["slots"].shape == (cfg.k_slots * F,) and obs["slots"].dtype == np.float32
    assert obs["backlog"].shape == (9,) and obs["backlog"].dtype == np.float32
    assert obs["pools"].shape == (cfg.pool_size(),) and obs["pools"].dtype == np.float32
    assert len(pool_features(cfg)) == cfg.pool_size()
    assert len(set(pool_features(cfg))) == cfg.pool_size()
    assert obs["action_mask"].shape == (cfg.k_slots * cfg.levels + 1,) == (cfg.n_actions,)
    assert obs["action_mask"].tolist() == [0] * (cfg.n_actions - 1) + [1]  # empty queue
    assert not obs["slots"].any() and not obs["backlog"].any()


def test_features_land_where_documented(state):
    enc = ObservationEncoder(state, SMALL, make_advisor(SMALL))
    names = pool_features(SMALL)
    c = submit_at(state, 0.0, cpu_spec(est=2.0, cores=(2, 8), p=0.5))
    g = submit_at(state, 1.0, gpu_spec())
    a = submit_at(state, 2.0, api_spec())
    state.start(Grant(submit_at(state, 2.0, cpu_spec(cores=(3, 3))), cores=3, node=0))
    state.advance(5.0)
    obs = enc.observe(state)
    x = obs["slots"].reshape(SMALL.k_slots, F)
    pools = dict(zip(names, obs["pools"].tolist(), strict=True))
    # Slot rows: cpu, gpu, api in submission order (all can start).
    assert x[:3, [col("is_cpu"), col("is_gpu"), col("is_api")]].tolist() == np.eye(3).tolist()
    assert x[0, col("log_est_s")] == pytest.approx(math.log1p(2.0))
    assert x[0, col("log_est_best_s")] == pytest.approx(math.log1p(c.spec.est_run_s(8)))
    assert x[0, col("min_cores_frac")] == pytest.approx(2 / 8)
    assert x[0, col("max_cores_frac")] == pytest.approx(1.0)
    assert x[0, col("parallel_fraction")] == pytest.approx(0.5)
    assert x[:3, col("log_wait_s")] == pytest.approx([math.log1p(5), math.log1p(4),
                                                       math.log1p(3)])
    assert x[0, col("node_free_frac")] == pytest.approx(5 / 8)
    assert x[1, col("same_service_frac")] == pytest.approx(1 / 8)
    assert x[2, col("concurrency_frac")] == 0.0
    assert x[:3, col("feasible")].tolist() == [1, 1, 1]
    assert x[:, col("present")].tolist() == [1, 1, 1, 0]
    assert not x[3].any()
    assert pools["cpu_busy_frac"] == pytest.approx(3 / 8)
    assert pools["node0_free_frac"] == pytest.approx(5 / 8) and pools["node1_free_frac"] == 0
    assert pools["log_pending"] == pytest.approx(math.log1p(3))
    assert pools["log_running"] == pytest.approx(math.log1p(1))
    # Start the gpu and api actions: device busy with rm resident, one call in flight.
    state.start(Grant(g, device=0))
    state.start(Grant(a))
    obs = enc.observe(state)
    pools = dict(zip(names, obs["pools"].tolist(), strict=True))
    assert pools["gpu0_busy"] == 1.0 and pools["gpu0_resident_0"] == 1.0
    assert pools["gpu0_mem_frac"] == pytest.approx(30 / 80)
    assert pools["gpu1_busy"] == 0.0  # no second device: zero padding
    ep = state.api.endpoints["e"]
    assert pools["api0_concurrency_frac"] == pytest.approx(1 / ep.spec.max_concurrency)
    assert pools["api0_req_frac"] == pytest.approx(ep.req / ep.spec.req_capacity)
    assert pools["api1_req_frac"] == 0.0
    assert obs["slots"].reshape(SMALL.k_slots, F)[:, col("present")].tolist() == [1, 0, 0, 0]
    assert all(0.0 <= v <= 1e4 for k in ("slots", "backlog", "pools") for v in obs[k])


def test_a_re_estimated_action_is_encoded_afresh(state):
    """The features of an action's spec are kept between observations: a spec
    replaced (re-estimated) is read again, as a new encoder reads it."""
    enc = ObservationEncoder(state, SMALL, make_advisor(SMALL))
    a = submit_at(state, 0.0, cpu_spec(est=2.0, cores=(2, 8)))
    enc.observe(state)
    a.spec = replace(a.spec, est_s=50.0, min_cores=4)
    state.version += 1
    fresh = ObservationEncoder(state, SMALL, make_advisor(SMALL)).observe(state)
    x = enc.observe(state)["slots"].reshape(SMALL.k_slots, F)
    assert x.tolist() == fresh["slots"].reshape(SMALL.k_slots, F).tolist()
    assert x[0, col("log_est_s")] == pytest.approx(math.log1p(50.0))
    assert x[0, col("min_cores_frac")] == pytest.approx(4 / 8)


# ------------------------------------------------------------------ slots and backlog


def test_slot_order_advised_first_then_feasible_then_blocked(state):
    enc = ObservationEncoder(state, SMALL, make_advisor(SMALL))
    old = submit_at(state, 0.0, cpu_spec())
    young = submit_at(state, 1.0, cpu_spec())
    state.advance(2.0)

    class AdvisesYoungest:
        def decide(self, st):
            return [Grant(young, cores=1, node=0)]

    enc.advisor = AdvisesYoungest()
    state.version += 1  # the advisor changed: drop the cached view
    assert [a.id for a in enc.slots(state)] == [young.id, old.id]
    assert enc.advice(state) == {young.id: 1.0}


def test_slot_order_feasible_first_oldest_first(state):
    enc = ObservationEncoder(state, SMALL, make_advisor(SMALL))
    big = submit_at(state, 0.0, cpu_spec(cores=(9, 9)))  # never fits the 8-core node
    a1 = submit_at(state, 1.0, cpu_spec())
    blocked_big = submit_at(state, 2.0, cpu_spec(cores=(12, 16)))
    a3 = submit_at(state, 3.0, gpu_spec())
    state.advance(10.0)
    slots = enc.slots(state)
    assert [a.id for a in slots] == [a1.id, a3.id, big.id, blocked_big.id]
    x = enc.observe(state)["slots"].reshape(SMALL.k_slots, F)
    assert x[:, col("feasible")].tolist() == [1, 1, 0, 0]
    assert x[:, col("log_wait_s")] == pytest.approx([math.log1p(9), math.log1p(7),
                                                      math.log1p(10), math.log1p(8)])
    # More ready actions than slots: only ready ones, the oldest.
    ready = [submit_at(state, 11.0 + i, api_spec()) for i in range(3)]
    assert [a.id for a in enc.slots(state)] == [a1.id, a3.id, ready[0].id, ready[1].id]


@pytest.mark.parametrize("name", PROFILES)
def test_slot_order_on_simulated_states(name):
    k = ObsConfig().k_slots
    checked = 0
    for sim, enc in decision_states(name, 200, load=1.0):
        st = sim.state
        pending = sorted((a for d in st.pending.values() for a in d.values()),
                         key=lambda a: (a.submit_t, a.id))
        advice = enc.advice(st)
        advised = [a for a in pending if a.id in advice]
        ready = [a for a in pending if st.feasible(a) and a.id not in advice]
        blocked = [a for a in pending if not st.feasible(a)]
        want = (advised + ready + blocked)[:k]
        slots = enc.slots(st)
        assert [a.id for a in slots] == [a.id for a in want]
        obs = enc.observe(st)
        x = obs["slots"].reshape(k, F)
        mask = obs["action_mask"][:-1].reshape(k, ObsConfig().levels)
        assert x[:, col("present")].tolist() == [1.0] * len(slots) + [0.0] * (k - len(slots))
        assert x[:, col("feasible")].tolist() == [float(st.feasible(a)) for a in slots] + [
            0.0] * (k - len(slots))
        assert (x[:, col("feasible")] == mask.any(axis=1)).all()
        checked += len(blocked) > 0 and len(advised) + len(ready) > 0
    # States with actions that can start and actions that cannot (never on coding at
    # this load: its cluster is sized for every sandbox of a step; never on retool: all
    # its actions need one core of one node, so either all of them can start or none).
    assert checked > 0 or name in ("coding", "retool")


def test_backlog_counts_everything_beyond_k(state):
    enc = ObservationEncoder(state, SMALL, make_advisor(SMALL))  # K = 4
    order = ["cpu", "gpu", "api", "cpu_big", "cpu", "gpu", "api", "cpu"]
    specs = {"cpu": lambda i: cpu_spec(est=1.0 + i), "cpu_big": lambda i: cpu_spec(
        est=1.0 + i, cores=(9, 9)), "gpu": lambda i: gpu_spec(est=0.5 + i),
        "api": lambda i: api_spec(est=2.0 + i)}
    acts = [submit_at(state, float(i), specs[kind](i)) for i, kind in enumerate(order)]
    state.advance(10.0)
    slots = enc.slots(state)
    # Ready first (cpu0, gpu1, api2, cpu4); the big cpu action cannot start: backlog.
    assert [a.id for a in slots] == [acts[i].id for i in (0, 1, 2, 4)]
    b = enc.observe(state)["backlog"].reshape(3, 3)
    rest = {kind: [a for a in acts[3:] if a.spec.kind == kind and a not in slots]
            for kind in KIND_NAMES}
    for row, kind in enumerate(KIND_NAMES):
        r = rest[kind]
        assert b[row, 0] == pytest.approx(math.log1p(len(r)))
        assert b[row, 1] == pytest.approx(math.log1p(sum(a.spec.est_s for a in r)))
        assert b[row, 2] == pytest.approx(math.log1p(10.0 - min(a.submit_t for a in r)))
    # Nothing invisible: counts in slots + backlog = everything pending.
    assert len(slots) + sum(round(math.expm1(v)) for v in b[:, 0]) == state.n_pending == 8


@pytest.mark.parametrize("name", PROFILES)
def test_backlog_on_simulated_states(name):
    k = 4
    seen_backlog = False
    for sim, enc in decision_states(name, 150, load=0.5, cfg=ObsConfig(k_slots=k)):
        st = sim.state
        b = enc.observe(st)["backlog"].reshape(3, 3)
        counts = [round(math.expm1(float(v))) for v in b[:, 0]]
        assert sum(counts) == max(0, st.n_pending - k)
        in_slots = {a.id for a in enc.slots(st)}
        for row, kind in enumerate(KIND_NAMES):
            assert counts[row] == sum(a.id not in in_slots for a in st.pending[kind].values())
        seen_backlog |= sum(counts) > 0
    assert seen_backlog


# ------------------------------------------------------------------ levels


def test_cpu_and_batch_levels():
    assert cpu_levels(1, 16, 4) == (1, 3, 6, 16)
    assert cpu_levels(2, 8, 3) == (2, 4, 8)
    assert cpu_levels(1, 2, 4) == (1, -1, 2, -1)
    assert cpu_levels(1, 1, 4) == (1, -1, -1, -1)
    assert cpu_levels(4, 8, 1) == (4,)
    assert batch_levels(32, 4) == (1, 3, 10, 32)
    assert batch_levels(1, 3) == (1, -1, -1)
    assert batch_levels(8, 2) == (1, 8)
    for lo, hi, n in itertools.product(range(1, 9), range(1, 70, 3), range(1, 7)):
        if hi < lo:
            continue
        lv = cpu_levels(lo, hi, n)
        real = [c for c in lv if c != -1]
        assert len(lv) == n and lv[0] == lo
        assert real == sorted(set(real))  # strictly increasing, repeats marked -1
        assert all(lo <= c <= hi for c in real)
        assert n == 1 or real[-1] == hi


# ------------------------------------------------------------------ grants


@pytest.mark.parametrize("name", PROFILES)
def test_grant_legal_iff_unmasked(name):
    cfg = ObsConfig()
    n_legal = 0
    for sim, enc in decision_states(name, 60, wait_prob=0.3):
        st = sim.state
        slots = enc.slots(st)
        mask = enc.mask(st, slots)
        assert np.array_equal(mask, enc.observe(st)["action_mask"].astype(bool))
        for i in range(cfg.n_actions):
            g = enc.grant(st, i, slots)
            if not mask[i] or i == cfg.n_actions - 1:
                assert g is None, i
                continue
            n_legal += 1
            assert g is not None, i
            assert st.check(g) is None, (i, st.check(g))
            slot, level = divmod(i, cfg.levels)
            a = slots[slot]
            assert g.action is a
            advised = enc.advised_grants(st).get(a.id)
            if advised is not None:  # an advised slot is the advisor's grant at every level
                assert g is advised
            elif a.spec.kind == "cpu":
                assert g.cores == cpu_levels(a.spec.min_cores, a.spec.max_cores,
                                             cfg.levels)[level]
            elif a.spec.kind == "gpu":
                cap = batch_levels(st.gpu.services[a.spec.service].max_batch, cfg.levels)[level]
                assert 1 + len(g.batch) <= cap
    assert n_legal > 0


@pytest.mark.parametrize("name", PROFILES)
def test_action_for_maps_elastic_greedy_back(name):
    mapped = 0
    for sim, enc in decision_states(name, 150, wait_prob=0.3):
        st = sim.state
        grants = make_scheduler("elastic_greedy").decide(st)
        if not grants:
            continue
        g = grants[0]
        slots = enc.slots(st)
        a = enc.action_for(st, g, slots)
        if a is None:
            assert all(s is not g.action for s in slots)  # only when it is not in a slot
            continue
        mapped += 1
        assert enc.mask(st, slots)[a]
        back = enc.grant(st, a, slots)
        assert back is not None and back.action is g.action
        if g.action.spec.kind == "cpu":  # the level nearest the granted cores
            s = g.action.spec
            sizes = cpu_levels(s.min_cores, s.max_cores, enc.cfg.levels)
            legal = [c for lv, c in enumerate(sizes) if enc.mask(st, slots)[
                a - a % enc.cfg.levels + lv]]
            best = min(abs(math.log(c) - math.log(g.cores)) for c in legal)
            assert abs(math.log(back.cores) - math.log(g.cores)) == pytest.approx(best)
    assert mapped > 0


@pytest.mark.parametrize("queued", [1, 2, 3, 5, 8])
def test_action_for_reproduces_the_gpu_batch_it_maps(state, queued):
    # max_batch 8 and L = 4: caps 1, 2, 4, 8. A batch of every queued request maps to the
    # level whose grant runs exactly that batch (5 queued: cap 8, not the nearer cap 4).
    enc = ObservationEncoder(state, SMALL, make_advisor(SMALL))
    reqs = [submit_at(state, 0.0, gpu_spec()) for _ in range(queued)]
    state.advance(1.0)
    g = Grant(reqs[0], device=0, batch=tuple(reqs[1:]))
    a = enc.action_for(state, g)
    back = enc.grant(state, a)
    assert back.action is reqs[0] and len(back.batch) == queued - 1


@pytest.mark.parametrize("name", ["rm_math", "mixed"])
def test_advisor_features_mark_the_advisors_grants(name):
    cfg = ObsConfig()
    assert cfg.advisor == "rate_greedy"
    plain = None
    seen = 0
    for sim, enc in decision_states(name, 80, wait_prob=0.3):
        st = sim.state
        plain = plain or ObservationEncoder(st, ObsConfig(advisor=None))
        advice = make_scheduler(cfg.advisor).decide(st)
        advised = {g.action.id for g in advice}
        obs = enc.observe(st)
        x = obs["slots"].reshape(cfg.k_slots, F)
        slots = enc.slots(st)
        want = [float(a.id in advised) for a in slots] + [0.0] * (cfg.k_slots - len(slots))
        assert x[:, col("advised")].tolist() == want
        assert obs["pools"][pool_features(cfg).index("advisor_waits")] == float(not advice)
        seen += sum(want) > 0
        x0 = plain.observe(st)["slots"].reshape(cfg.k_slots, F)
        assert not x0[:, [col("advised"), col("advised_size_frac")]].any()
    assert seen > 0


# ------------------------------------------------------------------ caps


@pytest.mark.parametrize("name, cfg", [
    ("coding", ObsConfig(max_nodes=1)),        # 4 nodes
    ("rm_math", ObsConfig(max_devices=1)),     # 2 devices
    ("rm_math", ObsConfig(max_services=2)),    # 3 services
    ("search", ObsConfig(max_endpoints=1)),    # 2 endpoints
    ("rm_math", ObsConfig(k_slots=0)),
    ("rm_math", ObsConfig(levels=0)),
])
def test_encoder_rejects_clusters_beyond_caps(name, cfg):
    w, c = shrunk(name)
    st = ClusterState(c, w.services)
    with pytest.raises(ValueError):
        ObservationEncoder(st, cfg, make_advisor(cfg))
    with pytest.raises(ValueError):
        ActionSchedulingEnv(w, c, obs_config=cfg)


# ------------------------------------------------------------------ one encoding, sim and live


class RecordingState(ClusterState):
    """A ClusterState that logs every mutation made through its public methods."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.log: list[tuple] = []

    def advance(self, t):
        self.log.append(("advance", t))
        super().advance(t)

    def submit(self, a):
        self.log.append(("submit", a.id, a.spec, a.task,
                         None if a.traj is None else a.traj.id, a.turn, a.submit_t))
        super().submit(a)

    def start(self, g):
        self.log.append(("start", g.action.id, g.cores, g.node, g.device,
                         tuple(b.id for b in g.batch), g.hold))
        return super().start(g)

    def finish(self, a, ok, reason=""):
        self.log.append(("finish", a.id, ok, reason))
        return super().finish(a, ok, reason)

    def release_device(self, device):
        self.log.append(("release", device))
        super().release_device(device)

    def open_trajectory(self, traj):
        ok = super().open_trajectory(traj)
        self.log.append(("open", traj.id, traj.task, traj.step, traj.sandbox, traj.start_t, ok))
        return ok

    def close_trajectory(self, traj):
        self.log.append(("close", traj.id, traj.end_t))
        super().close_trajectory(traj)


def replay(log, sim: Simulator) -> ClusterState:
    """Drive a fresh ClusterState by hand, as a live dispatcher would: the same submits,
    starts, finishes and clock advances, on new Action and Trajectory objects."""
    st = ClusterState(sim.cluster, sim.workload.services)
    st.task_demand = sim.instance.demand_by_task()
    acts: dict[int, Action] = {}
    trajs: dict[int, Trajectory] = {}
    for op, *args in log:
        if op == "advance":
            st.advance(*args)
        elif op == "open":
            tid, task, step, sandbox, start_t, ok = args
            if tid not in trajs:
                trajs[tid] = Trajectory(tid, task, step, [], sandbox)
                trajs[tid].start_t = start_t
            assert st.open_trajectory(trajs[tid]) == ok
        elif op == "submit":
            aid, spec, task, tid, turn, submit_t = args
            traj = None if tid is None else trajs[tid]
            if traj is not None:
                traj.turn = turn + 1  # turns submitted so far
            acts[aid] = Action(aid, spec, task, traj, turn, submit_t)
            st.submit(acts[aid])
        elif op == "start":
            aid, cores, node, device, batch, hold = args
            st.start(Grant(acts[aid], cores, node, device, tuple(acts[b] for b in batch), hold))
        elif op == "finish":
            st.finish(acts[args[0]], args[1], args[2])
        elif op == "release":
            st.release_device(args[0])
        else:  # close
            traj = trajs[args[0]]
            traj.end_t = args[1]
            st.close_trajectory(traj)
    if trajs:  # the RL step as the live loop tracks it
        step = max(t.step for t in trajs.values())
        st.step_index = step
        st.step_start_t = next(t.start_t for t in trajs.values() if t.step == step)
        st.step_total = len(sim.instance.steps[step])
        st.step_done = sum(1 for t in trajs.values() if t.step == step and t.id not in
                           st.trajectories and not math.isnan(t.end_t))
    return st


@pytest.mark.parametrize("name", PROFILES)
def test_sim_and_hand_driven_states_encode_identically(name, monkeypatch):
    monkeypatch.setattr(simulator_module, "ClusterState", RecordingState)
    w, c = shrunk(name)
    env = ActionSchedulingEnv(w, c, episode_steps=2)  # the env observes at every decision
    rng = np.random.default_rng(0)
    obs, _ = env.reset(seed=3)
    assert isinstance(env.sim.state, RecordingState)
    compared, n, done = 0, 0, False
    while not done:
        if n % 13 == 0:
            live = replay(env.sim.state.log, env.sim)
            enc = ObservationEncoder(live, env.obs_config, make_advisor(env.obs_config))
            live_obs = enc.observe(live)
            for k in obs:
                assert obs[k].tobytes() == live_obs[k].tobytes(), (n, k)
            compared += 1
        obs, _, term, trunc, _ = env.step(int(rng.choice(np.flatnonzero(obs["action_mask"]))))
        done, n = term or trunc, n + 1
    assert compared >= 3


def test_two_simulators_same_seed_same_observations():
    w, c = shrunk("mixed")
    sims = [Simulator(w, c, 11, max_wait_s=300.0) for _ in range(2)]
    encs = [ObservationEncoder(s.state, ObsConfig(), make_advisor(ObsConfig())) for s in sims]
    rng = np.random.default_rng(0)
    steps = 0
    while all([s.next_decision() for s in sims]):
        o1, o2 = (e.observe(s.state) for e, s in zip(encs, sims, strict=True))
        assert all(o1[k].tobytes() == o2[k].tobytes() for k in o1)
        a = int(rng.choice(np.flatnonzero(o1["action_mask"])))
        for e, s in zip(encs, sims, strict=True):
            g = e.grant(s.state, a)
            s.apply(g) if g is not None else s.wait()
        steps += 1
    assert steps > 50 and all(s.done for s in sims)


class Observing(Scheduler):
    """Wraps a scheduler and encodes the state before each decision."""

    def __init__(self, inner: Scheduler) -> None:
        self.inner, self.name = inner, inner.name

    def reset(self, state, rng):
        self.inner.reset(state, rng)
        self.enc = ObservationEncoder(state, ObsConfig(), make_advisor(ObsConfig()))

    def decide(self, state):
        self.enc.observe(state)
        self.enc.mask(state)
        return self.inner.decide(state)


@pytest.mark.parametrize("name", ["search", "mixed"])
def test_observing_does_not_change_the_run(name):
    w, c = shrunk(name)
    plain = Simulator(w, c, 5, max_wait_s=300.0).run(make_scheduler("elastic_greedy"))
    seen = Simulator(w, c, 5, max_wait_s=300.0).run(Observing(make_scheduler("elastic_greedy")))
    for f in ("submit", "start", "end", "ok"):
        assert np.array_equal(getattr(plain, f), getattr(seen, f)), f
    assert plain.counters == seen.counters


# ------------------------------------------------------------------ the advisor's own grants


@pytest.mark.parametrize("name", ["rm_math", "mixed", "retool"])
def test_advised_action_is_the_advisors_grant(name):
    """Following the advisor is choosing its slot, whatever node, cores, device and batch
    it chose: every legal level of an advised slot decodes to the advisor's grant."""
    checked = 0
    levels = ObsConfig().levels
    for sim, enc in decision_states(name, 80, wait_prob=0.3):
        st = sim.state
        slots, mask = enc.slots(st), enc.mask(st)
        for g in enc.advised_grants(st).values():
            a = enc.action_for(st, g)
            if a is None:  # advised beyond the K slots
                continue
            slot = a // levels
            assert slots[slot] is g.action
            legal = [slot * levels + lv for lv in range(levels) if mask[slot * levels + lv]]
            assert a in legal and all(enc.grant(st, i) is g for i in legal)
            checked += 1
    assert checked > 0


class FollowsAdvisor(Scheduler):
    """Grants the advisor's first advised action through the encoder's action space."""

    name = "follows_advisor"

    def reset(self, state, rng):
        self.enc = ObservationEncoder(state, ObsConfig(), make_advisor(ObsConfig()))

    def decide(self, state):
        slots = self.enc.slots(state)
        advised = self.enc.advised_grants(state)
        for s in slots:
            if s.id in advised:
                return [self.enc.grant(state, self.enc.action_for(state, advised[s.id], slots))]
        return []


@pytest.mark.parametrize("name", ["rm_math", "mixed"])
def test_following_the_advisor_reproduces_its_run(name):
    w, c = shrunk(name, 0.1)
    want = Simulator(w, c, 3, max_wait_s=300.0).run(make_scheduler(ObsConfig().advisor))
    got = Simulator(w, c, 3, max_wait_s=300.0).run(FollowsAdvisor())
    assert got.act.size == want.act.size > 0
    assert np.allclose(np.sort(got.act), np.sort(want.act))


def test_gpu_levels_batch_the_shortest_requests(make_cluster):
    st = ClusterState(make_cluster(nodes=1, cores=8, gpus=1), SERVICES)
    enc = ObservationEncoder(st, ObsConfig(k_slots=4, levels=4, max_nodes=2, max_devices=2,
                                           max_services=2, max_endpoints=2, advisor=None))
    ests = [5.0, 0.1, 3.0, 0.2, 0.3, 4.0]
    reqs = [submit_at(st, float(i), gpu_spec(e)) for i, e in enumerate(ests)]
    st.advance(10.0)
    slots = enc.slots(st)
    lead = slots.index(reqs[0])
    level = batch_levels(SERVICES["rm"].max_batch, 4).index(4)  # a batch of up to 4
    g = enc.grant(st, lead * 4 + level)
    assert g.action is reqs[0]
    assert [b.spec.est_s for b in g.batch] == [0.1, 0.2, 0.3]
