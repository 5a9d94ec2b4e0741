"""Accuracy of the remaining-work predictor on a real trace, out of sample by prompt.

    python benchmarks/predictor_real.py --source mini_swe_agent      # the held-out source
    python benchmarks/predictor_real.py --source agentcgroup --repeats 4

Splits the source's prompts into ``--folds`` folds (``--repeats`` times, shuffled by
seed); each design is fitted on the trajectories of the other folds' prompts and scored
on the fold's, replayed on an uncontended clock (every decision point where a trajectory
queues a tool action; the reward, a nominal action in these sources, is left out).
Prints per design: the mean |log error| of remaining trajectory time, its ratio to the
static estimate's (the median log remaining time of the task at the turn index) and to
the reward-aware static's (the same, told whether the queued action is the reward), each
ratio with a 95% interval (bootstrap over prompts, 400 draws), and the share of true
remaining times inside [p10, p90]. ``--fit-on SOURCE`` fits on every trajectory of another
source instead (the folds still choose the test prompts).

Designs: ``shrinkage``, ``linear``, ``boost`` (:mod:`metasched.core.predictor`),
``gbm`` (LightGBM on the same features and the prompt's,
:mod:`metasched.core.prompt_features`), ``gbm_no_prompt`` (LightGBM without the prompt's
features), ``progress`` and ``progress_split`` (:class:`ProgressModel`: ``gbm``'s features
and the run's own progress, its tools so far; ``split``: remaining turns times pace), and
three references: ``bound``, ``gbm`` told, beside every feature, the true mean log total
time of the test trajectory's prompt over its runs (what knowing the prompt exactly is
worth; with one run per prompt, the run's own total); ``bound_turns``, ``progress`` told
the run's true remaining turns (its progress known, not its pace); ``repo_oracle``, the
best constant per repository and log2 turn bin, chosen on the scored runs themselves.
A last column, ``pairs``, scores order rather than level: the share of pairs of
decisions of one RL step close in time (eight nearest on the replay's clock) that the
design's medians order as the true remaining times are ordered.

The sources' traces are not kept in the repository: write them first with
``benchmarks/real_traces.py`` from the public repositories
(``benchmarks/data/real/SOURCES.md`` gives the commands).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

from metasched.core.predictor import REWARD, Predictor, TrajRecord, fit_gbm, records_of, replay
from metasched.core.prompt_features import read_prompts
from metasched.sim.trace import read_trace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_traces import OUT as DATA  # noqa: E402  (where the converter writes them)
from real_traces import produced  # noqa: E402

DESIGNS = ("shrinkage", "linear", "boost", "gbm", "gbm_no_prompt", "progress", "progress_split",
           "bound", "bound_turns", "repo_oracle")
_PROGRESS = {"progress": {}, "progress_split": {"split": True},
             "bound_turns": {"told_turns": True}}


def load(source: str) -> tuple[list[TrajRecord], dict]:
    """A source's records (group ``(step, prompt)``) and prompts."""
    recs = records_of(read_trace(produced(DATA / f"{source}.jsonl.gz")).steps)
    return recs, read_prompts(produced(DATA / f"{source}.prompts.jsonl.gz"))


def prompt_of(r: TrajRecord) -> str:
    return str(r.group[1])


def total_s(r: TrajRecord) -> float:
    """The remaining time at the first decision (the first gap is not counted)."""
    return sum(g + d for _, g, d in r.turns) - r.turns[0][1]


def reward_aware(train: list[TrajRecord]) -> dict:
    """Median log remaining time by (task, turn bucket, queued action is the reward)."""
    by: dict[tuple, list[float]] = {}
    for r in train:
        rem = total_s(r)
        done = -r.turns[0][1]
        for k, (name, g, d) in enumerate(r.turns):
            done += g
            by.setdefault((r.task, min(k, 64), name == REWARD), []).append(
                math.log(max(rem - done, 1e-3)))
            done += d
    return {k: float(np.median(v)) for k, v in by.items()}


def _aware(tab: dict, task: str, turn: int, reward: bool, fallback: float) -> float:
    for k in range(min(turn, 64), -1, -1):
        v = tab.get((task, k, reward))
        if v is not None:
            return v
    return fallback


