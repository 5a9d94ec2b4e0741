"""``slack_first``: serve the trajectories that would lengthen the step first, and
everything else as ``rate_greedy`` does.

The step ends with its slowest trajectory, but most trajectories are not it: making
their actions wait behind the slowest ones (as ``critical_path`` and ``least_slack``
do for every action) costs mean ACT and buys no step. ``slack_first`` splits the CPU
queue in two:

- the step's horizon ``H`` is the longer of the most remaining work of any live
  trajectory and the remaining CPU work over the cluster's cores (neither can end
  sooner);
- a trajectory whose remaining work is within ``margin`` × ``H`` of ``H`` is
  *critical*: its actions go first, most remaining work first;
- the others go in ``rate_greedy``'s order (shortest estimate first, less
  ``progress_s`` per turn come), so mean ACT stays close to ``rate_greedy``'s; with
  ``rest="trajectory"``, least remaining work of their trajectory first instead (the
  trajectories' shortest-remaining-first: for mean trajectory latency, e.g. in
  asynchronous rollouts).

API calls: least quota first, then the same split (keyed when they arrive). GPU and
core counts: ``rate_greedy``'s.

A trajectory that waits keeps its remaining work while ``H`` falls with the work done,
so it turns critical in time; one served at full speed keeps its slack. ``H`` and the
split are recomputed every ``refresh_s`` seconds of the clock (the queues re-keyed when
the split changes; an action keeps the remaining work it was queued with, or with
``rekey`` has it read again at every refresh). Remaining
work comes from ``estimates`` as in ``critical_path``: ``given`` (type-level turn counts
and seconds per turn; ``margin`` 0.7) or ``predictor`` (``slack_first_predicted``: the
horizon from the learned predictor's medians, an action's trajectory judged and ordered
by its ``quantile``, p90; ``margin`` 0.5); ``slack_first_oracle`` reads the true
remaining work (``margin`` 0.5), a reference. The defaults were chosen on training seeds
(docs/benchmarks/contended.md).
"""

from __future__ import annotations

import math

from metasched.agents.step_order import CriticalPathScheduler, OracleScheduler, true_run_s
from metasched.core.actions import Action, Trajectory
from metasched.core.state import ClusterState


