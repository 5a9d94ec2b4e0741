"""A learned predictor of remaining work: per running trajectory, its remaining time as
quantiles; per queued action, its duration.

It sees only what a live dispatcher sees when it decides: an action's type (``name``),
the trajectory's task and turn index, the durations it has measured of the
trajectory's own actions and generation gaps, and those of its prompt-group siblings
(GRPO's n responses to one prompt), including the totals of the siblings that finished.

Everything is in log space, where the grouped workload model's latents are normal:

* an observation ``x`` of type ``n`` becomes a standardised residual
  ``r = (log x - mu_n) / sd_n`` (``mu_n``, ``sd_n``: the type's training mean and sd);
* residuals share a prompt effect ``P`` and a trajectory effect ``T``,
  ``r = P + T + E`` with variances ``v_prompt``, ``v_traj``, ``v_noise`` (method of
  moments on the training residuals); the empirical-Bayes posterior mean of ``P + T``
  given the siblings' and the trajectory's own residuals is ``effect``;
* a queued action's duration is ``exp(mu_n + sd_n * effect)``.

Remaining trajectory time has these designs (``design``):

* ``"reward_static"``: the static estimate told whether the queued action is the reward
  (the median log remaining time of the task at the turn index over the decisions
  queueing a tool, and over those queueing the reward); the baseline a learned design
  must beat, since a trajectory queueing its reward has only the reward left.

* ``"shrinkage"``: the static estimate (mean log remaining time of the task at this
  turn index) shifted by ``sd_bar * effect``, ``sd_bar`` the types' duration-weighted sd;
  nothing is fitted beyond the type statistics and the variance components.
* ``"linear"``: ridge regression, per turn index, of log remaining time on the static
  estimate, the
  posterior effects, the finished siblings' totals and turn counts and log turn index.

The ``boost`` design fits LightGBM's gradient-boosted trees (the L1 objective) for the
median on every feature; ``gbm`` fits them on those and the prompt's
(:mod:`metasched.core.prompt_features`: what is known of it before its first turn). Both
need the ``predict`` extra; ``shrinkage`` and ``linear`` need numpy alone.

Quantiles (p10, p50, p90) add the design's training residual quantiles at the turn
index (bucketed). Both designs are fitted by replaying training trajectories through
the same online code that serves predictions (:func:`replay`), on an uncontended clock
(a turn's action starts when its generation gap ends). A trajectory's clock starts
when its first action is queued: the first generation gap (overlapping the sandbox's
start-up, and absent from recorded traces) is neither evidence nor remaining time.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np

from metasched.core.predictor_stats import (
    GEN,
    QUANTILES,
    components,
    fit_gbm,
    lightgbm,
    quantile_table,
    ridge,
    table,
)
from metasched.core.prompt_features import PromptFeaturizer, PromptInfo

DESIGNS = ("reward_static", "shrinkage", "linear", "boost", "gbm")
REWARD = "reward"  # the type name of a trajectory's final reward action
_K_CAP = 64  # turn indices above this share the last bucket
_FEATURES = ("static", "effect", "prompt_effect", "sib_total", "sib_turns", "sib_done",
             "log_turn", "own_n", "sib_turns_all")
# The boost design's further features: the queued action is the reward (the last
# turn), its type's mean log duration, log elapsed time, the trajectory's mean residual.
_EXTRA = ("reward", "type_mu", "log_elapsed", "own_resid")
_HOLDOUT = 0.25  # the boost design's share of training trajectories kept for its quantiles
_MIN_FIT = 200  # fewest training points a turn-index bucket needs for coefficients of its own


@dataclass(frozen=True, slots=True)
class TrajRecord:
    """A finished trajectory as training data: its task, its prompt group key (None:
    unknown) and its turns as ``(action name, generation gap s, action s)``."""

    task: str
    group: object
    turns: tuple[tuple[str, float, float], ...]


@dataclass(frozen=True, slots=True)
class Decision:
    """One decision point of :func:`replay`: trajectory ``key`` queues its turn ``turn``
    (action ``name``) at clock time ``t``; ``remaining_s`` and ``action_s`` are the truth."""

    key: int
    task: str
    turn: int
    name: str
    t: float
    remaining_s: float
    action_s: float


def group_of(traj) -> object:
    """The group key of a live trajectory: ``(step, prompt)``, None without a prompt."""
    return None if traj.prompt is None else (traj.step, traj.prompt)


def records_of(steps: Iterable[Iterable]) -> list[TrajRecord]:
    """Training records of RL steps of trajectory specs (anything with ``task``,
    ``prompt`` and ``turns`` of :class:`~metasched.core.actions.Turn`); the group key is
    ``(step index, prompt)``. Turns done together count as serial here."""
    out = []
    for i, step in enumerate(steps):
        for ts in step:
            group = None if ts.prompt is None else (i, ts.prompt)
            out.append(TrajRecord(ts.task, group, tuple(
                (t.action.name, float(t.gen_s), float(t.action.true_s)) for t in ts.turns)))
    return out


def records_of_trace(lines: Iterable) -> list[TrajRecord]:
    """Training records of a recorded trace's lines (``metasched.sim.trace.scan_trace``
    of a simulated recording or a live dispatcher's action log): each action line's
    measured run time, gap and turn, grouped by trajectory; the group key is
    ``(step, prompt)`` (None without a prompt)."""
    by_traj: dict[tuple, list] = {}
    for rec in lines:
        m = rec.measured
        if rec.action is None or m is None or m.trajectory is None:
            continue
        by_traj.setdefault((m.step, m.trajectory), []).append(
            (m.turn, rec.action.spec.name, m.gap_s or 0.0, m.run_s, rec.action.task, m.prompt))
    out = []
    for (step, _), acts in by_traj.items():
        acts.sort(key=lambda a: a[0])
        prompt = acts[0][5]
        out.append(TrajRecord(acts[0][4], None if prompt is None else (step, prompt),
                              tuple((n, g, r) for _, n, g, r, _, _ in acts)))
    return out


@dataclass(slots=True)
class _Traj:
    task: str
    group: object
    turn: int = 0
    elapsed_s: float = 0.0
    n: int = 0
    r_sum: float = 0.0
    done: bool = False
    name: str = ""  # the type of the action it has queued last


@dataclass(slots=True)
class Quantiles:
    """Remaining-time quantiles in seconds."""

    p10: float
    p50: float
    p90: float


@dataclass(slots=True)
class Predictor:
    """The fitted model plus its online state (see the module docstring). Build it with
    :meth:`fit`; feed it with :meth:`observe` / :meth:`observe_action` and
    :meth:`finish`; ask :meth:`remaining` and :meth:`duration`."""

    design: str
    mu: dict[str, float]
    sd: dict[str, float]
    v_prompt: float
    v_traj: float
    v_noise: float
    sd_bar: float
    static: dict[str, np.ndarray]  # per task: median log remaining per turn bucket
    turns_tab: dict[str, np.ndarray]  # per task: mean log(total turns + 1) given turn >= k
    task_total: dict[str, tuple[float, float]]  # per task: mean log total s, log(turns+1)
    coef: np.ndarray = field(default_factory=lambda: np.zeros((1, len(_FEATURES) + 1)))
    resid_q: np.ndarray = field(default_factory=lambda: np.zeros((1, 3)))
    boost: object | None = None  # the boost and gbm designs' LightGBM booster
    # reward_static: per task, the median log remaining per turn bucket queueing a tool,
    # and queueing the reward
    aware: dict[str, tuple[np.ndarray, float]] = field(default_factory=dict)
    featurizer: PromptFeaturizer | None = None  # the gbm design's prompt features
    prompts: dict[str, PromptInfo] = field(default_factory=dict)
    trajs: dict[object, _Traj] = field(default_factory=dict)
    groups: dict[object, list[object]] = field(default_factory=dict)
    finished: dict[object, list[tuple[float, float]]] = field(default_factory=dict)

    # ------------------------------------------------------------------ online state

    def _traj(self, key: object, task: str, group: object) -> _Traj:
        tr = self.trajs.get(key)
        if tr is None:
            tr = self.trajs[key] = _Traj(task, group)
            if group is not None:
                self.groups.setdefault(group, []).append(key)
        return tr

    def observe(self, key: object, task: str, group: object, name: str, seconds: float,
                *, new_turn: bool = False) -> None:
        """Learn a measured action (or a generation gap, ``name=GEN``) of trajectory
        ``key``; ``new_turn``: it opens one of the trajectory's turns."""
        tr = self._traj(key, task, group)
        tr.elapsed_s += max(0.0, seconds)
        if new_turn:
            tr.turn += 1
        mu = self.mu.get(name)
        if mu is None or not seconds > 0.0:
            return
        tr.r_sum += (math.log(seconds) - mu) / self.sd[name]
        tr.n += 1

    def observe_action(self, a, run_s: float) -> None:
        """Learn from action ``a`` (a :class:`~metasched.core.actions.Action`) having
        run ``run_s`` seconds (the cost model's ``learn`` calls this)."""
        traj = a.traj
        if traj is None:
            return
        self.observe(traj.id, traj.task, group_of(traj), a.spec.name, run_s)

    def observe_gap(self, traj, gap_s: float) -> None:
        """Learn a generation gap of ``traj`` (a
        :class:`~metasched.core.actions.Trajectory`) that has just ended."""
        # The first gap overlaps the sandbox's start-up, and recorded traces lack it: a
        # trajectory's clock starts when its first action is queued.
        self.observe(traj.id, traj.task, group_of(traj), GEN, gap_s if traj.turn else 0.0)
        self.trajs[traj.id].turn = traj.turn

    def finish(self, key: object, turns: int | None = None) -> None:
        """Trajectory ``key`` ended after ``turns`` turns (None: as counted): its total
        becomes its siblings' evidence."""
        tr = self.trajs.get(key)
        if tr is None or tr.done:
            return
        tr.done = True
        if turns is not None:
            tr.turn = turns
        if tr.group is not None:
            mt, mk = self.task_total.get(tr.task, (0.0, 0.0))
            self.finished.setdefault(tr.group, []).append(
                (math.log(max(tr.elapsed_s, 1e-3)) - mt, math.log(tr.turn + 1.0) - mk))

    def close(self, key: object, turns: int | None = None) -> None:
        """:meth:`finish`, then forget the trajectory's state unless it is in a group
        (its siblings read it): a long-running dispatcher's state stays bounded."""
        self.finish(key, turns)
        tr = self.trajs.get(key)
        if tr is not None and tr.group is None:
            del self.trajs[key]

    def forget_group(self, group: object) -> None:
        """Drop a finished RL step's group (its state is no longer needed)."""
        for key in self.groups.pop(group, []):
            self.trajs.pop(key, None)
        self.finished.pop(group, None)

    # ------------------------------------------------------------------ predictions

    def _effects(self, tr: _Traj, key: object) -> tuple[float, float, float]:
        """Posterior means of ``P`` (siblings only) and ``P + T`` (with own), and the
        posterior variance of ``P + T``."""
        vp, vt, ve = self.v_prompt, self.v_traj, self.v_noise
        prec, num = 1.0 / vp if vp > 0 else 1e12, 0.0
        for sk in self.groups.get(tr.group, ()) if tr.group is not None else ():
            s = self.trajs[sk]
            if sk == key or s.n == 0:
                continue
            v = vt + ve / s.n
            prec += 1.0 / v
            num += (s.r_sum / s.n) / v
        m_p, v_p = num / prec, 1.0 / prec
        prior_v = v_p + vt
        if tr.n == 0:
            return m_p, m_p, prior_v
        noise = ve / tr.n
        w = prior_v / (prior_v + noise)
        return m_p, m_p + w * (tr.r_sum / tr.n - m_p), prior_v * noise / (prior_v + noise)

    def _bucket(self, task: str, turn: int) -> int:
        return min(turn, len(self.static[task]) - 1)

    def features(self, key: object) -> np.ndarray:
        """The decision-time features of trajectory ``key`` (``_FEATURES``, then
        ``_EXTRA``)."""
        tr = self.trajs[key]
        table = self.static.get(tr.task)
        static = float(table[self._bucket(tr.task, tr.turn)]) if table is not None else 0.0
        m_p, eff, _ = self._effects(tr, key)
        fin = self.finished.get(tr.group, ()) if tr.group is not None else ()
        n_f = len(fin)
        sib_total = sum(f[0] for f in fin) / (n_f + 1.0)  # shrunk toward the task mean
        sib_turns = sum(f[1] for f in fin) / (n_f + 1.0)
        sibs = [s for s in self.groups.get(tr.group, ()) if s != key] if tr.group else []
        # Every sibling's turn count imputed: a finished one's as counted, a running
        # one's as the static expectation given the turns it has done (a censored mean).
        # (Running siblings' measured seconds so far are left out: they add nothing on
        # held-out seeds and make the weights unstable.)
        it = 0.0
        mk = self.task_total.get(tr.task, (0.0, 0.0))[1]
        for sk in sibs:
            s = self.trajs[sk]
            tt = self.turns_tab.get(s.task)
            if s.done or tt is None:
                it += math.log(s.turn + 1.0) - mk
            else:
                it += float(tt[min(s.turn, len(tt) - 1)]) - mk
        x = np.array([static, eff, m_p, sib_total, sib_turns, n_f / max(1, len(sibs)),
                      math.log1p(tr.turn), math.log1p(tr.n), it / (len(sibs) + 1.0),
                      float(tr.name == REWARD), self.mu.get(tr.name, 0.0),
                      math.log1p(tr.elapsed_s), tr.r_sum / tr.n if tr.n else 0.0])
        if self.featurizer is None:
            return x
        prompt = str(tr.group[1]) if isinstance(tr.group, tuple) else ""
        return np.concatenate([x, self.featurizer.row(prompt, self.prompts.get(prompt))])

    def _log_median(self, x: np.ndarray, task: str) -> float:
        if self.design == "reward_static":
            tool, reward = self.aware.get(task, (np.zeros(1), 0.0))
            return reward if x[9] > 0.5 else float(tool[min(self._bucket_of(x), len(tool) - 1)])
        if self.design == "shrinkage":
            return float(x[0] + self.sd_bar * x[1])
        if self.design in ("boost", "gbm"):
            # One thread: prediction does not take the fit's num_threads, and on a busy
            # machine more threads spin for milliseconds on one row.
            return float(self.boost.predict(x[None, :], num_threads=1)[0])
        c = self.coef[min(self._bucket_of(x), len(self.coef) - 1)]
        return float(c[0] + c[1:] @ x[:len(_FEATURES)])

    def _bucket_of(self, x: np.ndarray) -> int:
        return int(round(math.expm1(x[6])))

    def remaining(self, key: object, task: str | None = None, group: object = None,
                  name: str | None = None) -> Quantiles:
        """Remaining-time quantiles of trajectory ``key`` (``task``/``group`` register
        a trajectory not yet observed; ``name``: the type of the action it queues now,
        else the last one given)."""
        if key not in self.trajs:
            self._traj(key, task if task is not None else next(iter(self.static)), group)
        tr = self.trajs[key]
        if name is not None:
            tr.name = name
        x = self.features(key)
        m = self._log_median(x, tr.task)
        q = self.resid_q[self._q_row(tr)]
        return Quantiles(*(math.exp(m + d) for d in q))

    def _q_row(self, tr: _Traj) -> int:
        """The row of ``resid_q`` for a trajectory (boost: row 0 is the reward's)."""
        if self.design in ("reward_static", "boost", "gbm"):
            return 0 if tr.name == REWARD else min(tr.turn + 1, len(self.resid_q) - 1)
        return min(tr.turn, len(self.resid_q) - 1)

    def remaining_of(self, traj, name: str | None = None) -> Quantiles:
        """:meth:`remaining` of a :class:`~metasched.core.actions.Trajectory` whose
        current turn has been submitted (``traj.turn`` counts it); ``name``: the type of
        the action it queues."""
        tr = self._traj(traj.id, traj.task, group_of(traj))
        tr.turn = max(0, traj.turn - 1)
        return self.remaining(traj.id, name=name)

    def duration(self, key: object, name: str, task: str | None = None,
                 group: object = None) -> float:
        """Median duration (s) of trajectory ``key``'s next action of type ``name``
        (the type's static estimate where the type was never seen in training)."""
        if key not in self.trajs:
            self._traj(key, task if task is not None else next(iter(self.static)), group)
        mu = self.mu.get(name)
        if mu is None:
            return math.nan
        tr = self.trajs[key]
        return math.exp(mu + self.sd[name] * self._effects(tr, key)[1])

    def static_duration(self, name: str) -> float:
        """The type-level estimate of an action (its training geometric mean)."""
        return math.exp(self.mu[name]) if name in self.mu else math.nan

    def static_remaining(self, task: str, turn: int) -> float:
        """The type-level estimate of remaining time at turn ``turn`` (geometric mean)."""
        return math.exp(float(self.static[task][self._bucket(task, turn)]))

    def add_prompts(self, prompts: Mapping[str, PromptInfo]) -> None:
        """Tell the predictor about prompts (by id) it will be asked about."""
        self.prompts.update(prompts)

    def reset(self) -> None:
        """Forget all online state (keep the fitted model)."""
        self.trajs.clear(), self.groups.clear(), self.finished.clear()

    # ------------------------------------------------------------------ training

    @classmethod
    def fit(cls, records: list[TrajRecord], design: str = "linear",
            prompts: Mapping[str, PromptInfo] | None = None) -> Predictor:
        """Fit to finished trajectories (see the module docstring); ``prompts``: what is
        known of the prompts by id (the ``gbm`` design reads them; a prompt it is later
        asked about is looked up there too, see :meth:`add_prompts`)."""
        if design not in DESIGNS:
            raise ValueError(f"design must be one of {', '.join(DESIGNS)} (got {design!r})")
        if not records:
            raise ValueError("no training trajectories")
        if design in ("boost", "gbm"):
            lightgbm()  # missing: one line now, not after the replay
        logs: dict[str, list[float]] = {}
        for r in records:
            for k, (name, gen, dur) in enumerate(r.turns):
                if gen > 0 and k:
                    logs.setdefault(GEN, []).append(math.log(gen))
                if dur > 0:
                    logs.setdefault(name, []).append(math.log(dur))
        mu = {n: float(np.mean(v)) for n, v in logs.items()}
        sd = {n: max(float(np.std(v)), 1e-3) for n, v in logs.items()}
        weight = {n: math.exp(mu[n] + sd[n] ** 2 / 2) * len(v) for n, v in logs.items()}
        sd_bar = sum(sd[n] * w for n, w in weight.items()) / sum(weight.values())
        vp, vt = components(records, mu, sd)
        task_total: dict[str, tuple[float, float]] = {}
        rem: dict[str, dict[int, list[float]]] = {}
        turns_by_k: dict[str, dict[int, list[float]]] = {}
        for r in records:
            tot = sum(g + d for _, g, d in r.turns) - r.turns[0][1]
            prev = task_total.setdefault(r.task, (0.0, 0.0, 0))
            task_total[r.task] = (prev[0] + math.log(max(tot, 1e-3)),
                                  prev[1] + math.log(len(r.turns) + 1.0), prev[2] + 1)
            done = -r.turns[0][1]
            for k, (_, g, d) in enumerate(r.turns):
                done += g
                rem.setdefault(r.task, {}).setdefault(min(k, _K_CAP), []).append(
                    math.log(max(tot - done, 1e-3)))
                turns_by_k.setdefault(r.task, {}).setdefault(min(k, _K_CAP), []).append(
                    math.log(len(r.turns) + 1.0))
                done += d
        task_total = {t: (a / n, b / n) for t, (a, b, n) in task_total.items()}
        static = {t: table(by_k, np.median) for t, by_k in rem.items()}
        turns_tab = {t: table(by_k, np.mean) for t, by_k in turns_by_k.items()}
        p = cls(design, mu, sd, vp, vt, max(1.0 - vp - vt, 0.05), sd_bar, static, turns_tab,
                task_total)
        if design == "gbm":
            p.prompts = dict(prompts or {})
            seen = {str(r.group[1]) for r in records if isinstance(r.group, tuple)}
            p.featurizer = PromptFeaturizer.fit(
                [p.prompts[k] for k in sorted(seen) if k in p.prompts] or [PromptInfo()])
        x, y, k, keys, tasks = [], [], [], [], []
        for d, feats in replay(p, records):
            x.append(feats), y.append(math.log(max(d.remaining_s, 1e-3)))
            k.append(p._bucket(d.task, d.turn)), keys.append(d.key), tasks.append(d.task)
        x, y, k = np.array(x), np.array(y), np.array(k)
        if design == "reward_static":
            p._fit_aware(x, y, np.array(tasks))
            p.reset()
            return p
        if design in ("boost", "gbm"):
            p._fit_boost(x, y, np.array(keys), len(records))
            p.reset()
            return p
        if design == "linear":
            a = np.column_stack([np.ones(len(x)), x[:, :len(_FEATURES)]])
            kk = np.minimum(np.rint(np.expm1(x[:, 6])).astype(int), _K_CAP)
            pooled = ridge(a, y)
            rows = []
            for b in range(int(kk.max()) + 1):
                m = kk == b
                if m.sum() < _MIN_FIT:
                    break
                rows.append(ridge(a[m], y[m]))
            p.coef = np.array(rows + [pooled])
            resid = y - np.einsum("ij,ij->i", a, p.coef[np.minimum(kk, len(rows))])
        else:
            resid = y - (x[:, 0] + sd_bar * x[:, 1])
        p.resid_q = quantile_table(resid, k)
        p.reset()
        return p

    def _fit_aware(self, x: np.ndarray, y: np.ndarray, tasks: np.ndarray) -> None:
        """The reward_static design: its tables, and quantile offsets as ``boost``'s
        (the reward's apart, the others' by turn index; on the training decisions: a
        median per cell overfits little)."""
        reward = x[:, 9] > 0.5
        turn = np.minimum(np.rint(np.expm1(x[:, 6])).astype(int), _K_CAP)
        for t in np.unique(tasks):
            tool, rew = (tasks == t) & ~reward, (tasks == t) & reward
            by_k = {int(b): list(y[tool & (turn == b)]) for b in np.unique(turn[tool])}
            tab = table(by_k, np.median) if by_k else np.zeros(1)
            self.aware[str(t)] = (tab, float(np.median(y[rew])) if rew.any() else tab[-1])
        pred = np.array([self._log_median(r, str(t)) for r, t in zip(x, tasks, strict=True)])
        self.resid_q = quantile_table(y - pred, np.where(reward, 0, turn + 1))

    def _fit_boost(self, x: np.ndarray, y: np.ndarray, keys: np.ndarray, n: int) -> None:
        """The boost design: boosted trees for the median of log remaining time on
        every feature, fitted to the decisions of the first ``1 - _HOLDOUT`` of the
        trajectories; the quantile offsets are the residuals' on the rest (the
        reward's apart from the others', by turn index): out-of-sample, as served."""
        fit = keys < (1.0 - _HOLDOUT) * n if n >= 8 else np.ones(len(y), bool)
        held = ~fit if (~fit).any() else fit
        categorical = [x.shape[1] - 1] if self.design == "gbm" else []  # the repository
        self.boost = fit_gbm(x[fit], y[fit], categorical)
        resid = y[held] - self.boost.predict(x[held])
        turn = np.rint(np.expm1(x[held, 6])).astype(int)
        row = np.where(x[held, 9] > 0.5, 0, np.minimum(turn, _K_CAP) + 1)
        self.resid_q = quantile_table(resid, row)