def score(p: Predictor, test: list[TrajRecord], aware: dict, bound_of=None,
          model: ProgressModel | None = None) -> list[tuple]:
    """Per tool decision of ``test``: (prompt, |log err| of p, static, reward-aware,
    inside p10-p90, predicted log median, true log remaining, RL step, clock time, turn,
    the static estimate's log)
    (``model``: a progress design's model serves the quantiles instead of ``p``)."""
    rows = []
    for d, x in replay(p, test):
        if d.name == REWARD:
            continue
        r = test[d.key]
        truth = math.log(max(d.remaining_s, 1e-3))
        static = math.log(p.static_remaining(d.task, d.turn))
        if bound_of is not None:
            m = float(bound_of(np.concatenate([x, [bound_of.prompt_mean[d.key]]])))
            q = (math.nan, math.exp(m), math.nan)  # a median only: no coverage
        elif model is not None:
            q = model.quantiles(np.concatenate([x, model.row(r, d.turn)]))
        else:
            qq = p.remaining(d.key)
            q = (qq.p10, qq.p50, qq.p90)
        rows.append((prompt_of(r), abs(math.log(q[1]) - truth), abs(static - truth),
                     abs(_aware(aware, d.task, d.turn, False, static) - truth),
                     q[0] <= d.remaining_s <= q[2] if q[0] == q[0] else math.nan,
                     math.log(q[1]), truth, r.group[0], clock_s(r, d.turn), d.turn,
                     static))
    return rows


def clock_s(r: TrajRecord, k: int) -> float:
    """When turn ``k``'s action is queued on the replay's clock (every trajectory from 0)."""
    return sum(g + d for _, g, d in r.turns[:k]) + r.turns[k][1]


_VOCAB = 10  # the most frequent tool names of the training runs, each a feature
_NONE = float("nan")


class ProgressModel:
    """A design that reads the trajectory's own progress (fitted on the training runs
    alone): beside every feature of ``p`` (the ``gbm`` design's), the shares of the
    ``_VOCAB`` training tool names among its turns so far, the turns since each was last
    called, the queued and the last tool (categories), the log of its mean action time
    and generation gap so far, of its last action's and of the gap just ended.

    ``split``: two models, for the log of the remaining turns and for the log of the
    mean time of a remaining turn, summed (remaining time as turns times pace); else one
    for the log of the remaining time. ``told_turns``: the bound that is told the true
    remaining turns. Quantiles: the median's residual quantiles on the last quarter of
    the training runs (fitted on the rest), as the ``boost`` design's.
    """

    def __init__(self, p: Predictor, train: list[TrajRecord], split: bool = False,
                 told_turns: bool = False) -> None:
        from collections import Counter

        names = Counter(n for r in train for n, _, _ in r.turns if n != REWARD)
        self.vocab = {n: i for i, (n, _) in enumerate(names.most_common(_VOCAB))}
        self.split, self.told = split, told_turns
        xs, y_time, y_turns, keys = [], [], [], []
        for d, x in replay(p, train):
            r = train[d.key]
            xs.append(np.concatenate([x, self.row(r, d.turn)]))
            y_time.append(math.log(max(d.remaining_s, 1e-3)))
            y_turns.append(math.log(len(r.turns) - d.turn))
            keys.append(d.key)
        x, y_time, y_turns = np.array(xs), np.array(y_time), np.array(y_turns)
        n_base = len(xs[0]) - self._width()
        self.cat = [n_base - 1, n_base + 2 * len(self.vocab), n_base + 2 * len(self.vocab) + 1]
        fit = np.array(keys) < 0.75 * len(train)
        self._fit(x[fit], y_time[fit], y_turns[fit])
        resid = y_time[~fit] - self.median(x[~fit])
        self.q = np.quantile(resid, [0.1, 0.9])
        self._fit(x, y_time, y_turns)

    def _width(self) -> int:
        return 2 * len(self.vocab) + 6 + int(self.told)

    def _fit(self, x: np.ndarray, y_time: np.ndarray, y_turns: np.ndarray) -> None:
        if self.split:
            self.turns = fit_gbm(x, y_turns, self.cat)
            self.pace = fit_gbm(x, y_time - y_turns, self.cat)
        else:
            self.model = fit_gbm(x, y_time, self.cat)

    def median(self, x: np.ndarray) -> np.ndarray:
        """Log median remaining time of rows ``x``."""
        if self.split:
            return self.turns.predict(x, num_threads=1) + self.pace.predict(x, num_threads=1)
        return self.model.predict(x, num_threads=1)

    def quantiles(self, row: np.ndarray) -> tuple[float, float, float]:
        """p10, p50, p90 of one row's remaining time."""
        m = float(self.median(row[None, :])[0])
        return math.exp(m + self.q[0]), math.exp(m), math.exp(m + self.q[1])

    def row(self, r: TrajRecord, k: int) -> np.ndarray:
        """The progress features of run ``r`` as its turn ``k``'s action is queued."""
        v = len(self.vocab)
        share, since = np.zeros(v), np.full(v, _NONE)
        for j, (n, _, _) in enumerate(r.turns[:k]):
            i = self.vocab.get(n)
            if i is not None:
                share[i] += 1.0 / k
                since[i] = math.log1p(k - 1 - j)
        acts = [d for _, _, d in r.turns[:k] if d > 0]
        gaps = [g for _, g, _ in r.turns[1:k + 1] if g > 0]
        last = r.turns[k - 1] if k else None
        out = [*share, *since, self.vocab.get(r.turns[k][0], v),
               self.vocab.get(last[0], v) if last else v + 1,
               math.log(np.mean(acts)) if acts else _NONE,
               math.log(np.mean(gaps)) if gaps else _NONE,
               math.log(last[2]) if last and last[2] > 0 else _NONE,
               math.log(r.turns[k][1]) if k and r.turns[k][1] > 0 else _NONE]
        if self.told:
            out.append(math.log(len(r.turns) - k))
        return np.array(out, dtype=float)


