"""``rate_greedy``: ``elastic_greedy``'s elastic CPU grants with rules, from estimates
alone, that serve the most requests per second of the binding resource.

GPU: each idle device serves the service, and the batch, with the most requests served
per second of device time, ``b / (setup + batch time)``:

- a batch is the ``b`` shortest queued requests of a service (one long request makes a
  whole batch as slow as itself), ``b`` chosen to maximise that rate;
- the setup of a service not resident on the device is its restore, plus the restore of
  every service it would evict (least recently used first, as the pool evicts) that is
  resident nowhere else and still in demand (queued requests, or used within
  ``recent_s``): demand will bring it straight back;
- such an evicting restore waits while the evicting service's queue is young (ski
  rental): until its requests have waited, summed, ``defer`` times that setup, unless
  the cluster is idle (a wait then only delays everything);
- a service resident on a busy device that should free up sooner than a restore is
  waited for (as ``elastic_greedy``).

API, per endpoint: the call using the least quota first; among equals, the call of the
trajectory that has come furthest (most turns submitted), then the shortest estimate.

CPU, per node: ``elastic_greedy``'s grants (minimum cores for everything that fits, spare
cores to the largest estimated Amdahl saving above a headroom) in the order shortest
estimate first, less ``progress_s`` seconds per turn the trajectory has come. With
``endgame`` > 0, once that fraction of a step's trajectories is left, the trajectories
furthest behind (fewest turns) go first: the step ends with its slowest trajectory.
``rate_greedy_step`` (``endgame=1``) takes ``estimates: predictor``: its endgame order is
then the most predicted remaining time first (the learned predictor's median,
:mod:`.predicted`); ``rate_greedy_step_predicted`` names it so configured.
"""

from __future__ import annotations

import math

from metasched.agents.elastic import ElasticGreedyScheduler, _quota_s
from metasched.agents.predicted import (
    check_estimates,
    predicted_remaining_s,
    require_predictor,
)
from metasched.core.actions import Action, Grant
from metasched.core.guard import WaitGuard
from metasched.core.ledger import Ledger
from metasched.core.pools import Device, EndpointSpec, ServiceSpec
from metasched.core.state import ClusterState


def best_prefix(queue: list[Action], svc: ServiceSpec, setup_s: float) -> tuple[int, float]:
    """(b, batch seconds) of the prefix of ``queue`` (sorted shortest estimate first)
    that serves the most requests per second of device time, ``b / (setup_s + batch s)``."""
    best_b, best_t, best_rate = 0, 0.0, -1.0
    for b in range(1, min(svc.max_batch, len(queue)) + 1):
        t = queue[b - 1].spec.est_s * (1.0 + svc.batch_marginal * (b - 1))
        rate = b / (setup_s + t) if setup_s + t > 0 else math.inf
        if rate > best_rate:
            best_b, best_t, best_rate = b, t, rate
    return best_b, best_t


def _turns(a: Action) -> int:
    return a.traj.turn if a.traj is not None else 0


