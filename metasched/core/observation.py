"""Observation encoder and action masks, shared by the Gymnasium env, evaluation of
learned policies and the live dispatcher (one encoder: no sim/live skew).

Observation (a dict of float32 arrays):

- ``slots`` (K * F, row-major K x F): K pending actions, one row each, zero rows after the last;
  actions that could start now come first, then the others, each group longest
  waiting first (ties by id); features in ``SLOT_FEATURES`` order.
- ``backlog`` (9, row-major 3 x 3): per kind (cpu, gpu, api), for the pending actions beyond the K
  slots: log1p(count), log1p(total estimated seconds), log1p(longest wait). Nothing in
  the queue is invisible.
- ``pools``: cluster-wide and per-unit state (``pool_features`` documents the layout):
  CPU busy/held fractions and free cores per node; per GPU device busy, memory used and
  resident services; per API endpoint request/token quota room (what its window still
  admits) and concurrency;
  step progress and queue size. Every feature is clipped to [0, ``OBS_HIGH``].
- ``action_mask`` (K x L + 1): which actions are legal now.

The advisor (``ObsConfig.advisor``, ``elastic_greedy`` by default) is asked what it
would start now; its proposal enters as the slot features ``advised`` /
``advised_size_frac`` and the pool feature ``advisor_waits``. The policy learns when
to follow it and when to do better. The core only names the advisor: whoever builds
the encoder builds that heuristic and hands it over
(:func:`metasched.agents.make_advisor`).

Action ``i = slot * L + level`` grants the action in ``slot`` at allocation ``level``;
``i = K * L`` waits until the next event (always legal). Levels: cpu, cores spaced
geometrically from the action's minimum (level 0) to its maximum (level L-1), legal if
that many cores are free on its node; gpu, a batch of at most 1 .. max_batch requests
(geometric) on the preferred idle device (service resident, else room without
eviction, else least recently used), filled with the shortest queued requests to its
service (one long request makes a whole batch as slow as itself); api, level 0 only.

An advised action, at any legal level, is the advisor's grant itself (its node, cores,
device and batch): following the advisor is choosing its slot, whatever batch or device
it chose; the levels choose allocations of the actions it did not advise.
"""

from __future__ import annotations

import functools
import heapq
import math
from dataclasses import asdict, dataclass
from functools import cache

import numpy as np

from metasched.core.actions import Action, ActionSpec, Grant
from metasched.core.ledger import Ledger
from metasched.core.scheduler import Scheduler
from metasched.core.state import ClusterState

OBS_SCHEMA_VERSION = 3  # 2: advisor features; advised actions fill the first slots
# 3: rate_greedy advises; an advised slot is the advisor's own grant; gpu levels batch
#    the shortest queued requests
OBS_HIGH = 1e4  # every feature is clipped to [0, OBS_HIGH]

SLOT_FEATURES = (
    "is_cpu", "is_gpu", "is_api",
    "log_est_s",              # log1p(estimated run time at minimum allocation)
    "log_est_best_s",         # log1p(estimated run time at maximum cores)
    "min_cores_frac",         # min cores / cores per node
    "max_cores_frac",         # max cores / cores per node
    "parallel_fraction",
    "log_wait_s",             # log1p(time since submission)
    "is_reward",              # the trajectory's last action
    "log_turn",               # log1p(turns the trajectory has submitted)
    "log_traj_elapsed_s",     # log1p(time since the trajectory started)
    "log_traj_act_s",         # log1p(sum of the trajectory's finished ACTs)
    "node_free_frac",         # cpu: free (+ held) cores on its node / cores per node
    "resident_idle",          # gpu: its service is resident on an idle device
    "log_restore_s",          # gpu: log1p(restore time on the preferred idle device)
    "same_service_frac",      # gpu: queued requests to its service / max batch
    "req_tokens_frac",        # api: requests the window still admits / its allowance
    "tok_tokens_frac",        # api: tokens the window still admits / the call's (<= 1)
    "concurrency_frac",       # api: calls in flight / max concurrency
    "feasible",               # some level is legal now
    "advised",                # the advisor heuristic would start this action now
    "advised_size_frac",      # its advised cores / max cores (cpu) or batch / max batch (gpu)
    "present",                # 1 for a filled slot (always the last feature)
)
F = len(SLOT_FEATURES)
KIND_NAMES = ("cpu", "gpu", "api")