def repo_oracle(rows: list[tuple], test: list[TrajRecord], prompts: dict) -> list[float]:
    """|log err| of the best constant per (repository, log2 turn bin), chosen on the
    scored runs themselves (in sample: a bound for a per-repository table)."""
    repo = {prompt_of(r): getattr(prompts.get(prompt_of(r)), "repo", None) for r in test}
    by: dict[tuple, list[float]] = {}
    keys = []
    for row in rows:
        k = (repo[row[0]], int(math.log2(row[9] + 1)))
        by.setdefault(k, []).append(row[6])
        keys.append(k)
    med = {k: float(np.median(v)) for k, v in by.items()}
    return [abs(med[k] - row[6]) for k, row in zip(keys, rows, strict=True)]


def fit_bound(train: list[TrajRecord], prompts: dict) -> tuple[Predictor, object]:
    """``gbm`` with one more feature: the prompt's true mean log total time."""
    p = Predictor.fit(train, "gbm", prompts)
    means = _prompt_means(train)
    xs, ys = [], []
    for d, x in replay(p, train):
        xs.append(np.concatenate([x, [means[prompt_of(train[d.key])]]]))
        ys.append(math.log(max(d.remaining_s, 1e-3)))
    xs = np.array(xs)
    model = fit_gbm(xs, np.array(ys), categorical=[xs.shape[1] - 2])

    def predict(row: np.ndarray) -> float:
        return float(model.predict(row[None, :], num_threads=1)[0])

    return p, predict


def _prompt_means(recs: list[TrajRecord]) -> dict[str, float]:
    by: dict[str, list[float]] = {}
    for r in recs:
        by.setdefault(prompt_of(r), []).append(math.log(max(total_s(r), 1e-3)))
    return {k: float(np.mean(v)) for k, v in by.items()}