class RateGreedyScheduler(ElasticGreedyScheduler):
    """Throughput-per-resource-second rules for GPU and API, progress-aware CPU order.

    Args:
        headroom, min_gain_s: as ``elastic_greedy`` (spare CPU cores).
        recent_s: a GPU service used within this many seconds is in demand: evicting it
            is charged its restore.
        defer: an evicting restore waits until its service's queued requests have waited,
            summed, this many times the restore seconds it costs (0: never waits).
        progress_s: CPU order credit, in estimated seconds, per turn the action's
            trajectory has submitted.
        endgame: fraction of a step's trajectories left at which CPU actions go in order
            of fewest turns first (0: never).
    """

    name = "rate_greedy"

    def __init__(self, headroom: float = 0.25, min_gain_s: float = 0.0, recent_s: float = 30.0,
                 defer: float = 8.0, progress_s: float = 0.5, endgame: float = 0.0) -> None:
        super().__init__(headroom=headroom, min_gain_s=min_gain_s)
        for name, v in (("recent_s", recent_s), ("defer", defer), ("progress_s", progress_s)):
            if not v >= 0:
                raise ValueError(f"{name} must be >= 0 (got {v})")
        if not 0.0 <= endgame <= 1.0:
            raise ValueError(f"endgame must be in [0, 1] (got {endgame})")
        self.recent_s = recent_s
        self.defer = defer
        self.progress_s = progress_s
        self.endgame = endgame
        self._late = False

    def reset(self, state: ClusterState, rng) -> None:
        super().reset(state, rng)
        self._late = False

    # ------------------------------------------------------------------ cpu

    def _sync(self, state: ClusterState) -> None:
        if self._arrivals.state is not state:
            self._late = False
        super()._sync(state)
        late = (self.endgame > 0 and state.step_total > 0
                and state.step_total - state.step_done <= self.endgame * state.step_total)
        if late != self._late:  # the step entered (or left) its end: re-key the cpu queues
            self._late = late
            self._requeue_cpu(state, self._cpu_key)

    def _cpu_key(self, a: Action) -> tuple:
        s = a.spec
        est = s.est_s / s.speedup(s.max_cores)
        if self._late:
            return (_turns(a), est, a.id)
        return (0, est - self.progress_s * _turns(a), a.id)

    # ------------------------------------------------------------------ api

    def _api_key(self, ep: EndpointSpec, a: Action) -> tuple:
        return (_quota_s(ep, a), -_turns(a), a.spec.est_s, a.id)

    # ------------------------------------------------------------------ gpu

    def _gpu(self, state: ClusterState, led: Ledger, grants: list[Grant]) -> None:
        gpu = state.gpu
        t = state.t
        queues: dict[str, list[Action]] = {}
        for a in state.pending["gpu"].values():
            queues.setdefault(a.spec.service, []).append(a)
        for q in queues.values():
            q.sort(key=lambda a: (a.spec.est_s, a.id))
        # Devices running (or granted in this call) -> when they should free up.
        free_at = {d.index: d.est_free_t for d in gpu.devices if d.busy}
        idle = WaitGuard.idle(state)
        while led.idle:
            best = None  # (rate, device, service, batch size, device seconds)
            for s, q in queues.items():
                if not q:
                    continue
                svc = gpu.services[s]
                soonest = min((f for d, f in free_at.items() if s in gpu.devices[d].resident),
                              default=math.inf)
                waited = None
                for d in led.idle:
                    dev = gpu.devices[d]
                    if svc.mem_gb > dev.mem_gb:
                        continue
                    if s in dev.resident:
                        setup = 0.0
                    else:
                        if soonest - t <= svc.restore_s:
                            continue  # cheaper to wait for the resident copy
                        evict = self._eviction_cost(state, dev, s, queues)
                        setup = svc.restore_s + evict
                        if evict > 0 and self.defer > 0 and not idle:
                            if waited is None:
                                waited = sum(t - a.submit_t for a in q)
                            if waited < self.defer * setup:
                                continue  # rent a little longer before buying the restore
                    b, batch_s = best_prefix(q, svc, setup)
                    rate = b / (setup + batch_s) if setup + batch_s > 0 else math.inf
                    if best is None or rate > best[0]:
                        best = (rate, d, s, b, setup + batch_s)
            if best is None:
                return
            _, d, s, b, busy_s = best
            batch = queues[s][:b]
            del queues[s][:b]
            grants.append(led.take_gpu(batch[0], d, tuple(batch[1:])))
            free_at[d] = t + busy_s

    def _eviction_cost(self, state: ClusterState, dev: Device, service: str,
                       queues: dict[str, list[Action]]) -> float:
        """Restore seconds that demand will bring back if ``service`` is made resident on
        ``dev`` (the pool evicts least recently used services first)."""
        gpu = state.gpu
        cost = 0.0
        for victim in gpu.victims(service, dev.index):
            if any(victim in o.resident for o in gpu.devices if o is not dev):
                continue  # still served elsewhere
            if queues.get(victim) or state.t - dev.resident[victim] <= self.recent_s:
                cost += gpu.services[victim].restore_s
        return cost


class RateGreedyStepScheduler(RateGreedyScheduler):
    """``rate_greedy`` with its endgame tuned for the step: the trajectories furthest
    behind (fewest turns) go first on CPU once ``endgame`` of a step's trajectories is
    left (see ``benchmarks/RESULTS.md`` for the sweep that chose the default)."""

    name = "rate_greedy_step"

    def __init__(self, headroom: float = 0.25, min_gain_s: float = 0.0, recent_s: float = 30.0,
                 defer: float = 8.0, progress_s: float = 0.5, endgame: float = 1.0,
                 estimates: str = "given") -> None:
        super().__init__(headroom=headroom, min_gain_s=min_gain_s, recent_s=recent_s,
                         defer=defer, progress_s=progress_s, endgame=endgame)
        self.estimates = check_estimates(estimates)
        self._state: ClusterState | None = None

    def reset(self, state: ClusterState, rng) -> None:
        require_predictor(state, self.estimates)
        super().reset(state, rng)

    def _sync(self, state: ClusterState) -> None:
        self._state = state
        super()._sync(state)

    def _cpu_key(self, a: Action) -> tuple:
        if self._late and self.estimates == "predictor":  # most predicted remaining first
            return (-predicted_remaining_s(self._state, a), a.id)
        return super()._cpu_key(a)


class RateGreedyStepPredictedScheduler(RateGreedyStepScheduler):
    """``rate_greedy_step`` with ``estimates: predictor``: in the endgame, the
    trajectories with the most predicted remaining time go first on CPU."""

    name = "rate_greedy_step_predicted"

    def __init__(self, headroom: float = 0.25, min_gain_s: float = 0.0, recent_s: float = 30.0,
                 defer: float = 8.0, progress_s: float = 0.5, endgame: float = 1.0,
                 estimates: str = "predictor") -> None:
        super().__init__(headroom, min_gain_s, recent_s, defer, progress_s, endgame, estimates)
