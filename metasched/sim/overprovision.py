"""Over-provisioning per prompt group (RollPacker's, arXiv 2509.21009), opt-in: a
profile's ``generation.overprovision: k`` launches ``k`` responses per prompt group
beyond its size ``n``; the first ``n`` to finish are the group's, the rest are aborted.

An abort drops the trajectory's generation at once (its waiting request leaves the
queue; a running one leaves its batch at the end of the engine step in progress, its KV
cache freed), withdraws its queued actions (they end failed, ``aborted``), takes it out
of the sandbox queue if it is still waiting there, and submits nothing more of it. A
tool action already running is let finish (a sandbox's command is not killed half
way); the trajectory closes, its sandbox freed, when the last one ends. The step ends
when every group has ``n`` finished responses.

Training semantics: the group's ``n`` responses are the fastest ``n`` of ``n + k``: the
advantage is computed over a sample biased toward short answers (fewer turns, shorter
generations), and the longer ones a prompt would have produced are under-represented,
more so the larger ``k``; RollPacker bounds this by keeping ``k`` small. Partial
rollouts (``max_offpolicyness``) instead keep every response and train on some one step
late; the two are not combined here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from metasched.core.actions import Trajectory
from metasched.errors import ConfigError
from metasched.sim.sampling import TrajectorySpec, sample_siblings

__all__ = ["OverProvision"]


class OverProvision:
    """The simulator's over-provisioned prompt groups (see the module docstring).

    Args:
        sim: the simulator (:class:`~metasched.sim.simulator.Simulator`).
        extra: responses launched per group beyond its size.
        seed: the run's seed (the extra responses come from a fifth stream of it, so
            that every other draw stays as it was).
    """

    def __init__(self, sim: Any, extra: int, seed: int) -> None:
        w = sim.workload
        if not w.groups.on:
            raise ConfigError("workload.generation.overprovision",
                              "needs prompt groups (the profile's groups:)")
        if w.max_offpolicyness is not None:
            raise ConfigError("workload.generation.overprovision", "not with partial "
                              "rollouts (max_offpolicyness)")
        self.sim, self.extra = sim, extra
        self._rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(5)[4])
        self._left: dict[str, int] = {}  # prompt -> responses it still keeps this step
        self._members: dict[str, list[Trajectory]] = {}
        self.aborted: set[int] = set()
        self.n_aborted = 0

    def launch(self, specs: Sequence[TrajectorySpec], version: int) -> None:
        """The step's trajectories (``specs``) have started: start the extra responses
        of each of their prompt groups."""
        sim = self.sim
        self._left, self._members = {}, {}
        for ts in specs:
            self._left[ts.prompt] = self._left.get(ts.prompt, 0) + 1
        for traj in sim.step_trajs:
            self._members.setdefault(traj.prompt, []).append(traj)
        for prompt in self._left:
            for ts in sample_siblings(sim.workload, sim.instance, prompt, self.extra,
                                      self._rng):
                self._members[prompt].append(sim.start_trajectory(ts, version))

    def finished(self, traj: Trajectory) -> None:
        """``traj`` finished (kept): once its group has all it keeps, the others are
        aborted."""
        self._left[traj.prompt] -= 1
        if self._left[traj.prompt]:
            return
        for s in self._members.pop(traj.prompt):
            if s.end_t != s.end_t:  # not finished
                self.abort(s)

    def abort(self, traj: Trajectory) -> None:
        """Abort ``traj`` now (see the module docstring)."""
        sim, state = self.sim, self.sim.state
        t = state.t
        self.aborted.add(traj.id)
        self.n_aborted += 1
        traj.end_t = t
        sim.llm.pool.abort(traj.id, t)
        if traj in list(sim._sandbox_queue):
            sim._sandbox_queue.remove(traj)
        for queue in state.pending.values():
            for a in [a for a in queue.values() if a.traj is traj]:
                state.withdraw(a, "aborted")
                sim._in_flight[traj.id] -= 1
        if not sim._in_flight.get(traj.id):
            self._close(traj)

    def action_ended(self, traj: Trajectory) -> None:
        """An action of aborted ``traj`` ended: it closes with its last."""
        sim = self.sim
        left = sim._in_flight.pop(traj.id) - 1
        if left:
            sim._in_flight[traj.id] = left
        else:
            self._close(traj)

    def _close(self, traj: Trajectory) -> None:
        sim = self.sim
        sim._in_flight.pop(traj.id, None)
        sim._next_turn.pop(traj.id, None)
        sim.turns_done.pop(traj.id, None)
        sim.llm.close(traj)
        if traj.id in sim.state.trajectories:
            sim.state.close_trajectory(traj)
            sim.open_waiting_sandboxes()