def ratio_ci(rows: list, col: int, base: int, rng: np.random.Generator) -> tuple[float, ...]:
    """The ratio of mean column ``col`` to mean column ``base`` and its 95% bootstrap
    interval over prompts."""
    prompts = sorted({r[0] for r in rows})
    idx = {p: i for i, p in enumerate(prompts)}
    a = np.zeros(len(prompts))
    b = np.zeros(len(prompts))
    for r in rows:
        a[idx[r[0]]] += r[col]
        b[idx[r[0]]] += r[base]
    draws = []
    for _ in range(400):
        s = rng.integers(0, len(prompts), len(prompts))
        draws.append(a[s].sum() / b[s].sum())
    return a.sum() / b.sum(), *np.percentile(draws, [2.5, 97.5])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", default="mini_swe_agent")
    ap.add_argument("--fit-on", help="fit on every trajectory of this source instead")
    ap.add_argument("--designs", nargs="*", default=list(DESIGNS))
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    recs, prompts = load(a.source)
    other = load(a.fit_on) if a.fit_on else None
    ids = sorted({prompt_of(r) for r in recs})
    out: dict[str, list] = {d: [] for d in a.designs}
    for rep in range(a.repeats):
        order = np.random.default_rng(rep).permutation(len(ids))
        fold_of = {ids[i]: j % a.folds for j, i in enumerate(order)}
        for k in range(a.folds):
            test = [r for r in recs if fold_of[prompt_of(r)] == k]
            train = other[0] if other else [r for r in recs if fold_of[prompt_of(r)] != k]
            known = {**(other[1] if other else {}), **prompts}
            aware = reward_aware(train)
            for design in a.designs:
                if design == "bound":
                    p, model = fit_bound(train, known)
                    model.prompt_mean = [_prompt_means(test)[prompt_of(r)] for r in test]
                    rows = score(p, test, aware, model)
                elif design in _PROGRESS:
                    p = Predictor.fit(train, "gbm", known)
                    rows = score(p, test, aware, model=ProgressModel(p, train, **_PROGRESS[design]))
                elif design == "repo_oracle":
                    rows = score(Predictor.fit(train, "shrinkage"), test, aware)
                    rows = [(r[0], e, *r[2:5], math.nan, *r[6:]) for r, e in
                            zip(rows, repo_oracle(rows, test, known), strict=True)]
                else:
                    name = "gbm" if design == "gbm_no_prompt" else design
                    p = Predictor.fit(train, name, known if design == "gbm" else {})
                    rows = score(p, test, aware)
                out[design] += [(*r[:7], (rep, k, r[7]), *r[8:]) for r in rows]
            print(f"repeat {rep + 1}, fold {k + 1} of {a.folds} done", file=sys.stderr,
                  flush=True)
    rng = np.random.default_rng(0)
    n_dec = len(next(iter(out.values())))
    print(f"source {a.source} ({len(recs)} trajectories, {len(ids)} prompts), fitted on "
          f"{a.fit_on or 'the other folds'}; {a.folds} folds x {a.repeats} repeats; "
          f"{n_dec // a.repeats:,} tool decisions a pass")
    rows0 = next(iter(out.values()))
    print(f"static mean |log err| {np.mean([r[2] for r in rows0]):.3f}; reward-aware static "
          f"{np.mean([r[3] for r in rows0]):.3f}")
    print(f"{'design':<15}{'|log err|':>10}{'÷ static (95% CI)':>26}"
          f"{'÷ reward-aware (95% CI)':>28}{'p10-p90':>9}{'pairs':>7}")
    static_pairs = pairs_right(rows0, static=True)
    for design, rows in out.items():
        s = ratio_ci(rows, 1, 2, rng)
        w = ratio_ci(rows, 1, 3, rng)
        cover = np.mean([r[4] for r in rows])
        print(f"{design:<15}{np.mean([r[1] for r in rows]):>10.3f}"
              f"{s[0]:>10.3f} ({s[1]:.3f}-{s[2]:.3f}){w[0]:>12.3f} ({w[1]:.3f}-{w[2]:.3f})"
              f"{cover:>9.2f}{pairs_right(rows):>7.3f}")
    print(f"pairs: the share of pairs of decisions of one RL step close in time ordered as "
          f"their true remaining times (static estimate: {static_pairs:.3f})")


def pairs_right(rows: list[tuple], static: bool = False) -> float:
    """Pair accuracy (:func:`metasched.core.ranker.pair_accuracy`) of the rows' predicted
    medians (``static``: of the static estimate) within one fold's RL step."""
    from metasched.core.ranker import pair_accuracy

    steps = {k: i for i, k in enumerate(sorted({r[7] for r in rows}))}
    y = np.array([r[6] for r in rows])
    pred = np.array([r[10] if static else r[5] for r in rows])
    if np.isnan(pred).all():
        return math.nan
    return pair_accuracy(pred, y, np.array([steps[r[7]] for r in rows]),
                         np.array([r[8] for r in rows]))

if __name__ == "__main__":
    main()
