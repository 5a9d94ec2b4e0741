"""What a run records: per-action ACT, per-step time, per-pool busy / held-but-idle
resource-seconds (totals and a bucketed timeline), failures."""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from metasched.core.actions import KINDS

POOLS = KINDS  # cpu, gpu, api
# Timeline columns: busy and held-but-idle units per pool, then api requests issued.
CPU_BUSY, CPU_HELD, GPU_BUSY, GPU_HELD, API_BUSY, API_HELD, API_REQ = range(7)
N_COLS = 7


class Ring:
    """The last ``size`` values appended, oldest first when read. With a ``typecode``
    (``array`` module: ``"d"`` for floats, ``"b"`` for small ints, ``"q"`` for ints) the
    values are stored unboxed, 8 bytes or fewer each instead of a Python object and its
    pointer (about 32 bytes): a long-lived dispatcher keeps 100,000 of each."""

    __slots__ = ("_items", "_size", "_next")

    def __init__(self, size: int, typecode: str | None = None) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1 (got {size})")
        self._items: array | list = array(typecode) if typecode else []
        self._size = size
        self._next = 0  # where the next value goes once full

    def append(self, value: Any) -> None:
        items = self._items
        if len(items) < self._size:
            items.append(value)
        else:
            items[self._next] = value
            self._next = (self._next + 1) % self._size

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Any]:
        items, i = self._items, self._next
        yield from items[i:]
        yield from items[:i]

    def array(self, dtype: Any = None) -> np.ndarray:
        """The values, oldest first, as a NumPy array."""
        items, i = self._items, self._next
        if isinstance(items, array):
            out = np.array(items, dtype=np.dtype(items.typecode))  # a copy: reads the buffer
            out = np.concatenate([out[i:], out[:i]])
            return out if dtype is None else out.astype(dtype)
        return np.array(list(self), dtype=dtype)


def _as_array(values: Iterable[Any], dtype: Any = None) -> np.ndarray:
    return values.array(dtype) if isinstance(values, Ring) else np.array(values, dtype=dtype)


class Recorder:
    """Accumulates a run's measurements; cheap enough to run on every event.

    Args:
        timeline_dt: bucket width of the utilisation timeline, seconds.
        max_actions: keep the per-action records of only the most recent this many
            actions (a long-lived dispatcher would otherwise grow without bound), in
            rings of unboxed values (about 45 bytes an action); totals, the timeline and
            failure counts always cover everything. None: keep all (lists).
    """

    def __init__(self, timeline_dt: float = 10.0, max_actions: int | None = None) -> None:
        self.dt = timeline_dt
        self.timeline: list[list[float]] = []
        self.totals = [0.0] * N_COLS

        def per_action(typecode: str | None) -> list | Ring:
            return [] if max_actions is None else Ring(max_actions, typecode)

        self.kind = per_action("b")
        self.task = per_action(None)  # references to a few shared names
        self.submit = per_action("d")
        self.start = per_action("d")
        self.end = per_action("d")
        self.ok = per_action("b")
        self.lower_bound = per_action("d")
        self.steps: list[tuple[float, float]] = []
        self.reasons: dict[str, int] = {}

    def _bucket(self, b: int) -> list[float]:
        tl = self.timeline
        while len(tl) <= b:
            tl.append([0.0] * N_COLS)
        return tl[b]

    def integrate(self, t0: float, t1: float, levels: tuple[float, ...]) -> None:
        """Add ``levels`` (units in use per column) held constant over [t0, t1)."""
        # Unrolled over the six columns: this runs at every instant of a simulation.
        c0, c1, c2, c3, c4, c5 = levels
        tot = self.totals
        span = t1 - t0
        tot[0] += c0 * span
        tot[1] += c1 * span
        tot[2] += c2 * span
        tot[3] += c3 * span
        tot[4] += c4 * span
        tot[5] += c5 * span
        dt = self.dt
        while t0 < t1:
            b = int(t0 / dt)
            seg = min(t1, (b + 1) * dt) - t0
            if seg <= 0.0:  # float edge: t0 sits on a bucket boundary
                seg = min(t1 - t0, dt)
                b += 1
            row = self._bucket(b)
            row[0] += c0 * seg
            row[1] += c1 * seg
            row[2] += c2 * seg
            row[3] += c3 * seg
            row[4] += c4 * seg
            row[5] += c5 * seg
            t0 += seg

    def request(self, t: float) -> None:
        self.totals[API_REQ] += 1
        self._bucket(int(t / self.dt))[API_REQ] += 1

    def action(self, kind: int, task: str, submit: float, start: float, end: float, ok: bool,
               lower_bound: float, reason: str = "") -> None:
        self.kind.append(kind)
        self.task.append(task)
        self.submit.append(submit)
        self.start.append(start)
        self.end.append(end)
        self.ok.append(ok)
        self.lower_bound.append(lower_bound)
        if not ok:
            self.reasons[reason] = self.reasons.get(reason, 0) + 1