def replay(p: Predictor, records: list[TrajRecord]) -> Iterator[tuple[Decision, np.ndarray]]:
    """Run ``records`` through ``p``'s online state on an uncontended clock (every
    trajectory starts at 0; a turn's action is queued when its gap ends and runs its
    duration) and yield each decision point with its features, computed before the
    action runs. ``p``'s online state is reset first."""
    p.reset()
    events: list[tuple[float, int, int, int]] = []  # (t, order, record, turn)
    for i, r in enumerate(records):
        t = 0.0
        for k, (_, g, d) in enumerate(r.turns):
            events.append((t + g, 1, i, k))  # gap ends: observe it, then decide
            t += g + d
            events.append((t, 0, i, k))  # action ends: observe it
    events.sort()
    for _, kind, i, k in events:
        r = records[i]
        name, g, d = r.turns[k]
        if kind == 1:
            p.observe(i, r.task, r.group, GEN, g if k else 0.0, new_turn=k > 0)
            p.trajs[i].turn = k
            p.trajs[i].name = name
            rem = d + sum(gg + dd for _, gg, dd in r.turns[k + 1:])
            yield (Decision(i, r.task, k, name, 0.0, rem, d), p.features(i))
        else:
            p.observe(i, r.task, r.group, name, d)
            if k == len(r.turns) - 1:
                p.trajs[i].turn = k + 1
                p.finish(i)


__all__ = ["DESIGNS", "GEN", "QUANTILES", "REWARD", "Decision", "Predictor", "Quantiles",
           "TrajRecord", "fit_gbm", "group_of", "records_of", "records_of_trace", "replay"]
