"""Resource pools: CPU (nodes x cores + sandbox memory), GPU (devices x memory with
resident services), API (endpoints with RPM/TPM quotas over a sliding window and max
concurrency).

Pools hold mechanics only (what is free, what an allocation costs); *policy* belongs to
schedulers. Both clocks (simulator, live dispatcher) drive the same pool objects.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from metasched.core.actions import Immutable


@dataclass(frozen=True, slots=True)
class ServiceSpec(Immutable):
    """A GPU service (reward model) that can be made resident on a device.

    Attributes:
        mem_gb: device memory it occupies while resident.
        restore_s: time to load it from host memory onto a device.
        max_batch: most queued requests served by one batch.
        batch_marginal: each extra request in a batch adds this fraction of the slowest
            request's latency (batch latency = max latency x (1 + marginal x (b - 1))).
    """

    mem_gb: float
    restore_s: float
    max_batch: int = 1
    batch_marginal: float = 0.0

    def batch_s(self, latencies: list[float]) -> float:
        """Latency of one batch whose requests alone would take ``latencies``."""
        return max(latencies) * (1.0 + self.batch_marginal * (len(latencies) - 1))


@dataclass(frozen=True, slots=True)
class EndpointSpec(Immutable):
    """An API endpoint's quota, as APIs count theirs: at most ``rpm`` requests (and
    ``tpm`` tokens) per minute, counted over a sliding window, so a burst up to the
    window's allowance is admitted at once.

    Attributes:
        rpm: requests per minute.
        max_concurrency: most calls in flight at once.
        tpm: tokens per minute, or None for no token limit.
        window_s: the window the quota is counted over: at most ``rpm x window_s / 60``
            requests (and ``tpm x window_s / 60`` tokens) started in any ``window_s``
            seconds (60: the per-minute quota itself).
    """

    rpm: float
    max_concurrency: int
    tpm: float | None = None
    window_s: float = 60.0

    @property
    def req_capacity(self) -> float:
        """Requests admitted in one window (a whole number, at least one)."""
        # The tolerance keeps a quota derated by floating-point factors (derated()) at
        # the whole number it was meant to be.
        return float(max(1, math.floor(self.rpm * self.window_s / 60.0 + 1e-9)))

    @property
    def tok_capacity(self) -> float:
        """Tokens admitted in one window."""
        return math.inf if self.tpm is None else self.tpm * self.window_s / 60.0


class CpuPool:
    """Nodes x cores. Sandboxes hold memory on one node; cores are granted per action,
    or held for a trajectory's whole life by trajectory-bound schedulers."""

    def __init__(self, cores_per_node: list[int], mem_gb_per_node: list[float]) -> None:
        self.cores = list(cores_per_node)
        self.mem_gb = list(mem_gb_per_node)
        self.free = list(cores_per_node)  # cores neither running nor held
        # Cores' worth of time-shared actions per node (started on busy cores: they take
        # no core from ``free``; see metasched.core.deadlines).
        self.shared = [0] * len(cores_per_node)
        self.mem_free = list(mem_gb_per_node)
        self.busy = 0  # cores running actions
        self.held = 0  # cores held by trajectories (running or not)
        self.held_busy = 0  # held cores that are running an action
        self.sandboxes = [0] * len(cores_per_node)  # live sandboxes per node

    @property
    def n_nodes(self) -> int:
        return len(self.cores)

    @property
    def total(self) -> int:
        return sum(self.cores)

    def place_sandbox(self, mem_gb: float) -> int:
        """Node for a new sandbox (most free memory, then most free cores); -1 if none fits."""
        n = len(self.cores)
        if not n:
            return -1
        # The largest (free memory, free cores, -node) over every node, compared in C:
        # a step opens 10^4-10^5 sandboxes on 10^3-10^4 nodes. Its node fits if any does.
        mem, _, neg = max(zip(self.mem_free, self.free, range(0, -n, -1), strict=True))
        if mem < mem_gb:
            return -1
        best = -neg
        self.mem_free[best] -= mem_gb
        self.sandboxes[best] += 1
        return best

    def release_sandbox(self, node: int, mem_gb: float) -> None:
        self.mem_free[node] += mem_gb
        self.sandboxes[node] -= 1


class Device:
    """One GPU: memory, resident services (name -> last use time), and at most one
    running batch at a time."""

    __slots__ = ("index", "mem_gb", "resident", "busy", "service", "task", "est_free_t")

    def __init__(self, index: int, mem_gb: float) -> None:
        self.index = index
        self.mem_gb = mem_gb
        self.resident: dict[str, float] = {}
        self.busy = False
        self.service: str | None = None  # service of the running batch
        self.task: str | None = None  # task of the running batch's first request
        self.est_free_t = 0.0  # when the running batch should end, by the estimates

    def mem_used(self, services: dict[str, ServiceSpec]) -> float:
        return sum(services[s].mem_gb for s in self.resident)


