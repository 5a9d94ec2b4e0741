"""Step-time heuristics: the RL step ends with its slowest trajectory, so serve first
the actions of the trajectories that will finish last.

All are ``rate_greedy`` (elastic CPU grants, its GPU rule) with another order for the
CPU queues and the API queues (quota used first, then this order):

- ``critical_path``: most estimated remaining work first. A trajectory's remaining work
  is the action's own estimated run plus its estimated turns left times its task's
  estimated seconds per turn (generation plus tool). Turns left: the task's mean turn
  count over the trajectories of earlier steps of the run, less the turns submitted
  (at least the action's own turn; before any step has ended, the task's most turns
  seen so far in the step stands for the mean). Seconds per turn: the task's mean
  action estimate and its mean generation gap (from an action's end to its
  trajectory's next submission) seen so far. Static, type-level estimates only.
- ``least_slack``: the latest projected finish first, against the task's expected
  trajectory time: the submission instant plus the remaining work above, less the step's
  start and the task's expected trajectory time (turns × seconds per turn). Unlike
  ``critical_path`` it counts the time a trajectory has already lost.
- ``estimates: predictor`` (``critical_path``, ``least_slack``; ``rate_greedy_step``
  in :mod:`.rate_greedy`): the remaining work is the learned predictor's median
  (``state.predictor``, :mod:`metasched.core.predictor`) for the trajectory and the
  action it queues, instead of the static estimate above; ``least_slack``'s projected
  finish is then the submission instant plus it. The same rules fed the same
  predictor, so that a learned policy is compared with heuristics that know as much.
  ``critical_path_predicted`` and ``least_slack_predicted`` name them so configured.
- ``learned_priority``: ``critical_path``'s rules in order of a learned priority, a
  pairwise learning-to-rank score over the predictor's features and quantiles
  (:mod:`metasched.core.ranker`); an evaluation fits its ranker per workload.
- ``oracle``: ``critical_path`` with the true remaining work, read from the
  trajectory's own future turns (true generation and action seconds). It reads what
  no scheduler may (``spec.true_s``): a reference for what knowing the remaining work
  is worth, not a deployable scheduler, and not among the heuristics.
"""

from __future__ import annotations

import math

from metasched.agents.elastic import _quota_s
from metasched.agents.predicted import (
    check_estimates,
    predicted_remaining_s,
    require_predictor,
)
from metasched.agents.rate_greedy import RateGreedyScheduler
from metasched.core.actions import Action, Trajectory
from metasched.core.pools import EndpointSpec
from metasched.core.ranker import row as rank_row
from metasched.core.state import ClusterState


class _Mean:
    """A running mean."""

    __slots__ = ("n", "total")

    def __init__(self) -> None:
        self.n = 0
        self.total = 0.0

    def add(self, v: float) -> None:
        self.n += 1
        self.total += v

    def get(self, default: float = 0.0) -> float:
        return self.total / self.n if self.n else default


class CriticalPathScheduler(RateGreedyScheduler):
    """``rate_greedy`` with CPU and API actions in order of most estimated remaining
    work of their trajectory (see the module docstring).

    Args: as ``rate_greedy``'s (which has ``progress_s`` and ``endgame`` besides), and
        ``estimates``: ``given`` (the module docstring's) or ``predictor``.
    """

    name = "critical_path"

    def __init__(self, headroom: float = 0.25, min_gain_s: float = 0.0, recent_s: float = 30.0,
                 defer: float = 8.0, estimates: str = "given") -> None:
        super().__init__(headroom=headroom, min_gain_s=min_gain_s, recent_s=recent_s,
                         defer=defer)
        self.estimates = check_estimates(estimates)
        self._stats_for: ClusterState | None = None

    def reset(self, state: ClusterState, rng) -> None:
        require_predictor(state, self.estimates)
        super().reset(state, rng)
        self._stats_for = None

    def _stats(self, state: ClusterState) -> None:
        """Start the per-task statistics over for a new run; fold the trajectories of a
        finished step into the turn counts."""
        if self._stats_for is not state:
            self._stats_for = state
            self._turns: dict[str, _Mean] = {}  # task -> turns of trajectories of past steps
            self._max_turns: dict[str, int] = {}  # task -> most turns seen in this step
            self._est: dict[str, _Mean] = {}  # task -> action estimate, at max cores
            self._gen: dict[str, _Mean] = {}  # task -> generation gap between actions
            self._last: dict[int, Action] = {}  # trajectory -> its last action seen
            self._step_trajs: dict[int, Trajectory] = {}
            self._step = state.step_index
        if state.step_index != self._step:
            for traj in self._step_trajs.values():
                self._turns.setdefault(traj.task, _Mean()).add(traj.turn)
            self._step_trajs = {}
            self._last = {}
            self._max_turns = {}
            self._step = state.step_index

    def _observe(self, a: Action) -> None:
        s = a.spec
        self._est.setdefault(a.task, _Mean()).add(s.est_s / s.speedup(s.max_cores))
        traj = a.traj
        if traj is None:
            return
        self._step_trajs[traj.id] = traj
        if traj.turn > self._max_turns.get(traj.task, 0):
            self._max_turns[traj.task] = traj.turn
        prev = self._last.get(traj.id)
        if prev is not None and math.isfinite(prev.end_t) and a.submit_t >= prev.end_t:
            self._gen.setdefault(traj.task, _Mean()).add(a.submit_t - prev.end_t)
        self._last[traj.id] = a

    def per_turn_s(self, task: str) -> float:
        """The task's estimated seconds per turn: generation plus action."""
        est, gen = self._est.get(task), self._gen.get(task)
        return (est.get() if est else 0.0) + (gen.get() if gen else 0.0)

    def expected_turns(self, task: str) -> float:
        """The task's expected turns per trajectory (see the module docstring)."""
        m = self._turns.get(task)
        return m.get() if m is not None and m.n else float(self._max_turns.get(task, 1))

    def remaining_s(self, a: Action) -> float:
        """Estimated remaining work of ``a``'s trajectory, ``a`` included."""
        if self.estimates == "predictor":
            return predicted_remaining_s(self._stats_for, a)
        s = a.spec
        own = s.est_s / s.speedup(s.max_cores)
        traj = a.traj
        if traj is None:
            return own
        left = max(self.expected_turns(a.task) - traj.turn, 0.0)
        return own + left * self.per_turn_s(a.task)

    def _key(self, a: Action) -> tuple:
        return (-self.remaining_s(a), a.id)

    def _sync(self, state: ClusterState) -> None:
        self._stats(state)
        super()._sync(state)

    def _cpu_key(self, a: Action) -> tuple:
        self._observe(a)
        return self._key(a)

    def _api_key(self, ep: EndpointSpec, a: Action) -> tuple:
        self._observe(a)
        return (_quota_s(ep, a), *self._key(a))