@dataclass(frozen=True)
class ObsConfig:
    """Sizes of the observation; part of a checkpoint's schema."""

    k_slots: int = 16
    levels: int = 4
    max_nodes: int = 8
    max_devices: int = 4
    max_services: int = 4
    max_endpoints: int = 4
    advisor: str | None = "rate_greedy"  # heuristic whose proposal is a feature (and a grant)
    version: int = OBS_SCHEMA_VERSION

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def n_actions(self) -> int:
        return self.k_slots * self.levels + 1

    def pool_size(self) -> int:
        return (2 + self.max_nodes + self.max_devices * (2 + self.max_services)
                + self.max_endpoints * 3 + 5)


def pool_features(cfg: ObsConfig) -> list[str]:
    """Names of the ``pools`` entries, in order."""
    names = ["cpu_busy_frac", "cpu_held_frac"]
    names += [f"node{i}_free_frac" for i in range(cfg.max_nodes)]
    for d in range(cfg.max_devices):
        names += [f"gpu{d}_busy", f"gpu{d}_mem_frac"]
        names += [f"gpu{d}_resident_{s}" for s in range(cfg.max_services)]
    for e in range(cfg.max_endpoints):
        names += [f"api{e}_req_frac", f"api{e}_tok_frac", f"api{e}_concurrency_frac"]
    names += ["step_progress", "log_step_elapsed_s", "log_pending", "log_running",
              "advisor_waits"]
    return names


@cache  # pure, and asked for every slot of every observation
@functools.lru_cache(maxsize=4096)  # asked per slot at every decision, of a few ranges
def cpu_levels(min_cores: int, max_cores: int, levels: int) -> tuple[int, ...]:
    """Core counts of the allocation levels: geometric from min to max; a level that
    repeats the previous count is -1 (never legal)."""
    out, prev = [], 0
    for lv in range(levels):
        f = lv / (levels - 1) if levels > 1 else 0.0
        c = int(round(min_cores * (max_cores / min_cores) ** f))
        out.append(c if c != prev else -1)
        prev = c
    return tuple(out)


def batch_levels(max_batch: int, levels: int) -> tuple[int, ...]:
    """Batch-size caps of the gpu levels (1 .. max_batch, geometric; repeats are -1)."""
    return cpu_levels(1, max_batch, levels)