class SlackFirstScheduler(CriticalPathScheduler):
    """Critical trajectories first (most remaining work first), the rest in
    ``rate_greedy``'s order (see the module docstring).

    Args: as ``critical_path``'s, and
        margin: a trajectory within this fraction of the step's horizon is critical.
        refresh_s: seconds of the clock between recomputations of the horizon.
        progress_s: ``rate_greedy``'s order credit per turn come, for the others.
        quantile: with ``estimates: predictor``, the predictor's quantile an action's
            trajectory is judged and ordered by (the horizon takes medians).
        rest: the others' order: ``action`` (``rate_greedy``'s) or ``trajectory``
            (least remaining work first).
        rekey: re-read every queued action's remaining work at each refresh (news of
            its trajectory's siblings, with the predictor), not only when queued.
    """

    name = "slack_first"

    def __init__(self, headroom: float = 0.25, min_gain_s: float = 0.0, recent_s: float = 30.0,
                 defer: float = 8.0, estimates: str = "given", margin: float = 0.7,
                 refresh_s: float = 2.0, progress_s: float = 0.5, quantile: str = "p50",
                 rest: str = "action", rekey: bool = False) -> None:
        super().__init__(headroom, min_gain_s, recent_s, defer, estimates)
        self.rekey = rekey
        if rest not in ("action", "trajectory"):
            raise ValueError(f"rest must be action or trajectory (got {rest!r})")
        self.rest = rest
        if quantile not in ("p10", "p50", "p90"):
            raise ValueError(f"quantile must be one of p10, p50, p90 (got {quantile!r})")
        self.quantile = quantile
        if not 0.0 <= margin <= 1.0:
            raise ValueError(f"margin must be in [0, 1] (got {margin})")
        if not refresh_s > 0:
            raise ValueError(f"refresh_s must be > 0 (got {refresh_s})")
        self.margin = margin
        self.refresh_s = refresh_s
        self.progress_s = progress_s
        self._cut = math.inf  # remaining work at or above which a trajectory is critical
        self._next_t = -math.inf
        self._horizon_for: ClusterState | None = None

    def reset(self, state: ClusterState, rng) -> None:
        super().reset(state, rng)
        self._cut = math.inf
        self._next_t = -math.inf
        self._horizon_for = None
        self._r = {}

    # ------------------------------------------------------------------ remaining work

    def traj_work(self, traj: Trajectory) -> tuple[float, float]:
        """(remaining seconds along the trajectory's own path, remaining CPU
        core-seconds) of a live trajectory, from the estimates."""
        task = traj.task
        est = self._est.get(task)
        act = est.get() if est is not None else 0.0
        per_turn = self.per_turn_s(task)
        if self.estimates == "predictor":
            path = self._stats_for.predictor.remaining_of(traj).p50
        else:
            path = max(self.expected_turns(task) - traj.turn, 0.0) * per_turn + act
        share = act / per_turn if per_turn > 0 else 1.0
        return path, path * share

    def _horizon(self, state: ClusterState) -> float:
        path, work = 0.0, 0.0
        for traj in state.trajectories.values():
            p, w = self.traj_work(traj)
            path = max(path, p)
            work += w
        cores = sum(state.cpu.cores)
        return max(path, work / cores if cores else 0.0)

    # ------------------------------------------------------------------ order

    def _sync(self, state: ClusterState) -> None:
        super()._sync(state)  # queues the new arrivals (under the split in force)
        if self._horizon_for is not state:
            self._horizon_for = state
            self._next_t = -math.inf
        if state.t >= self._next_t:
            self._next_t = state.t + self.refresh_s
            self._refresh(state)

    def _refresh(self, state: ClusterState) -> None:
        """Recompute the split, and re-key what is queued where it changed (with
        ``rekey``, always)."""
        cut = (1.0 - self.margin) * self._horizon(state)
        if cut == self._cut and not self.rekey:
            return
        self._cut = cut
        self._requeue(state)

    def _requeue(self, state: ClusterState) -> None:
        """Re-key the queued CPU actions under the split in force (with ``rekey``, each
        one's remaining work read again)."""
        pending = state.pending["cpu"]
        if self.rekey:
            self._r = {i: self.remaining_s(pending[i]) for i in self._r if i in pending}
        else:
            self._r = {i: r for i, r in self._r.items() if i in pending}
        self._requeue_cpu(state, self._split)

    def remaining_s(self, a: Action) -> float:
        if self.estimates != "predictor" or self.quantile == "p50" or a.traj is None:
            return super().remaining_s(a)
        p = self._stats_for.predictor
        s = a.spec
        q = getattr(p.remaining_of(a.traj, s.name), self.quantile)
        rest = q - p.duration(a.traj.id, s.name)
        return s.est_s / s.speedup(s.max_cores) + (rest if rest > 0.0 else 0.0)

    def _key(self, a: Action) -> tuple:
        self._r[a.id] = self.remaining_s(a)
        return self._split(a)

    def _critical(self, a: Action) -> bool:
        """Whether queued ``a``'s trajectory is critical under the split in force."""
        return self._r[a.id] >= self._cut

    def _split(self, a: Action) -> tuple:
        """``a``'s key under the split in force, from its remaining work when queued."""
        r = self._r[a.id]
        if self._critical(a):
            return (0, -r, a.id)
        if self.rest == "trajectory":  # least remaining work first: the trajectory's SRPT
            return (1, r, a.id)
        s = a.spec
        turns = a.traj.turn if a.traj is not None else 0
        return (1, s.est_s / s.speedup(s.max_cores) - self.progress_s * turns, a.id)


class SlackFirstOracleScheduler(SlackFirstScheduler, OracleScheduler):
    """``slack_first`` with each trajectory's true remaining work (``oracle``'s): a
    reference for what knowing it is worth to this rule, not a heuristic."""

    name = "slack_first_oracle"

    def __init__(self, headroom: float = 0.25, min_gain_s: float = 0.0, recent_s: float = 30.0,
                 defer: float = 8.0, estimates: str = "given", margin: float = 0.5,
                 refresh_s: float = 2.0, progress_s: float = 0.5, quantile: str = "p50",
                 rest: str = "action", rekey: bool = False) -> None:
        super().__init__(headroom, min_gain_s, recent_s, defer, estimates, margin, refresh_s,
                         progress_s, quantile, rest, rekey)

    def traj_work(self, traj: Trajectory) -> tuple[float, float]:
        path, work = 0.0, 0.0
        for turn in traj.turns[max(traj.turn - 1, 0):]:
            s = turn.action
            path += turn.gen_s + true_run_s(s)
            if s.kind == "cpu":
                p, m = s.parallel_fraction, s.min_cores
                work += s.true_s * ((1.0 - p) * m + p)
        return path, work


class SlackFirstPredictedScheduler(SlackFirstScheduler):
    """``slack_first`` with ``estimates: predictor``."""

    name = "slack_first_predicted"

    def __init__(self, headroom: float = 0.25, min_gain_s: float = 0.0, recent_s: float = 30.0,
                 defer: float = 8.0, estimates: str = "predictor", margin: float = 0.5,
                 refresh_s: float = 2.0, progress_s: float = 0.5, quantile: str = "p90",
                 rest: str = "action", rekey: bool = False) -> None:
        super().__init__(headroom, min_gain_s, recent_s, defer, estimates, margin, refresh_s,
                         progress_s, quantile, rest, rekey)
