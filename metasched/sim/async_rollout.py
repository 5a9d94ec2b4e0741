"""Asynchronous RL rollouts in the simulator: no step barrier, a staleness bound.

A profile with ``max_offpolicyness`` set (AReaL's ``max_head_offpolicyness``) runs
its instance's trajectories (every step's, in order) as one stream. A trajectory starts
(asks for its sandbox) as soon as the core's :class:`~metasched.core.staleness.StalenessGate`
has room: at trainer version ``v``, while fewer than ``(max_offpolicyness + v + 1) x
trajectories_per_step`` have started. Each ``trajectories_per_step`` finished trajectories
make a batch; the trainer trains on batches one at a time, ``step_gap_s`` each, and
each one it finishes advances the version (and so lets more start).

What a scheduler sees: ``state.step_index`` is the trainer's version and
``state.step_start_t`` when it was reached; ``state.step_total`` is the batch size and
``state.step_done`` the trajectories finished towards the next batch; ``state.prompts``
holds the prompt groups that have trajectories running. The run's "steps" are the
intervals between two batches' completion (the first from the run's start).

Measured (``RunResult.rollout``): per trajectory, its start, end and staleness;
summarised as trajectories per hour and mean trajectory latency.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

import numpy as np

from metasched.core.actions import Trajectory
from metasched.core.metrics import RolloutResult
from metasched.core.staleness import StalenessGate
from metasched.core.state import ClusterState
from metasched.sim.sampling import TrajectorySpec, WorkloadInstance
from metasched.sim.workload_config import WorkloadConfig


class RolloutHost(Protocol):
    """What an asynchronous run asks of its simulator
    (:class:`~metasched.sim.simulator.Simulator`)."""

    state: ClusterState
    workload: WorkloadConfig
    instance: WorkloadInstance
    step_trajs: list[Trajectory]

    def start_trajectory(self, ts: TrajectorySpec, version: int) -> Trajectory: ...

    def open_waiting_sandboxes(self) -> None: ...

    def train_until(self, t: float) -> None: ...


class AsyncRollout:
    """The trajectory stream of one asynchronous run, driven by its simulator."""

    def __init__(self, sim: RolloutHost) -> None:
        self.sim = sim
        w = sim.workload
        self.gate = StalenessGate(w.trajectories_per_step, w.max_offpolicyness)
        self._queue = deque(ts for step in sim.instance.steps for ts in step)
        self._trainer_free_at = 0.0
        self._window_start = 0.0
        self._start_version: dict[int, int] = {}
        self._start: list[float] = []
        self._end: list[float] = []
        self._staleness: list[int] = []

    def begin(self) -> None:
        """Start the first trajectories (at version 0)."""
        state = self.sim.state
        state.step_index, state.step_start_t = 0, state.t
        state.step_total, state.step_done = self.gate.batch, 0
        state.prompts = {}
        self._admit()

    def _admit(self) -> None:
        """Start trajectories while the staleness bound has room for them."""
        sim, gate = self.sim, self.gate
        n = min(gate.room(), len(self._queue))
        if not n:
            return
        for _ in range(n):
            traj = sim.start_trajectory(self._queue.popleft(), gate.version)
            self._start_version[traj.id] = gate.start()
        sim.open_waiting_sandboxes()

    def done(self, traj: Trajectory) -> None:
        """``traj`` has ended (its sandbox is closed): count it; a completed batch goes to
        the trainer; start what the bound now allows."""
        sim, state, gate = self.sim, self.sim.state, self.gate
        sim.open_waiting_sandboxes()
        t = state.t
        # The trainer trains batch k at version k: the staleness of its trajectories.
        self._staleness.append(gate.finished // gate.batch - self._start_version.pop(traj.id))
        self._start.append(traj.start_t)
        self._end.append(t)
        state.step_done += 1
        if gate.finish():
            state.metrics.steps.append((self._window_start, t))
            self._window_start = t
            state.step_done = 0
            sim.step_trajs = [x for x in sim.step_trajs if x.end_t != x.end_t]  # unfinished
            state.prompts = {p: ts for p, ts in state.prompts.items()
                             if any(x.end_t != x.end_t for x in ts)}
            begin = max(t, self._trainer_free_at)
            gap = sim.workload.step_gap_s
            self._trainer_free_at = begin + gap
            if gap > 0:
                sim.train_until(self._trainer_free_at)
            else:
                self.trained()
                return
        self._admit()

    def trained(self) -> None:
        """The trainer has trained on a batch: the version advances."""
        state = self.sim.state
        self.gate.trained()
        state.step_index, state.step_start_t = self.gate.version, state.t
        self._admit()

    def measured(self) -> RolloutResult:
        """What the run measured so far."""
        return RolloutResult(np.array(self._start, dtype=float), np.array(self._end, dtype=float),
                             np.array(self._staleness, dtype=np.int64),
                             self.gate.max_offpolicyness)
