"""The predictor's trees and ranker against other libraries' on the same features, out of
sample (the hand-written numpy ones they replaced were measured here too, at commit
9dc0c60: docs/benchmarks/quality.md).

    python benchmarks/predictor_libraries.py                      # profiles and agentcgroup
    python benchmarks/predictor_libraries.py --profiles swe_grouped --no-real

Trees (the median of log remaining time, what the ``boost`` design serves): each fitter is
given the same rows, the predictor's decision-time features from replaying training
trajectories (:func:`metasched.core.predictor.replay`), and scored on rows replayed from
trajectories it never saw: a simulated profile's test seed (``--test-seed``; fitted on
``--train-seed``), and the ``agentcgroup`` real source 5-fold by prompt (the held-out
source is never read). Printed per source and fitter: the mean |log error| of remaining
time and its ratio to the static estimate's, the fit's wall time, and the prediction's
per row in a batch and for one row alone (the dispatcher predicts one row a decision).

Ranker (``learned_priority``'s score): the same pairs (decisions of one RL step close in
time), fitted by each fitter on the training seed and scored by pair accuracy on the
test seed, with fit and one-row score times.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from metasched.core.predictor import REWARD, Predictor, TrajRecord, replay

sys.path.insert(0, str(Path(__file__).resolve().parent))
from predictor_accuracy import PROFILES, sample  # noqa: E402
from predictor_real import load, prompt_of  # noqa: E402

Fitter = Callable[[np.ndarray, np.ndarray], Callable[[np.ndarray], np.ndarray]]


def _lgb(params: dict, rounds: int) -> Fitter:
    def fit(x: np.ndarray, y: np.ndarray):
        import lightgbm as lgb

        base = {"seed": 0, "deterministic": True, "num_threads": 1, "verbose": -1}
        model = lgb.train({**base, **params}, lgb.Dataset(x, y), num_boost_round=rounds)
        # Prediction does not take the training's num_threads: on a busy machine more
        # threads spin for milliseconds on one row.
        return lambda xs: model.predict(xs, num_threads=1)
    return fit


def _hgb(x: np.ndarray, y: np.ndarray):
    from sklearn.ensemble import HistGradientBoostingRegressor

    m = HistGradientBoostingRegressor(loss="quantile", quantile=0.5, max_iter=150,
                                      learning_rate=0.1, max_depth=4, max_leaf_nodes=16,
                                      min_samples_leaf=50, max_bins=32,
                                      early_stopping=False, random_state=0)
    m.fit(x, y)

    def predict(xs: np.ndarray) -> np.ndarray:
        from threadpoolctl import threadpool_limits

        with threadpool_limits(1):  # one row on more threads spins on a busy machine
            return m.predict(xs)
    return predict


# LightGBM at the size of the numpy booster it replaced (150 depth-4 trees, rate 0.1, 50
# rows a leaf, 32 bins, 70% of rows a tree), and as the predictor fits it (L1, 300 trees
# of 15 leaves: metasched.core.predictor_stats.fit_gbm).
FITTERS: dict[str, Fitter] = {
    "lgb_quantile": _lgb({"objective": "quantile", "alpha": 0.5, "learning_rate": 0.1,
                          "num_leaves": 16, "max_depth": 4, "min_data_in_leaf": 50,
                          "max_bin": 32, "bagging_fraction": 0.7, "bagging_freq": 1}, 150),
    "lgb_l1": _lgb({"objective": "l1", "learning_rate": 0.05, "num_leaves": 15,
                    "min_data_in_leaf": 40, "feature_fraction": 0.8, "bagging_fraction": 0.8,
                    "bagging_freq": 1, "lambda_l2": 1.0}, 300),
    "sklearn_hgb": _hgb,
}


def rows_of(p: Predictor, records: list[TrajRecord], tools_only: bool) -> tuple[np.ndarray, ...]:
    """Per decision of a replay of ``records`` through ``p``: features, log true remaining
    time, the static estimate's log, the prompt (``tools_only``: the reward's left out)."""
    x, y, s, g = [], [], [], []
    for d, f in replay(p, records):
        if tools_only and d.name == REWARD:
            continue
        x.append(f), y.append(math.log(max(d.remaining_s, 1e-3)))
        s.append(math.log(p.static_remaining(d.task, d.turn)))
        grp = records[d.key].group
        g.append(str(grp[1]) if isinstance(grp, tuple) else "")
    return np.array(x), np.array(y), np.array(s), np.array(g)


def time_fitter(fit: Fitter, x: np.ndarray, y: np.ndarray, xt: np.ndarray) -> dict:
    """Fit, predict ``xt``, and time both and a one-row prediction."""
    t0 = time.perf_counter()
    predict = fit(x, y)
    t1 = time.perf_counter()
    pred = predict(xt)
    t2 = time.perf_counter()
    one = [time.perf_counter()]
    for i in range(min(300, len(xt))):
        predict(xt[i:i + 1])
        one.append(time.perf_counter())
    return {"pred": pred, "fit_s": t1 - t0, "batch_us": 1e6 * (t2 - t1) / len(xt),
            "one_us": 1e6 * float(np.median(np.diff(one)))}


def trees_on_profile(name: str, a: argparse.Namespace) -> None:
    train, test = sample(name, a.train_trajectories, a.train_seed), \
        sample(name, a.test_trajectories, a.test_seed)
    p = Predictor.fit(train, "shrinkage")  # the type statistics every design shares
    x, y, _, _ = rows_of(p, train, False)
    xt, yt, st, _ = rows_of(p, test, False)
    static = np.abs(st - yt).mean()
    for fitter in a.fitters:
        r = time_fitter(FITTERS[fitter], x, y, xt)
        err = np.abs(r["pred"] - yt).mean()
        print(f"| {name} | {fitter} | {len(x):,} / {len(xt):,} | {err:.3f} ({err / static:.3f}) "
              f"| {r['fit_s']:.2f} | {r['batch_us']:.2f} | {r['one_us']:.0f} |", flush=True)


def trees_on_real(source: str, a: argparse.Namespace) -> None:
    recs, _ = load(source)
    ids = sorted({prompt_of(r) for r in recs})
    fold_of = {ids[i]: j % 5 for j, i in enumerate(np.random.default_rng(0).permutation(len(ids)))}
    err: dict[str, list[float]] = {f: [] for f in a.fitters}
    times: dict[str, list[dict]] = {f: [] for f in a.fitters}
    static: list[float] = []
    prompts: list[str] = []
    n_fit = 0
    for k in range(5):
        test = [r for r in recs if fold_of[prompt_of(r)] == k]
        train = [r for r in recs if fold_of[prompt_of(r)] != k]
        p = Predictor.fit(train, "shrinkage")
        x, y, _, _ = rows_of(p, train, False)
        xt, yt, st, gt = rows_of(p, test, True)
        static += list(np.abs(st - yt))
        prompts += list(gt)
        n_fit += len(x)
        for fitter in a.fitters:
            r = time_fitter(FITTERS[fitter], x, y, xt)
            err[fitter] += list(np.abs(r["pred"] - yt))
            times[fitter].append(r)
    s = float(np.mean(static))
    first = a.fitters[0]
    for fitter in a.fitters:
        e = float(np.mean(err[fitter]))
        t = times[fitter]
        lo, hi = _ratio_ci(np.array(err[fitter]), np.array(err[first]), np.array(prompts))
        print(f"| {source} (5 folds by prompt) | {fitter} | {n_fit // 5:,} / {len(static):,} | "
              f"{e:.3f} ({e / s:.3f}; ÷ {first} {e / np.mean(err[first]):.3f}, 95% CI "
              f"{lo:.3f}–{hi:.3f}) | {np.mean([r['fit_s'] for r in t]):.2f} | "
              f"{np.mean([r['batch_us'] for r in t]):.2f} | "
              f"{np.median([r['one_us'] for r in t]):.0f} |", flush=True)


def _ratio_ci(a: np.ndarray, b: np.ndarray, groups: np.ndarray) -> tuple[float, float]:
    """95% bootstrap interval (over ``groups``, 1,000 draws) of mean ``a`` ÷ mean ``b``."""
    keys, inv = np.unique(groups, return_inverse=True)
    sa, sb = np.bincount(inv, a, len(keys)), np.bincount(inv, b, len(keys))
    rng = np.random.default_rng(0)
    draws = [sa[i].sum() / sb[i].sum()
             for i in rng.integers(0, len(keys), (1000, len(keys)))]
    return tuple(np.percentile(draws, [2.5, 97.5]))


def _rank_logistic(x, y, step, t):
    from metasched.core.ranker import fit_ranker_rows

    r = fit_ranker_rows(x, y, step, t)
    return lambda xs: (xs - r.mean) / r.sd @ r.w


def _rank_lgb(objective: str):
    def fit(x, y, step, t):
        import lightgbm as lgb

        # Queries: runs of 16 decisions of one RL step in time order; labels: the rank of
        # remaining time within the query (the pairs the other rankers learn from).
        order = np.lexsort((t, step))
        qid = np.zeros(len(y), dtype=int)
        q, n = 0, 0
        for k, i in enumerate(order):
            if k and (step[i] != step[order[k - 1]] or n == 16):
                q, n = q + 1, 0
            qid[i], n = q, n + 1
        o = np.lexsort((t, qid))
        lab = np.zeros(len(y), dtype=int)
        for g in np.unique(qid):
            m = o[qid[o] == g]
            lab[m] = np.argsort(np.argsort(y[m]))
        params = {"objective": objective, "learning_rate": 0.05, "num_leaves": 15,
                  "min_data_in_leaf": 40, "seed": 0, "deterministic": True, "num_threads": 1,
                  "verbose": -1, "label_gain": list(range(17))}
        data = lgb.Dataset(x[o], lab[o], group=np.bincount(qid[o])[np.unique(qid[o])])
        model = lgb.train(params, data, num_boost_round=200)
        return lambda xs: model.predict(xs, num_threads=1)
    return fit


RANKERS = {"sklearn_logistic": _rank_logistic,
           "lgb_lambdarank": _rank_lgb("lambdarank"), "lgb_rank_xendcg": _rank_lgb("rank_xendcg")}


def rankers_on_profile(name: str, a: argparse.Namespace) -> None:
    from metasched.core.ranker import pair_accuracy, rows

    train, test = sample(name, a.train_trajectories, a.train_seed), \
        sample(name, a.test_trajectories, a.test_seed)
    p = Predictor.fit(train, "boost")
    x, y, step, t = rows(p, train)
    xt, yt, stept, tt = rows(p, test)
    static = pair_accuracy(xt[:, 0], yt, stept, tt)
    median = pair_accuracy(xt[:, -2], yt, stept, tt)
    print(f"| {name} | static estimate | {static:.3f} | | |\n"
          f"| {name} | predictor's median | {median:.3f} | | |", flush=True)
    for ranker in a.rankers:
        t0 = time.perf_counter()
        score = RANKERS[ranker](x, y, step, t)
        t1 = time.perf_counter()
        acc = pair_accuracy(score(xt), yt, stept, tt)
        one = [time.perf_counter()]
        for i in range(300):
            score(xt[i:i + 1])
            one.append(time.perf_counter())
        print(f"| {name} | {ranker} | {acc:.3f} | {t1 - t0:.2f} | "
              f"{1e6 * float(np.median(np.diff(one))):.1f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profiles", nargs="*", default=list(PROFILES))
    ap.add_argument("--fitters", nargs="*", default=list(FITTERS))
    ap.add_argument("--train-trajectories", type=int, default=3456)
    ap.add_argument("--test-trajectories", type=int, default=1728)
    ap.add_argument("--train-seed", type=int, default=0)
    ap.add_argument("--test-seed", type=int, default=1)
    ap.add_argument("--no-real", action="store_true", help="skip the agentcgroup source")
    ap.add_argument("--rankers", nargs="*", default=list(RANKERS))
    ap.add_argument("--no-trees", action="store_true", help="the rankers only")
    a = ap.parse_args()
    if not a.no_trees:
        print("| source | fitter | rows fit / scored | remaining \\|log err\\| (÷ static) "
              "| fit s | predict µs a row (batch) | one row µs |\n|---|---|---|---|---|---|---|")
        for name in a.profiles:
            trees_on_profile(name, a)
        if not a.no_real:
            trees_on_real("agentcgroup", a)
    if a.rankers:
        print("\n| profile | ranker | pair accuracy (test seed) | fit s | one row µs |\n"
              "|---|---|---|---|---|")
        for name in a.profiles:
            rankers_on_profile(name, a)


if __name__ == "__main__":
    main()
