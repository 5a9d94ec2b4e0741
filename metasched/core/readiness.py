"""Readiness: whether the scheduler can be asked now, and when to look again.

:class:`Readiness` is a mixin of :class:`~metasched.core.state.ClusterState` (which owns
the pools and the pending queue it reads): :meth:`~Readiness.decision_possible` is what
both clocks check before asking the scheduler (:mod:`metasched.core.decision`), and
:meth:`~Readiness.api_wakeups` tells a clock when an API quota lets a waiting call in.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from metasched.core.actions import Action
    from metasched.core.pools import ApiPool, CpuPool, GpuPool


class Readiness:
    """When a decision is possible (a mixin of ``ClusterState``)."""

    t: float
    cpu: CpuPool
    gpu: GpuPool
    api: ApiPool
    pending: dict[str, dict[int, Action]]

    def api_feasible(self, a: Action) -> bool:
        """Whether api call ``a`` fits its endpoint's concurrency and quota now."""
        return self.api.endpoints[a.spec.endpoint].can_start(a.spec.tokens, self.t)

    def decision_possible(self) -> bool:
        """Whether any pending action could be granted now (the scheduler is asked only
        then)."""
        p = self.pending
        if p["cpu"]:
            cpu = self.cpu
            free = cpu.free
            # Nothing can start while no node has a free core and no held core is idle.
            # The largest free count is found only when an action needs it: it is a pass
            # over every node (10^3-10^4), and most actions are bound to their sandbox's
            # node, whose free cores decide alone.
            held_idle = cpu.held > cpu.held_busy
            most = -1
            for a in p["cpu"].values():  # cpu_feasible, inlined: queues run long
                traj = a.traj
                need = a.spec.min_cores - (traj.held_cores if traj is not None else 0)
                if a.node >= 0:
                    if need > free[a.node]:
                        continue
                    if need > 0 or held_idle:
                        return True  # its node has a free core
                elif most >= 0 and need > most:
                    continue
                if most < 0:
                    most = max(free, default=0)
                    if most <= 0 and not held_idle:
                        break  # no free core anywhere: no cpu action can start
                if a.node >= 0 or need <= most:
                    return True
        if p["gpu"] and any(not d.busy for d in self.gpu.devices):
            return True
        if p["api"]:
            seen = set()
            for a in p["api"].values():
                ep = a.spec.endpoint
                if ep in seen:
                    continue
                if self.api_feasible(a):
                    return True
                if self.api.endpoints[ep].in_flight >= self.api.endpoints[ep].spec.max_concurrency:
                    seen.add(ep)
        return False

    def api_wakeups(self) -> dict[str, float]:
        """For each endpoint whose waiting calls wait only for tokens: seconds until its
        smallest waiting call fits the quota window (the clock must look again then)."""
        smallest: dict[str, int] = {}
        for a in self.pending["api"].values():
            ep = a.spec.endpoint
            if ep not in smallest or a.spec.tokens < smallest[ep]:
                smallest[ep] = a.spec.tokens
        out: dict[str, float] = {}
        for name, tokens in smallest.items():
            ep = self.api.endpoints[name]
            if ep.in_flight >= ep.spec.max_concurrency:
                continue  # a call ending will be the next event
            wait = ep.ready_in(tokens, self.t)
            if 0 < wait < math.inf:
                out[name] = wait
        return out
