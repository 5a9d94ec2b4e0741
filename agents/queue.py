"""Action-level queue disciplines on shared pools: ``fifo``, ``sjf`` and ``random``.

Each grants an action its minimum cores (one core for single-threaded actions), runs
a GPU request on an idle device (preferring one where its service is resident) with
the other queued requests to that service as a batch, and starts API calls whenever
the endpoint's quota allows.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from metasched.agents.pending_queue import Arrivals, PendingQueue
from metasched.core.actions import Action, Grant
from metasched.core.ledger import Ledger
from metasched.core.scheduler import Scheduler
from metasched.core.state import ClusterState


class FifoScheduler(Scheduler):
    """First come, first served (skipping actions that do not fit, so no head-of-line
    blocking across nodes and pools)."""

    name = "fifo"

    def order(self, state: ClusterState, kind: str) -> Iterable[Action]:
        """The order in which pending actions of ``kind`` are considered."""
        return state.pending[kind].values()

    def cores(self, a: Action, room: int) -> int:
        return a.spec.min_cores

    def decide(self, state: ClusterState) -> list[Grant]:
        led = Ledger(state)
        grants: list[Grant] = []
        pending = state.pending
        free = led.free
        holds = state.cpu.held > 0  # a held core can start its trajectory's action anywhere
        if pending["cpu"] and (max(free, default=0) > 0 or holds):
            for a in self.order(state, "cpu"):
                node, room = led.cpu_room(a)
                if room >= a.spec.min_cores:
                    grants.append(led.take_cpu(a, node, self.cores(a, room)))
                    if not holds and max(free) == 0:
                        break  # nothing else can start
        if pending["gpu"] and led.idle:
            for a in self.order(state, "gpu"):
                if a.id in led.batched:
                    continue
                device = self.device(led, a)
                if device < 0:
                    break
                grants.append(led.take_gpu(a, device, led.batch_for(a)))
                if not led.idle:
                    break
        if pending["api"]:
            eps = state.api.endpoints
            closed: set[str] = set()  # endpoints where no call at all can start
            for a in self.order(state, "api"):
                name = a.spec.endpoint
                if name in closed:
                    continue
                if led.api_ok(a):
                    grants.append(led.take_api(a))
                elif not led.api_room(eps[name]):
                    closed.add(name)
                    if len(closed) == len(eps):
                        break
        return grants

    def device(self, led: Ledger, a: Action) -> int:
        return led.idle_device_for(a.spec.service)


def sjf_key(a: Action) -> tuple[float, int]:
    """Shortest estimated run time at the minimum allocation first, then oldest."""
    return (a.spec.est_run_s(a.spec.min_cores), a.id)


class SjfScheduler(FifoScheduler):
    """Shortest estimated job first (on the scheduler-visible estimate)."""

    name = "sjf"

    def __init__(self) -> None:
        self._arrivals = Arrivals()

    def reset(self, state: ClusterState, rng: np.random.Generator) -> None:
        self._arrivals = Arrivals()

    def order(self, state: ClusterState, kind: str) -> Iterable[Action]:
        if self._arrivals.new_run(state):
            self._queues = {k: PendingQueue() for k in state.pending}
        q = self._queues[kind]
        for a in self._arrivals.new(state, kind):
            q.push(sjf_key(a), a)
        return q.scan(state.pending[kind])


class RandomScheduler(FifoScheduler):
    """A sanity floor: random order, random core counts, random devices."""

    name = "random"

    def reset(self, state: ClusterState, rng: np.random.Generator) -> None:
        self.rng = rng

    def order(self, state: ClusterState, kind: str) -> Iterable[Action]:
        acts = list(state.pending[kind].values())
        return [acts[i] for i in self.rng.permutation(len(acts))]

    def cores(self, a: Action, room: int) -> int:
        hi = min(a.spec.max_cores, room)
        return int(self.rng.integers(a.spec.min_cores, hi + 1))

    def device(self, led: Ledger, a: Action) -> int:
        fits = [d for d in led.idle if led.state.gpu.fits(a.spec.service, d)]
        return int(fits[self.rng.integers(len(fits))]) if fits else -1
