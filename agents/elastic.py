"""``elastic_greedy``: the strongest hand-written action-level scheduler here, in the
spirit of ARL-Tangram: shared pools, elastic core counts, GPU-residency awareness,
quota awareness.

CPU, per node: shortest estimated job first; every action that fits gets its minimum
cores; when nothing is left waiting, spare cores go to the actions whose estimated run
time they cut most (Amdahl marginal gain), keeping a headroom for actions that the
node's other trajectories may submit meanwhile.

GPU: requests are served by service, oldest first, as batches; a resident service is
preferred; a service resident on a busy device is waited for when that device should
free up sooner than a restore elsewhere would take; restores evict the services with
the least queued work.

API: the call using the least quota first (shortest estimated call among equals),
whenever the endpoint's RPM/TPM quotas and concurrency allow.
"""

from __future__ import annotations

import heapq
import math

from metasched.agents.pending_queue import Arrivals, PendingQueue
from metasched.core.actions import Action, Grant
from metasched.core.ledger import Ledger
from metasched.core.pools import EndpointSpec
from metasched.core.scheduler import Scheduler
from metasched.core.state import ClusterState


def _sjf_key(a: Action) -> tuple[float, int]:
    return (a.spec.est_s / a.spec.speedup(a.spec.max_cores), a.id)


def _quota_s(ep: EndpointSpec, a: Action) -> float:
    """Seconds of the endpoint's quota a call uses: its request or its tokens,
    whichever of the two quotas it uses the larger share of."""
    req = 60.0 / ep.rpm
    return req if ep.tpm is None else max(req, 60.0 * a.spec.tokens / ep.tpm)


class _NodeFree(dict):
    """Free cores of the nodes looked at, read from the pool on first use: a decision
    touches a few nodes of thousands, so it copies only those."""

    __slots__ = ("pool_free",)

    def __init__(self, pool_free: list[int]) -> None:
        super().__init__()
        self.pool_free = pool_free

    def __missing__(self, node: int) -> int:
        v = self[node] = self.pool_free[node]
        return v

    def merged_into(self, full: list[int]) -> list[int]:
        """``full`` (every node's free cores) with the changes made here."""
        for node, v in self.items():
            full[node] = v
        return full


