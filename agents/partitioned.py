"""Today's practice: resources bound to trajectories or partitioned per task.

``static``: every trajectory reserves a sandbox of ``cores_per_sandbox`` cores for its
whole life (idle while its LLM generates); each GPU reward model runs on devices fixed
to its task; API calls pass fixed per-tool semaphores.

``task_isolated``: action-level grants, but every pool is partitioned per task in
proportion to the task's expected work, first come first served inside a partition.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from metasched.core.actions import Action, Grant
from metasched.core.ledger import Ledger
from metasched.core.scheduler import Scheduler
from metasched.core.state import ClusterState, api_key
from metasched.sim.sampling import split_counts


def partition(units: int, demand: dict[str, float]) -> dict[str, int]:
    """Split ``units`` among tasks by demand; every task gets at least one unit while
    units last (tasks sorted by name for determinism)."""
    tasks = sorted(t for t, d in demand.items() if d > 0)
    if not tasks or units <= 0:
        return {}
    if units < len(tasks):
        return {t: int(i < units) for i, t in enumerate(tasks)}
    counts = split_counts([demand[t] for t in tasks], units - len(tasks))
    return {t: c + 1 for t, c in zip(tasks, counts, strict=True)}


class PartitionedScheduler(Scheduler):
    """Shared machinery: per-task GPU device sets and per-(endpoint, task) API slots."""

    def __init__(self, api_semaphore: int | None = None) -> None:
        self.api_semaphore = api_semaphore

    def reset(self, state: ClusterState, rng: np.random.Generator) -> None:
        demand = state.task_demand
        # GPU: devices per task, then each task's services pinned round-robin to them.
        n_dev = partition(state.gpu.total, demand["gpu"])
        self.devices: dict[str, list[int]] = {}
        start = 0
        for task, n in n_dev.items():
            self.devices[task] = list(range(start, start + n)) if n else []
            start += n
            for d in self.devices[task]:
                state.reserve_device(d, task)
        for task in demand["gpu"]:
            if not self.devices.get(task):  # fewer devices than tasks: share them all
                self.devices[task] = list(range(state.gpu.total))
        # API: each endpoint's concurrency split among the tasks that call it.
        self.slots: dict[tuple[str, str], int] = {}
        for ep, e in state.api.endpoints.items():
            share = partition(e.spec.max_concurrency, demand.get(api_key(ep), {}))
            for task, n in share.items():
                if self.api_semaphore is not None:
                    n = min(n, self.api_semaphore)
                self.slots[(ep, task)] = n
                state.reserve(api_key(ep), task, n)

    def gpu_grants(self, state: ClusterState, led: Ledger, grants: list[Grant]) -> None:
        for a in state.pending["gpu"].values():
            if not led.idle:
                return
            if a.id in led.batched:
                continue
            device = self.gpu_device(state, led, a)
            if device >= 0:
                grants.append(led.take_gpu(a, device, led.batch_for(a)))

    def gpu_device(self, state: ClusterState, led: Ledger, a: Action) -> int:
        return led.idle_device_for(a.spec.service, self.devices.get(a.task))

    def api_grants(self, state: ClusterState, led: Ledger, grants: list[Grant]) -> None:
        planned: dict[tuple[str, str], int] = defaultdict(int)
        for a in state.pending["api"].values():
            key = (a.spec.endpoint, a.task)
            used = state.busy_by_task[(api_key(a.spec.endpoint), a.task)] + planned[key]
            if used < self.slots.get(key, 0) and led.api_ok(a):
                planned[key] += 1
                grants.append(led.take_api(a))


class StaticScheduler(PartitionedScheduler):
    """Trajectory-bound sandboxes, fixed GPU devices per task, fixed API semaphores.

    Args:
        cores_per_sandbox: cores each trajectory reserves; ``None`` splits the cluster's
            cores evenly among the CPU-using trajectories alive at the first decision
            (every trajectory of a step gets its sandbox at once).
        api_semaphore: per-tool concurrency limit (verl tools use 10-120); ``None`` uses
            the task's share of the endpoint's concurrency.
    """

    name = "static"

    def __init__(self, cores_per_sandbox: int | None = None,
                 api_semaphore: int | None = 64) -> None:
        super().__init__(api_semaphore)
        self.cores_per_sandbox = cores_per_sandbox

    def reset(self, state: ClusterState, rng: np.random.Generator) -> None:
        super().reset(state, rng)
        self.c = self.cores_per_sandbox
        # Each service gets one device of its task's set, fixed for the whole run.
        self.pinned: dict[tuple[str, str], int] = {}
        self._services_seen: dict[str, list[str]] = defaultdict(list)

    def gpu_device(self, state: ClusterState, led: Ledger, a: Action) -> int:
        key = (a.task, a.spec.service)
        if key not in self.pinned:
            seen = self._services_seen[a.task]
            devs = self.devices.get(a.task) or list(range(state.gpu.total))
            self.pinned[key] = devs[len(seen) % len(devs)]
            seen.append(a.spec.service)
        d = self.pinned[key]
        return d if d in led.idle else -1

    def decide(self, state: ClusterState) -> list[Grant]:
        if self.c is None:
            cpu_tasks = state.task_demand["cpu"]
            n = sum(1 for t in state.trajectories.values() if t.task in cpu_tasks) or 1
            self.c = max(1, min(state.cpu.total // n, max(state.cpu.cores, default=1)))
        led = Ledger(state)
        grants: list[Grant] = []
        c = self.c
        any_free = max(led.free, default=0) > 0
        holders: bool | None = None  # whether any trajectory holds its c cores (once asked)
        for a in state.pending["cpu"].values():
            traj = a.traj
            if not any_free and (traj is None or traj.held_cores < c):
                # Only a trajectory holding its c cores can start anything now; with none,
                # the rest of the queue cannot (no pass over a deep queue for nothing).
                if holders is None:
                    holders = any(t.held_cores >= c for t in state.trajectories.values())
                if not holders:
                    break
                continue
            node, room = led.cpu_room(a)
            spec = a.spec
            if traj is None:  # no trajectory to bind to: a plain action-level grant
                if room >= spec.min_cores:
                    grants.append(led.take_cpu(a, node, spec.min_cores))
                    any_free = max(led.free) > 0
                continue
            held = traj.held_cores
            target = max(held, c)
            cores = min(max(target, spec.min_cores), spec.max_cores)
            if room >= max(target, cores):
                grants.append(led.take_cpu(a, node, cores, hold=target))
                any_free = max(led.free) > 0
        if state.pending["gpu"] and led.idle:
            self.gpu_grants(state, led, grants)
        if state.pending["api"]:
            self.api_grants(state, led, grants)
        return grants


class TaskIsolatedScheduler(PartitionedScheduler):
    """Action-level grants (minimum cores), every pool partitioned per task."""

    name = "task_isolated"

    def reset(self, state: ClusterState, rng: np.random.Generator) -> None:
        super().reset(state, rng)
        self.cores = partition(state.cpu.total, state.task_demand["cpu"])
        for task, n in self.cores.items():
            state.reserve("cpu", task, n)

    def decide(self, state: ClusterState) -> list[Grant]:
        led = Ledger(state)
        grants: list[Grant] = []
        planned: dict[str, int] = defaultdict(int)
        exhausted = not any(led.free)
        holders: bool | None = None  # whether any trajectory holds cores (once asked)
        # cores each task may still be granted (an action asks one at least)
        left = {t: n - state.busy_by_task.get(("cpu", t), 0) for t, n in self.cores.items()}
        full = max(left.values(), default=0) < 1
        for a in state.pending["cpu"].values():
            if full:
                break  # every task's partition is full: the rest of the queue waits
            if exhausted:
                # No core left on any node: only an action of a trajectory holding cores
                # could start; with none, the rest of the queue cannot.
                if holders is None:
                    holders = any(t.held_cores for t in state.trajectories.values())
                if not holders:
                    break
            k = a.spec.min_cores
            used = state.busy_by_task[("cpu", a.task)] + planned[a.task]
            if used + k > self.cores.get(a.task, 0):
                continue
            node, room = led.cpu_room(a)
            if room >= k:
                planned[a.task] += k
                grants.append(led.take_cpu(a, node, k))
                exhausted = not any(led.free)
                left[a.task] -= k
                full = max(left.values()) < 1
        if state.pending["gpu"] and led.idle:
            self.gpu_grants(state, led, grants)
        if state.pending["api"]:
            self.api_grants(state, led, grants)
        return grants