class LeastSlackScheduler(CriticalPathScheduler):
    """``rate_greedy`` with CPU and API actions in order of least slack: the latest
    projected finish of their trajectory against its task's expected trajectory time
    (see the module docstring)."""

    name = "least_slack"

    def _key(self, a: Action) -> tuple:
        if self.estimates == "predictor":  # the latest predicted finish first
            return (-(a.submit_t + self.remaining_s(a)), a.id)
        expected = self.expected_turns(a.task) * self.per_turn_s(a.task)
        late = a.submit_t + self.remaining_s(a) - self._stats_for.step_start_t - expected
        return (-late, a.id)


class CriticalPathPredictedScheduler(CriticalPathScheduler):
    """``critical_path`` with ``estimates: predictor``."""

    name = "critical_path_predicted"

    def __init__(self, headroom: float = 0.25, min_gain_s: float = 0.0, recent_s: float = 30.0,
                 defer: float = 8.0, estimates: str = "predictor") -> None:
        super().__init__(headroom, min_gain_s, recent_s, defer, estimates)


class LeastSlackPredictedScheduler(LeastSlackScheduler):
    """``least_slack`` with ``estimates: predictor``."""

    name = "least_slack_predicted"

    def __init__(self, headroom: float = 0.25, min_gain_s: float = 0.0, recent_s: float = 30.0,
                 defer: float = 8.0, estimates: str = "predictor") -> None:
        super().__init__(headroom, min_gain_s, recent_s, defer, estimates)


class LearnedPriorityScheduler(CriticalPathScheduler):
    """``critical_path``'s rules in order of a learned priority: a pairwise
    learning-to-rank score over the predictor's features and quantiles
    (:mod:`metasched.core.ranker`), highest first. ``ranker`` is set before the run (an
    evaluation fits one per workload, :mod:`metasched.evaluation.predictors`)."""

    name = "learned_priority"

    def __init__(self, headroom: float = 0.25, min_gain_s: float = 0.0, recent_s: float = 30.0,
                 defer: float = 8.0) -> None:
        super().__init__(headroom, min_gain_s, recent_s, defer, "predictor")
        self.ranker = None

    def reset(self, state: ClusterState, rng) -> None:
        if self.ranker is None:
            raise ValueError("learned_priority needs a fitted ranker (none was set)")
        super().reset(state, rng)

    def _key(self, a: Action) -> tuple:
        traj = a.traj
        if traj is None:
            return (-math.inf, a.id)
        p = self._stats_for.predictor
        p.remaining_of(traj, a.spec.name)
        return (-self.ranker.score(rank_row(p, traj.id)), a.id)


def true_run_s(a_spec) -> float:
    """An action's true run time at its maximum cores (cpu) or alone (gpu, api)."""
    return a_spec.true_s / a_spec.speedup(a_spec.max_cores) if a_spec.kind == "cpu" \
        else a_spec.true_s


class OracleScheduler(CriticalPathScheduler):
    """``critical_path`` with each trajectory's true remaining work: the true run of the
    action and of every later turn, plus the later turns' true generation seconds. Reads
    ``spec.true_s``: a reference, not a heuristic."""

    name = "oracle"

    def _stats(self, state: ClusterState) -> None:
        if self._stats_for is not state:
            self._stats_for = state
            self._suffix: dict[int, list[float]] = {}
        if len(self._suffix) > 4 * max(state.step_total, 1):
            live = state.trajectories
            self._suffix = {k: v for k, v in self._suffix.items() if k in live}

    def _observe(self, a: Action) -> None:
        pass

    def remaining_s(self, a: Action) -> float:
        """True remaining work of ``a``'s trajectory, ``a`` included."""
        traj = a.traj
        if traj is None:
            return true_run_s(a.spec)
        suffix = self._suffix.get(traj.id)
        if suffix is None:  # suffix[i]: the true work of turns i.. (generation and action)
            suffix = [0.0] * (traj.n_turns + 1)
            for i in range(traj.n_turns - 1, -1, -1):
                t = traj.turns[i]
                suffix[i] = suffix[i + 1] + t.gen_s + true_run_s(t.action)
            self._suffix[traj.id] = suffix
        return true_run_s(a.spec) + suffix[a.turn + 1]
