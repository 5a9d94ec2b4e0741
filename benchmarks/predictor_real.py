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
features), and ``bound``: ``gbm`` told, beside every feature, the true mean log total time
of the test trajectory's prompt over its runs (what knowing the prompt exactly is worth).

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

DESIGNS = ("shrinkage", "linear", "boost", "gbm", "gbm_no_prompt", "bound")


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


def score(p: Predictor, test: list[TrajRecord], aware: dict, bound_of=None) -> dict:
    """Per tool decision of ``test``: (prompt, |log err| of p, static, reward-aware,
    inside p10-p90)."""
    rows = []
    for d, x in replay(p, test):
        if d.name == REWARD:
            continue
        truth = math.log(max(d.remaining_s, 1e-3))
        static = math.log(p.static_remaining(d.task, d.turn))
        if bound_of is not None:
            m = float(bound_of(np.concatenate([x, [bound_of.prompt_mean[d.key]]])))
            q = (math.nan, math.exp(m), math.nan)  # a median only: no coverage
        else:
            qq = p.remaining(d.key)
            q = (qq.p10, qq.p50, qq.p90)
        rows.append((prompt_of(test[d.key]), abs(math.log(q[1]) - truth), abs(static - truth),
                     abs(_aware(aware, d.task, d.turn, False, static) - truth),
                     q[0] <= d.remaining_s <= q[2] if q[0] == q[0] else math.nan))
    return rows


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
        return float(model.predict(row[None, :])[0])

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
                    out[design] += score(p, test, aware, model)
                    continue
                name = "gbm" if design == "gbm_no_prompt" else design
                p = Predictor.fit(train, name, known if design == "gbm" else {})
                out[design] += score(p, test, aware)
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
          f"{'÷ reward-aware (95% CI)':>28}{'p10-p90':>9}")
    for design, rows in out.items():
        s = ratio_ci(rows, 1, 2, rng)
        w = ratio_ci(rows, 1, 3, rng)
        cover = np.mean([r[4] for r in rows])
        print(f"{design:<15}{np.mean([r[1] for r in rows]):>10.3f}"
              f"{s[0]:>10.3f} ({s[1]:.3f}-{s[2]:.3f}){w[0]:>12.3f} ({w[1]:.3f}-{w[2]:.3f})"
              f"{cover:>9.2f}")


if __name__ == "__main__":
    main()
