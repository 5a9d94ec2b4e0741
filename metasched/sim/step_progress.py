"""The step's projected end: the potential the env's step objective rewards the fall of.

A synchronous RL step ends with its slowest trajectory. At time ``t`` each trajectory
of the current step projects an end: a finished one its end; an unfinished one

    max(t, last + gen_k + run_k) + sum over later turns j of (gen_j + run_j)

where ``k`` is its first turn whose action has not ended, ``last`` when its previous
action ended (its start before any), ``gen`` the true generation seconds and ``run``
the action's true run alone at its most cores. The step's projected end is the largest
of them: the step's critical path, were every later action served at once. It never
falls behind ``t``, moves only when a trajectory runs behind that ideal pace (waits in
a queue, runs on fewer cores, waits for a sandbox) or when an action ends early or
late, and at the step's end is the step's end.

The potential of a run is the time of the steps done plus the current step's projected
end less its start: a reward of minus its change per decision sums, over a run, to minus
the total step time (exactly, whatever the decisions). It reads true durations, as a
training reward may; no scheduler sees it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from metasched.core.actions import ActionSpec, Trajectory

if TYPE_CHECKING:
    from metasched.sim.simulator import Simulator


def run_alone_s(spec: ActionSpec) -> float:
    """An action's true run alone: at its most cores (cpu), or by itself (gpu, api)."""
    return spec.true_s / spec.speedup(spec.max_cores) if spec.kind == "cpu" else spec.true_s


class StepProgress:
    """The potential of one simulator's run (see the module docstring)."""

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim
        self._suffix: dict[int, list[float]] = {}  # trajectory -> work of turns i..
        self._steps_seen = 0
        self._steps_s = 0.0
        self._key: tuple[int, int, int] | None = None  # what _span was computed for
        self._span: tuple[float, float] | None = None  # (max R_i, max c_i + R_i)

    def _work(self, traj: Trajectory) -> list[float]:
        """``w[i]``: the true generation and run seconds of turns ``i..``."""
        w = self._suffix.get(traj.id)
        if w is None:
            w = [0.0] * (traj.n_turns + 1)
            for i in range(traj.n_turns - 1, -1, -1):
                turn = traj.turns[i]
                w[i] = w[i + 1] + turn.gen_s + run_alone_s(turn.action)
            self._suffix[traj.id] = w
        return w

    def projected_end(self, traj: Trajectory) -> float:
        """When ``traj`` would end, were every later action served at once."""
        if traj.end_t == traj.end_t:  # finished
            return traj.end_t
        t = self.sim.state.t
        k, last = self.sim.turns_done.get(traj.id, (0, traj.start_t))
        w = self._work(traj)
        if k >= traj.n_turns:  # every action ended; the clock closes it this instant
            return t
        return max(t, last + w[k] - w[k + 1]) + w[k + 1]

    def step_end(self) -> float | None:
        """The current step's projected end; None between steps (all of it done)."""
        # max_i(max(t, c_i) + R_i) = max(t + max_i R_i, max_i (c_i + R_i)): both maxima
        # change only when an action ends or trajectories start, not as time passes.
        sim = self.sim
        trajs, state = sim.step_trajs, sim.state
        key = (state.n_done + state.n_failed, id(trajs), len(trajs))
        if key != self._key:
            self._key = key
            self._span = None
            ends = [x.end_t for x in trajs if x.end_t == x.end_t]
            if len(ends) < len(trajs):
                max_r, max_cr = 0.0, max(ends, default=-math.inf)
                for x in trajs:
                    if x.end_t != x.end_t:
                        k, last = sim.turns_done.get(x.id, (0, x.start_t))
                        if k < x.n_turns:
                            w = self._work(x)
                            max_r = max(max_r, w[k + 1])
                            max_cr = max(max_cr, last + w[k])
                self._span = (max_r, max_cr)
        if self._span is None:
            return None
        return max(state.t + self._span[0], self._span[1])

    def potential(self) -> float:
        """Seconds of the steps done plus the current one's projected end less its start."""
        steps = self.sim.state.metrics.steps
        while self._steps_seen < len(steps):
            start, end = steps[self._steps_seen]
            self._steps_s += end - start
            self._steps_seen += 1
            live = self.sim.state.trajectories
            self._suffix = {k: v for k, v in self._suffix.items() if k in live}
        end = self.step_end()
        return self._steps_s + (0.0 if end is None else end - self.sim.state.step_start_t)
