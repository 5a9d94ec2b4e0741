"""Tentative resource accounting while planning several grants at one instant.

A scheduler that returns several grants at once must not hand the same core, device
or API slot out twice; the ledger tracks what the grants planned so far will use.
"""

from __future__ import annotations

from metasched.core.actions import Action, Grant
from metasched.core.state import ClusterState


class Ledger:
    """Free resources as they will be after the grants planned so far."""

    def __init__(self, state: ClusterState) -> None:
        self.state = state
        self._free: list[int] | None = None
        self.idle = [d.index for d in state.gpu.devices if not d.busy]
        self.batched: set[int] = set()
        self._api: dict[str, list[float]] = {}

    @property
    def free(self) -> list[int]:
        """Free cores per node after the planned grants. Copied from the pool when first
        read: a ledger is made at every decision, and a copy is a pass over every node."""
        if self._free is None:
            self._free = list(self.state.cpu.free)
        return self._free

    # cpu
    def cpu_room(self, a: Action) -> tuple[int, int]:
        """(node, cores ``a`` could get now): its sandbox node, or the freest node."""
        held = a.traj.held_cores if a.traj is not None else 0
        node = a.node
        free = self.free
        if node < 0:
            if not free:
                return -1, 0
            node = free.index(max(free))  # the first freest (a pass in C: asked per slot)
        return node, free[node] + held

    def take_cpu(self, a: Action, node: int, cores: int, hold: int = 0) -> Grant:
        held = a.traj.held_cores if a.traj is not None else 0
        new_held = max(held, hold)
        self.free[node] -= new_held - held + max(0, cores - new_held)
        return Grant(a, cores=cores, node=node, hold=hold)

    # gpu
    def idle_device_for(self, service: str, devices: list[int] | None = None) -> int:
        """An idle device (among ``devices``), preferring one where ``service`` is
        resident, then one with room for it without eviction; -1 if none is idle."""
        gpu = self.state.gpu
        cands = self.idle if devices is None else [d for d in self.idle if d in devices]
        if not cands:
            return -1
        need = gpu.services[service].mem_gb

        def key(d: int) -> tuple[bool, bool, int]:
            dev = gpu.devices[d]
            return (service not in dev.resident,
                    dev.mem_used(gpu.services) + need > dev.mem_gb, d)

        return min(cands, key=key)

    def batch_for(self, a: Action, limit: int | None = None) -> tuple[Action, ...]:
        """Other pending requests to ``a``'s service, oldest first, to fill a batch."""
        svc = self.state.gpu.services[a.spec.service]
        room = (svc.max_batch if limit is None else min(limit, svc.max_batch)) - 1
        out = []
        if room > 0:
            for b in self.state.pending["gpu"].values():
                if len(out) >= room:
                    break
                if b is not a and b.spec.service == a.spec.service and b.id not in self.batched:
                    out.append(b)
        return tuple(out)

    def take_gpu(self, a: Action, device: int, batch: tuple[Action, ...] = ()) -> Grant:
        self.idle.remove(device)
        self.batched.add(a.id)
        self.batched.update(b.id for b in batch)
        return Grant(a, device=device, batch=batch)

    # api
    def api_ok(self, a: Action) -> bool:
        """Whether ``a`` can start after the planned calls."""
        ep = self.state.api.endpoints[a.spec.endpoint]
        ep.refill(self.state.t)
        calls, tokens = self._api.get(ep.name, (0, 0))
        return (ep.in_flight + calls < ep.spec.max_concurrency and ep.req - calls >= 1.0
                and ep.tok - tokens >= a.spec.tokens)

    def api_room(self, ep) -> bool:
        """Whether endpoint ``ep`` could start any call after the planned ones (a free
        concurrency slot and a request token; tokens aside)."""
        calls = self._api.get(ep.name, (0, 0))[0]
        return ep.in_flight + calls < ep.spec.max_concurrency and ep.req - calls >= 1.0

    def default_grant(self, a: Action) -> Grant | None:
        """The plainest legal grant for ``a`` (minimum cores; an idle device, resident
        first, with a batch of queued same-service requests; the API call), or None."""
        kind = a.spec.kind
        if kind == "cpu":
            node, room = self.cpu_room(a)
            return self.take_cpu(a, node, a.spec.min_cores) if room >= a.spec.min_cores else None
        if kind == "gpu":
            if a.id in self.batched:
                return None
            device = self.idle_device_for(a.spec.service)
            return None if device < 0 else self.take_gpu(a, device, self.batch_for(a))
        return self.take_api(a) if self.api_ok(a) else None

    def take_api(self, a: Action) -> Grant:
        c = self._api.setdefault(a.spec.endpoint, [0, 0])
        c[0] += 1
        c[1] += a.spec.tokens
        return Grant(a)