class GpuPool:
    """Devices x memory. A service stays resident until evicted (least recently used
    first) to make room for another; making it resident costs its restore time."""

    def __init__(self, n_devices: int, mem_gb: float, services: dict[str, ServiceSpec]) -> None:
        self.devices = [Device(i, mem_gb) for i in range(n_devices)]
        self.services = dict(services)
        self.busy = 0
        self.restores = 0
        self.evictions = 0

    @property
    def total(self) -> int:
        return len(self.devices)

    def fits(self, service: str, device: int) -> bool:
        return self.services[service].mem_gb <= self.devices[device].mem_gb

    def restore_cost(self, service: str, device: int) -> float:
        """Seconds before ``service`` can run on ``device`` (0 when resident)."""
        return 0.0 if service in self.devices[device].resident else self.services[service].restore_s

    def make_resident(self, service: str, device: int, t: float) -> float:
        """Make ``service`` resident on an idle ``device``, evicting LRU services as
        needed; returns the restore time paid."""
        d = self.devices[device]
        if service in d.resident:
            d.resident[service] = t
            return 0.0
        for victim in self.victims(service, device):
            del d.resident[victim]
            self.evictions += 1
        d.resident[service] = t
        self.restores += 1
        return self.services[service].restore_s

    def victims(self, service: str, device: int) -> list[str]:
        """The services making ``service`` resident on ``device`` would evict: least
        recently used first, until it fits (none when it is resident already)."""
        d = self.devices[device]
        if service in d.resident:
            return []
        need = self.services[service].mem_gb
        used = d.mem_used(self.services)
        out = []
        for victim in sorted(d.resident, key=d.resident.__getitem__):
            if used + need <= d.mem_gb:
                break
            used -= self.services[victim].mem_gb
            out.append(victim)
        return out

    def resident_on(self, service: str) -> list[int]:
        return [d.index for d in self.devices if service in d.resident]


class Endpoint:
    """Live state of one API endpoint: the log of requests charged in the trailing window
    (a sliding-window log, the upstream's own way of counting) and a concurrency count.

    ``req`` and ``tok`` are what the window has room for as of the last :meth:`refill`.
    """

    __slots__ = ("name", "spec", "req", "tok", "log", "used_tok", "in_flight", "requests")

    def __init__(self, name: str, spec: EndpointSpec) -> None:
        self.name = name
        self.spec = spec
        self.req = spec.req_capacity
        self.tok = spec.tok_capacity
        self.log: deque[tuple[float, int]] = deque()  # (time, tokens) of each charge
        self.used_tok = 0  # tokens in the log
        self.in_flight = 0
        self.requests = 0

    def refill(self, t: float) -> None:
        """Drop the charges that left the window by ``t`` (half-open: one charged at
        ``t - window_s`` is out) and update ``req`` and ``tok``."""
        log, edge = self.log, t - self.spec.window_s
        while log and log[0][0] <= edge:
            self.used_tok -= log.popleft()[1]
        self.req = self.spec.req_capacity - len(log)
        self.tok = self.spec.tok_capacity - self.used_tok

    def restart(self) -> None:
        """Forget every charge: the window of a service started anew (its quota full;
        calls in flight stay counted)."""
        self.log.clear()
        self.used_tok = 0
        self.req = self.spec.req_capacity
        self.tok = self.spec.tok_capacity

    def can_start(self, tokens: int, t: float) -> bool:
        self.refill(t)
        return (self.in_flight < self.spec.max_concurrency and self.req >= 1.0
                and self.tok >= tokens)

    def ready_in(self, tokens: int, t: float) -> float:
        """Seconds until the window has room for a call of ``tokens`` (inf if never):
        until enough of the charges in it have left."""
        self.refill(t)
        s, log = self.spec, self.log
        if tokens > s.tok_capacity:
            return math.inf
        wait = 0.0
        if self.req < 1.0:  # the oldest len - capacity + 1 charges must leave
            wait = log[len(log) - int(s.req_capacity)][0] + s.window_s - t
        short = tokens - self.tok
        if short > 0:
            for when, k in log:
                short -= k
                if short <= 0:
                    wait = max(wait, when + s.window_s - t)
                    break
        # A charge leaves exactly at when + window_s; a hair later, in case the clock's
        # arithmetic rounds the other way.
        return wait + 1e-9 if wait > 0 else 0.0

    def charge(self, tokens: int, t: float) -> None:
        """Count one request of ``tokens`` against the quota (a call, or a retry of a
        call already in flight: a retry is a new request to the upstream)."""
        self.refill(t)
        self.log.append((t, tokens))
        self.used_tok += tokens
        self.req -= 1.0
        self.tok -= tokens
        self.requests += 1

    def take(self, tokens: int, t: float) -> None:
        """Start a call: charge the quota and count it in flight."""
        self.charge(tokens, t)
        self.in_flight += 1


class ApiPool:
    """API endpoints by name."""

    def __init__(self, endpoints: dict[str, EndpointSpec]) -> None:
        self.endpoints = {name: Endpoint(name, spec) for name, spec in endpoints.items()}
        self.busy = 0

    @property
    def total(self) -> int:
        return sum(e.spec.max_concurrency for e in self.endpoints.values())


__all__ = [
    "ApiPool", "CpuPool", "Device", "Endpoint", "EndpointSpec", "GpuPool", "ServiceSpec",
]