@dataclass
class RolloutResult:
    """What an asynchronous rollout measured, per finished trajectory."""

    start: np.ndarray
    end: np.ndarray
    staleness: np.ndarray
    max_offpolicyness: int

    @property
    def latency(self) -> np.ndarray:
        """Trajectory latency: end less start (the sandbox's wait included)."""
        return self.end - self.start

    def per_hour(self) -> float:
        """Trajectories finished per hour, from the run's start to the last end."""
        span = float(self.end.max()) if self.end.size else 0.0
        return 3600.0 * self.end.size / span if span > 0 else math.nan


@dataclass
class RunResult:
    """Everything one simulation (or live run) measured, as arrays."""

    kind: np.ndarray  # per finished action: 0 cpu, 1 gpu, 2 api
    task: np.ndarray
    submit: np.ndarray
    start: np.ndarray
    end: np.ndarray
    ok: np.ndarray
    lower_bound: np.ndarray
    step_start: np.ndarray
    step_end: np.ndarray
    timeline: np.ndarray  # (buckets, N_COLS) resource-seconds per bucket (API_REQ: count)
    timeline_dt: float
    totals: np.ndarray
    capacity: dict[str, float]  # units per pool (cores, devices, api concurrency)
    api_rps: float  # total request quota per second over all endpoints
    api_burst: float  # requests one window allows at once, over all endpoints
    makespan: float
    counters: dict[str, int]
    failure_reasons: dict[str, int]
    # Asynchronous rollouts only (``metasched.sim.async_rollout``): per trajectory, its
    # start (admitted under the staleness bound), end and staleness (the trainer's
    # version when it trains on the trajectory's batch less the version it started at).
    rollout: RolloutResult | None = None

    @classmethod
    def from_recorder(cls, r: Recorder, capacity: dict[str, float], api_rps: float,
                      api_burst: float, makespan: float,
                      counters: dict[str, int]) -> RunResult:
        steps = np.array(r.steps, dtype=float).reshape(-1, 2)
        return cls(
            kind=_as_array(r.kind, np.int8), task=_as_array(r.task, object),
            submit=_as_array(r.submit), start=_as_array(r.start), end=_as_array(r.end),
            ok=_as_array(r.ok, bool), lower_bound=_as_array(r.lower_bound),
            step_start=steps[:, 0], step_end=steps[:, 1],
            timeline=np.array(r.timeline, dtype=float).reshape(-1, N_COLS),
            timeline_dt=r.dt, totals=np.array(r.totals), capacity=capacity, api_rps=api_rps,
            api_burst=api_burst, makespan=makespan, counters=counters,
            failure_reasons=dict(r.reasons))

    @property
    def act(self) -> np.ndarray:
        """Action completion time (queue wait + run) of every finished action."""
        return self.end - self.submit

    @property
    def step_s(self) -> np.ndarray:
        return self.step_end - self.step_start

    def utilisation(self) -> dict[str, float]:
        """Busy fraction of capacity over the makespan; for api, the fraction of the
        request quota used (requests / (one window's allowance + RPM x makespan))."""
        span = max(self.makespan, 1e-12)
        tot = self.totals
        out = {}
        for pool, col in (("cpu", CPU_BUSY), ("gpu", GPU_BUSY)):
            cap = self.capacity[pool]
            out[pool] = float(tot[col] / (cap * span)) if cap else 0.0
        quota = self.api_burst + self.api_rps * self.makespan
        out["api"] = float(tot[API_REQ] / quota) if quota else 0.0
        return out

    def idle_held(self) -> dict[str, float]:
        """Resource-seconds held (by a trajectory or a task partition) but idle."""
        return {"cpu": float(self.totals[CPU_HELD]), "gpu": float(self.totals[GPU_HELD]),
                "api": float(self.totals[API_HELD])}