class ElasticGreedyScheduler(Scheduler):
    """Elastic, residency- and quota-aware greedy scheduling.

    Args:
        headroom: most of a node's cores (fraction) kept free for arrivals when
            handing out extra cores; at most one core per live sandbox on the node is kept.
        min_gain_s: an extra core is granted only if it cuts the estimated run time by
            more than this many seconds. 0 (the default) hands out every spare core above
            the headroom that shortens some run: spare cores cost nothing, and estimates
            can be far off (measured: 0.05 s left coding 1% slower).
    """

    name = "elastic_greedy"

    def __init__(self, headroom: float = 0.25, min_gain_s: float = 0.0) -> None:
        if not 0.0 <= headroom <= 1.0:
            raise ValueError(f"headroom must be in [0, 1] (got {headroom})")
        self.headroom = headroom
        self.min_gain_s = min_gain_s
        self._arrivals = Arrivals()

    def reset(self, state: ClusterState, rng) -> None:
        self._arrivals = Arrivals()

    def _sync(self, state: ClusterState) -> None:
        """Queue the actions submitted since the last decision."""
        if self._arrivals.new_run(state):  # a new run: start over
            self._cpu_q: dict[int, PendingQueue] = {}  # by the node an action must run on
            # Nodes whose queue holds entries: a decision visits these, not every node of
            # the cluster (10^3-10^4 nodes, few of them with anything queued at a time).
            self._cpu_busy: set[int] = set()
            self._api_q: dict[str, PendingQueue] = {}  # by endpoint
        for a in self._arrivals.new(state, "cpu"):
            self._cpu_q.setdefault(a.node, PendingQueue()).push(self._cpu_key(a), a)
            self._cpu_busy.add(a.node)
        eps = state.api.endpoints
        for a in self._arrivals.new(state, "api"):
            key = self._api_key(eps[a.spec.endpoint].spec, a)
            self._api_q.setdefault(a.spec.endpoint, PendingQueue()).push(key, a)

    def _requeue_cpu(self, state: ClusterState, key) -> None:
        """Rebuild the per-node CPU queues of every pending CPU action under ``key`` (an
        order that changed for what is already queued)."""
        self._cpu_q = {}
        for a in state.pending["cpu"].values():
            self._cpu_q.setdefault(a.node, PendingQueue()).push(key(a), a)
        self._cpu_busy = set(self._cpu_q)

    def _cpu_key(self, a: Action) -> tuple:
        """Priority of a CPU action among those bound for its node (smallest first): the
        shortest estimated run at its maximum cores."""
        return _sjf_key(a)

    def _api_key(self, ep: EndpointSpec, a: Action) -> tuple:
        """Priority of an API call on its endpoint (smallest first): least quota, then
        the shortest estimated call."""
        return (_quota_s(ep, a), _sjf_key(a))

    def decide(self, state: ClusterState) -> list[Grant]:
        self._sync(state)
        led = Ledger(state)
        grants: list[Grant] = []
        if state.pending["cpu"]:
            self._cpu(state, led, grants)
        if state.pending["gpu"] and led.idle:
            self._gpu(state, led, grants)
        pending = state.pending["api"]
        if pending:
            # Least quota first (shortest estimated call among equals), per endpoint; an
            # endpoint is left once no call at all can start on it.
            planned: list[tuple[tuple, Grant]] = []
            for name, q in self._api_q.items():
                ep = state.api.endpoints[name]
                for key, a in q.scan_keyed(pending):
                    if led.api_ok(a):
                        planned.append((key, led.take_api(a)))
                    elif not led.api_room(ep):
                        break
            planned.sort(key=lambda kg: kg[0])
            grants.extend(g for _, g in planned)
        return grants

    # ------------------------------------------------------------------ cpu

    def _cpu(self, state: ClusterState, led: Ledger, grants: list[Grant]) -> None:
        cpu = state.cpu
        # Free cores after the planned grants, of the nodes visited only (sandbox-bound
        # actions); the ledger's copy of every node is taken once an action may go to
        # any node.
        free: _NodeFree | list[int] = _NodeFree(cpu.free)
        pending = state.pending["cpu"]
        # Sandbox nodes first (each uses only its own cores), then actions free to go
        # to the node with the most free cores.
        order = sorted(self._cpu_busy)  # ints compared in C: no key function per node
        if order and order[0] < 0:  # -1 (any node) sorts first: move it last
            order.append(order.pop(0))
        for node in order:
            q = self._cpu_q[node]
            if not q.heap:
                self._cpu_busy.discard(node)  # its last entries were dropped when met
                continue
            chosen: list[tuple[Action, int]] = []
            waiting = False
            for _, a in q.scan_keyed(pending):  # shortest job first
                n = node
                if n < 0:
                    if isinstance(free, _NodeFree):
                        free = free.merged_into(led.free)
                    n = max(range(len(free)), key=free.__getitem__)
                if free[n] >= a.spec.min_cores:
                    free[n] -= a.spec.min_cores
                    chosen.append((a, n))
                else:
                    waiting = True
                    if free[n] == 0:
                        break  # nothing else can fit either
            if not chosen:
                continue
            extra = [0] * len(chosen)
            if not waiting and node >= 0:
                keep = min(math.ceil(self.headroom * cpu.cores[node]),
                           max(0, cpu.sandboxes[node] - len(chosen)))
                self._spread(chosen, extra, free[node] - keep)
                free[node] -= sum(extra)
            for (a, n), x in zip(chosen, extra, strict=True):
                grants.append(Grant(a, cores=a.spec.min_cores + x, node=n))

    def _spread(self, chosen: list[tuple[Action, int]], extra: list[int], spare: int) -> None:
        """Give ``spare`` cores one at a time to the largest estimated time saving."""
        if spare <= 0:
            return
        heap = []
        for i, (a, _) in enumerate(chosen):
            s = a.spec
            if s.max_cores > s.min_cores and s.parallel_fraction > 0:
                k = s.min_cores
                heap.append((-s.est_s * s.parallel_fraction * (1 / k - 1 / (k + 1)), i))
        heapq.heapify(heap)
        while spare > 0 and heap:
            neg_gain, i = heapq.heappop(heap)
            if -neg_gain < self.min_gain_s:
                break
            extra[i] += 1
            spare -= 1
            s = chosen[i][0].spec
            k = s.min_cores + extra[i]
            if k < s.max_cores:
                heapq.heappush(heap, (-s.est_s * s.parallel_fraction * (1 / k - 1 / (k + 1)), i))

    # ------------------------------------------------------------------ gpu

    def _gpu(self, state: ClusterState, led: Ledger, grants: list[Grant]) -> None:
        gpu = state.gpu
        t = state.t
        planned: dict[int, float] = {}  # devices granted in this call -> estimated free time
        queues: dict[str, list[Action]] = {}
        for a in state.pending["gpu"].values():
            queues.setdefault(a.spec.service, []).append(a)
        # Oldest waiting request first, across services.
        for svc_name in sorted(queues, key=lambda s: queues[s][0].submit_t):
            q = queues[svc_name]
            svc = gpu.services[svc_name]
            while q and led.idle:
                resident_idle = [d for d in led.idle if svc_name in gpu.devices[d].resident]
                if resident_idle:
                    device = resident_idle[0]
                else:
                    busy_res = [d for d in range(gpu.total)
                                if d not in led.idle and svc_name in gpu.devices[d].resident]
                    soonest = min((planned.get(d, gpu.devices[d].est_free_t) for d in busy_res),
                                  default=None)
                    if soonest is not None and soonest - t <= svc.restore_s:
                        break  # cheaper to wait for the resident copy
                    device = self._restore_target(state, led, svc_name, queues)
                    if device < 0:
                        break
                batch = q[: svc.max_batch]
                del q[: svc.max_batch]
                planned[device] = (t + gpu.restore_cost(svc_name, device)
                                   + svc.batch_s([b.spec.est_s for b in batch]))
                grants.append(led.take_gpu(batch[0], device, tuple(batch[1:])))

    def _restore_target(self, state: ClusterState, led: Ledger, service: str,
                        queues: dict[str, list[Action]]) -> int:
        """The idle device where making ``service`` resident evicts the least queued work."""
        gpu = state.gpu
        need = gpu.services[service].mem_gb
        best, best_key = -1, None
        for d in led.idle:
            dev = gpu.devices[d]
            if need > dev.mem_gb:
                continue
            damage = sum(sum(b.spec.est_s for b in queues.get(victim, ())) + 1e-3
                         for victim in gpu.victims(service, d))
            key = (damage, d)
            if best_key is None or key < best_key:
                best, best_key = d, key
        return best
