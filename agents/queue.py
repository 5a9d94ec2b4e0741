"""Action-level queue disciplines on shared pools: ``fifo``, ``sjf`` and ``random``.

Each grants an action its minimum cores (one core for single-threaded actions), runs
a GPU request on an idle device (preferring one where its service is resident) with
the other queued requests to that service as a batch, and starts API calls whenever
the endpoint's quota allows.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from metasched.core.actions import Action, Grant
from metasched.core.ledger import Ledger
from metasched.core.scheduler import Scheduler
from metasched.core.state import ClusterState


class FifoScheduler(Scheduler):
    """First come, first served (skipping actions that do not fit, so no head-of-line
    blocking across nodes and pools)."""

    name = "fifo"

    def order(self, actions: Iterable[Action]) -> Iterable[Action]:
        """The order in which pending actions are considered."""
        return actions

    def cores(self, a: Action, room: int) -> int:
        return a.spec.min_cores

    def decide(self, state: ClusterState) -> list[Grant]:
        led = Ledger(state)
        grants: list[Grant] = []
        pending = state.pending
        if pending["cpu"] and (max(led.free, default=0) > 0 or state.cpu.held):
            for a in self.order(pending["cpu"].values()):
                node, room = led.cpu_room(a)
                if room >= a.spec.min_cores:
                    grants.append(led.take_cpu(a, node, self.cores(a, room)))
        if pending["gpu"] and led.idle:
            for a in self.order(pending["gpu"].values()):
                if a.id in led.batched:
                    continue
                device = self.device(led, a)
                if device < 0:
                    break
                grants.append(led.take_gpu(a, device, led.batch_for(a)))
                if not led.idle:
                    break
        if pending["api"]:
            for a in self.order(pending["api"].values()):
                if led.api_ok(a):
                    grants.append(led.take_api(a))
        return grants

    def device(self, led: Ledger, a: Action) -> int:
        return led.idle_device_for(a.spec.service)


class SjfScheduler(FifoScheduler):
    """Shortest estimated job first (on the scheduler-visible estimate)."""

    name = "sjf"

    def order(self, actions: Iterable[Action]) -> Iterable[Action]:
        return sorted(actions, key=lambda a: (a.spec.est_run_s(a.spec.min_cores), a.id))


class RandomScheduler(FifoScheduler):
    """A sanity floor: random order, random core counts, random devices."""

    name = "random"

    def reset(self, state: ClusterState, rng: np.random.Generator) -> None:
        self.rng = rng

    def order(self, actions: Iterable[Action]) -> Iterable[Action]:
        acts = list(actions)
        return [acts[i] for i in self.rng.permutation(len(acts))]

    def cores(self, a: Action, room: int) -> int:
        hi = min(a.spec.max_cores, room)
        return int(self.rng.integers(a.spec.min_cores, hi + 1))

    def device(self, led: Ledger, a: Action) -> int:
        fits = [d for d in led.idle if led.state.gpu.fits(a.spec.service, d)]
        return int(fits[self.rng.integers(len(fits))]) if fits else -1