class ObservationEncoder:
    """Turns a ``ClusterState`` into the observation, mask and grants of the policy.

    ``advisor`` is the scheduler ``cfg.advisor`` names, built by the caller
    (:func:`metasched.agents.make_advisor`); given exactly when ``cfg.advisor`` is set.

    Raises ``ValueError`` if the cluster exceeds the observation's sizes.
    """

    def __init__(self, state: ClusterState, cfg: ObsConfig | None = None,
                 advisor: Scheduler | None = None) -> None:
        self.cfg = cfg = cfg or ObsConfig()
        if cfg.levels < 1 or cfg.k_slots < 1:
            raise ValueError("k_slots and levels must be >= 1")
        for what, n, cap in (("CPU nodes", state.cpu.n_nodes, cfg.max_nodes),
                             ("GPU devices", state.gpu.total, cfg.max_devices),
                             ("GPU services", len(state.gpu.services), cfg.max_services),
                             ("API endpoints", len(state.api.endpoints), cfg.max_endpoints)):
            if n > cap:
                raise ValueError(f"{what}: {n} exceed the observation's {cap}")
        if (advisor is None) != (cfg.advisor is None):
            raise TypeError(f"ObsConfig.advisor is {cfg.advisor!r}: pass the advisor it names "
                            "(metasched.agents.make_advisor(cfg)), and only then")
        self.advisor = advisor
        if advisor is not None:
            advisor.reset(state, np.random.default_rng(0))
        self._cache_key: tuple[int, int] | None = None
        self._cache: tuple[list[Action], dict[int, float], dict[int, Grant]] = ([], {}, {})
        # Per action id, its spec and the slot features that depend on the spec alone:
        # a decision reads 16 slots, which mostly held the same actions at the previous
        # one (a spec replaced, e.g. re-estimated, is a new object: its row is rebuilt).
        self._fixed: dict[int, tuple[ActionSpec, list[float]]] = {}
        self.service_index = {s: i for i, s in enumerate(sorted(state.gpu.services))}
        self.endpoint_names = sorted(state.api.endpoints)
        self.node_cores = max(1, state.cluster.cores_per_node)

    # ------------------------------------------------------------------ slots

    def slots(self, state: ClusterState) -> list[Action]:
        """The K actions in the slots: those the advisor would start now first, then the
        others that could start now, then the rest; each group longest waiting first
        (ties by id). So whenever a decision is possible some slot holds an action that
        can start, and the advisor's choices are always visible."""
        return self._view(state)[0]

    def advice(self, state: ClusterState) -> dict[int, float]:
        """Action id -> advised size fraction, for what the advisor would start now."""
        return self._view(state)[1]

    def advised_grants(self, state: ClusterState) -> dict[int, Grant]:
        """Action id -> the advisor's grant of it now."""
        return self._view(state)[2]

    def _view(self, state: ClusterState
              ) -> tuple[list[Action], dict[int, float], dict[int, Grant]]:
        key = (id(state), state.version)
        if self._cache_key == key:
            return self._cache
        grants = self._ask_advisor(state)
        advice = {i: self._size_frac(state, g) for i, g in grants.items()}
        p = state.pending
        queues = [q for q in (p["cpu"], p["gpu"], p["api"]) if q]
        # one queue is already in its order: merged, it would be the same, at a key each
        merged = (iter(queues[0].values()) if len(queues) == 1 else
                  heapq.merge(*(q.values() for q in queues), key=lambda a: (a.submit_t, a.id)))
        k = self.cfg.k_slots
        advised: list[Action] = []
        ready: list[Action] = []
        blocked: list[Action] = []
        # cpu feasibility (state.cpu_feasible) with the freest node's cores read once
        cpu_free = state.cpu.free
        freest = max(cpu_free, default=0)
        for a in merged:
            if a.id in advice:
                advised.append(a)
            elif (((cpu_free[a.node] if a.node >= 0 else freest) >= a.spec.min_cores
                   - (a.traj.held_cores if a.traj is not None else 0))
                  if a.spec.kind == "cpu" else state.feasible(a)):
                if len(ready) < k:
                    ready.append(a)
            elif len(blocked) < k:
                blocked.append(a)
            if len(advised) + len(ready) >= k and len(advised) >= len(advice):
                break
        self._cache_key = key
        self._cache = ((advised + ready + blocked)[:k], advice, grants)
        return self._cache

    def _ask_advisor(self, state: ClusterState) -> dict[int, Grant]:
        if self.advisor is None:
            return {}
        return {g.action.id: g for g in self.advisor.decide(state)}

    @staticmethod
    def _size_frac(state: ClusterState, g: Grant) -> float:
        """The advised allocation: cores / max cores (cpu), batch / max batch (gpu)."""
        s = g.action.spec
        if s.kind == "cpu":
            return g.cores / s.max_cores
        if s.kind == "gpu":
            return (1 + len(g.batch)) / state.gpu.services[s.service].max_batch
        return 1.0

    # ------------------------------------------------------------------ mask / grants

    def _legal_levels(self, state: ClusterState, led: Ledger, a: Action,
                      room: int | None = None) -> list[bool]:
        """Which levels of ``a`` are legal now (``room``: its ``led.cpu_room`` if
        already known)."""
        L = self.cfg.levels
        spec = a.spec
        if spec.kind == "cpu":
            if room is None:
                _, room = led.cpu_room(a)
            return [0 < c <= room for c in cpu_levels(spec.min_cores, spec.max_cores, L)]
        if spec.kind == "gpu":
            if led.idle_device_for(spec.service) < 0:
                return [False] * L
            svc = state.gpu.services[spec.service]
            return [b > 0 for b in batch_levels(svc.max_batch, L)]
        return [led.api_ok(a)] + [False] * (L - 1)

    def mask(self, state: ClusterState, slots: list[Action] | None = None) -> np.ndarray:
        """Legal actions now: (K * L + 1,) bool, wait last and always legal."""
        slots = self.slots(state) if slots is None else slots
        cfg = self.cfg
        m = np.zeros(cfg.n_actions, dtype=bool)
        led = Ledger(state)
        for i, a in enumerate(slots):
            m[i * cfg.levels:(i + 1) * cfg.levels] = self._legal_levels(state, led, a)
        m[-1] = True
        return m

    def grant(self, state: ClusterState, action: int,
              slots: list[Action] | None = None) -> Grant | None:
        """The grant that ``action`` means now; None for wait or an illegal action."""
        cfg = self.cfg
        if not 0 <= action < cfg.n_actions - 1:
            return None
        slots = self.slots(state) if slots is None else slots
        i, level = divmod(int(action), cfg.levels)
        if i >= len(slots):
            return None
        a = slots[i]
        led = Ledger(state)
        if not self._legal_levels(state, led, a)[level]:
            return None
        advised = self.advised_grants(state).get(a.id)
        if advised is not None:
            return advised
        spec = a.spec
        if spec.kind == "cpu":
            node, _ = led.cpu_room(a)
            return Grant(a, cores=cpu_levels(spec.min_cores, spec.max_cores, cfg.levels)[level],
                         node=node)
        if spec.kind == "gpu":
            cap = batch_levels(state.gpu.services[spec.service].max_batch, cfg.levels)[level]
            device = led.idle_device_for(spec.service)
            return Grant(a, device=device, batch=self.shortest_batch(state, a, cap))
        return Grant(a)

    @staticmethod
    def shortest_batch(state: ClusterState, a: Action, limit: int) -> tuple[Action, ...]:
        """The other pending requests to ``a``'s service with the shortest estimates
        (ties: oldest), at most ``limit - 1`` of them: the rest of a batch led by ``a``."""
        room = min(limit, state.gpu.services[a.spec.service].max_batch) - 1
        if room <= 0:
            return ()
        same = (b for b in state.pending["gpu"].values()
                if b is not a and b.spec.service == a.spec.service)
        return tuple(heapq.nsmallest(room, same, key=lambda b: (b.spec.est_s, b.submit_t, b.id)))

    def action_for(self, state: ClusterState, g: Grant,
                   slots: list[Action] | None = None) -> int | None:
        """The env action closest to grant ``g`` (for imitating a heuristic), or None
        when its action is not in a slot or no level of it is legal."""
        slots = self.slots(state) if slots is None else slots
        i = next((j for j, a in enumerate(slots) if a is g.action), -1)
        if i < 0:
            return None
        led = Ledger(state)
        legal = self._legal_levels(state, led, g.action)
        spec = g.action.spec
        if spec.kind == "cpu":
            sizes = cpu_levels(spec.min_cores, spec.max_cores, self.cfg.levels)
            want = g.cores
        elif spec.kind == "gpu":
            # A level's batch is its cap or what is queued, whichever is smaller: compare
            # the batches the levels would really run (the smallest level on a tie).
            queued = 1 + len(led.batch_for(g.action))
            sizes = [min(c, queued) if c > 0 else c for c in
                     batch_levels(state.gpu.services[spec.service].max_batch, self.cfg.levels)]
            want = 1 + len(g.batch)
        else:
            sizes, want = [1] + [-1] * (self.cfg.levels - 1), 1
        best = min((abs(math.log(s) - math.log(want)), lv)
                   for lv, s in enumerate(sizes) if s > 0 and legal[lv]) if any(legal) else None
        return None if best is None else i * self.cfg.levels + best[1]

    # ------------------------------------------------------------------ observation

    def observe(self, state: ClusterState) -> dict[str, np.ndarray]:
        """The observation dict (including ``action_mask``) for ``state`` now."""
        cfg = self.cfg
        slots = self.slots(state)
        led = Ledger(state)
        t = state.t
        # Rows are filled in one flat Python list and converted once: a NumPy element
        # write costs several times a list's (a slot has F of them), and a flat list
        # converts several times faster than a list of rows.
        flat = [0.0] * (cfg.k_slots * F)
        L = cfg.levels
        mask = [False] * cfg.n_actions  # (a list: a slice write costs a NumPy array's ~10x)
        nc = self.node_cores
        gpu, api = state.gpu, state.api
        advice = self.advice(state)
        queued_by_service: dict[str, int] = {}
        if state.pending["gpu"]:
            for a in state.pending["gpu"].values():
                queued_by_service[a.spec.service] = queued_by_service.get(a.spec.service, 0) + 1
        fixed = self._fixed
        # cpu slots' legal levels by (min cores, max cores, room): slots mostly repeat them
        cpu_legal: dict[tuple[int, int, int], list[bool]] = {}
        any_room: int | None = None
        if len(fixed) > 64 * cfg.k_slots:  # rows of actions long gone: start again
            fixed.clear()
        for i, a in enumerate(slots):
            spec = a.spec
            known = fixed.get(a.id)
            if known is None or known[0] is not spec:
                known = fixed[a.id] = (spec, self._fixed_row(spec))
            o = i * F
            flat[o:o + F] = known[1]
            flat[o + 8] = math.log1p(t - a.submit_t)
            traj = a.traj
            if traj is not None:
                flat[o + 10] = math.log1p(traj.turn)
                flat[o + 11] = math.log1p(max(0.0, t - traj.start_t))
                flat[o + 12] = math.log1p(traj.act_s)
            room = None
            if spec.kind == "cpu":
                if a.node < 0 and traj is None:  # the freest node's room: the same for all
                    if any_room is None:
                        any_room = max(led.free, default=0)
                    room = any_room
                else:
                    _, room = led.cpu_room(a)
                flat[o + 13] = room / nc
                key = (spec.min_cores, spec.max_cores, room)
                legal = cpu_legal.get(key)
                if legal is None:
                    legal = cpu_legal[key] = self._legal_levels(state, led, a, room)
            elif spec.kind == "gpu":
                d = led.idle_device_for(spec.service)
                if d >= 0:
                    flat[o + 14] = float(spec.service in gpu.devices[d].resident)
                    flat[o + 15] = math.log1p(gpu.restore_cost(spec.service, d))
                queued = queued_by_service.get(spec.service, 0)
                flat[o + 16] = queued / gpu.services[spec.service].max_batch
            else:
                ep = api.endpoints[spec.endpoint]
                ep.refill(t)
                flat[o + 17] = ep.req / ep.spec.req_capacity
                flat[o + 18] = min(1.0, ep.tok / spec.tokens) if spec.tokens else 1.0
                flat[o + 19] = ep.in_flight / ep.spec.max_concurrency
            if room is None:
                legal = self._legal_levels(state, led, a)
            mask[i * L:(i + 1) * L] = legal
            flat[o + 20] = float(any(legal))
            if a.id in advice:
                flat[o + 21] = 1.0
                flat[o + 22] = advice[a.id]
        mask[-1] = True
        x = np.array(flat, dtype=np.float32)
        np.minimum(np.maximum(x, 0.0, out=x), OBS_HIGH, out=x)  # np.clip's, without its wrapper
        pools = self._pools(state)
        pools[-1] = float(self.advisor is not None and not advice)
        return {"slots": x, "backlog": self._backlog(state, slots).reshape(-1),
                "pools": np.minimum(np.maximum(pools, 0.0, out=pools), OBS_HIGH, out=pools),
                "action_mask": np.array(mask, dtype=np.int8)}

    def _fixed_row(self, spec: ActionSpec) -> list[float]:
        """A slot row with the features of ``spec`` alone filled in (the rest 0)."""
        nc = self.node_cores
        row = [0.0] * F
        row[0 if spec.kind == "cpu" else 1 if spec.kind == "gpu" else 2] = 1.0
        row[3] = math.log1p(spec.est_s)
        row[4] = math.log1p(spec.est_run_s(spec.max_cores))
        row[5] = spec.min_cores / nc
        row[6] = spec.max_cores / nc
        row[7] = spec.parallel_fraction
        row[9] = float(spec.reward)
        row[23] = 1.0  # present
        return row

    def _backlog(self, state: ClusterState, slots: list[Action]) -> np.ndarray:
        b = np.zeros((3, 3), dtype=np.float32)
        t = state.t
        for k, kind in enumerate(KIND_NAMES):
            pend = state.pending[kind]
            if len(pend) == 0:
                continue
            in_slots = {a.id for a in slots if a.spec.kind == kind}
            n = len(pend) - len(in_slots)
            if n == 0:
                continue
            work = state.pending_est_s[kind] - sum(a.spec.est_s for a in slots
                                                  if a.spec.kind == kind)
            oldest = 0.0
            for a in pend.values():  # submission order: the first not in a slot is oldest
                if a.id not in in_slots:
                    oldest = t - a.submit_t
                    break
            b[k] = (math.log1p(n), math.log1p(max(0.0, work)), math.log1p(oldest))
        return b

    def _pools(self, state: ClusterState) -> np.ndarray:
        cfg = self.cfg
        v = np.zeros(cfg.pool_size(), dtype=np.float32)
        cpu, gpu, api = state.cpu, state.gpu, state.api
        total = max(1, cpu.total)
        v[0] = cpu.busy / total
        v[1] = cpu.held / total
        o = 2
        for n in range(cpu.n_nodes):
            v[o + n] = cpu.free[n] / max(1, cpu.cores[n])
        o += cfg.max_nodes
        per_dev = 2 + cfg.max_services
        for d, dev in enumerate(gpu.devices):
            base = o + d * per_dev
            v[base] = float(dev.busy)
            v[base + 1] = dev.mem_used(gpu.services) / dev.mem_gb if dev.mem_gb else 0.0
            for s in dev.resident:
                v[base + 2 + self.service_index[s]] = 1.0
        o += cfg.max_devices * per_dev
        for e, name in enumerate(self.endpoint_names):
            ep = api.endpoints[name]
            ep.refill(state.t)
            v[o + 3 * e] = ep.req / ep.spec.req_capacity
            v[o + 3 * e + 1] = (ep.tok / ep.spec.tok_capacity) if ep.spec.tpm else 1.0
            v[o + 3 * e + 2] = ep.in_flight / ep.spec.max_concurrency
        o += cfg.max_endpoints * 3
        v[o] = state.step_done / state.step_total if state.step_total else 0.0
        v[o + 1] = math.log1p(max(0.0, state.t - state.step_start_t))
        v[o + 2] = math.log1p(state.n_pending)
        v[o + 3] = math.log1p(state.n_running)
        return v  # v[o + 4], advisor_waits, is filled by observe()
