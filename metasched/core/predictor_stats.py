"""Fitting helpers of the remaining-work predictor (:mod:`metasched.core.predictor`):
ridge regression, variance components, per-turn tables, LightGBM's trees."""

from __future__ import annotations

import math

import numpy as np

from metasched.errors import ConfigError

GEN = "gen"  # the type name of generation gaps (as the predictor's)
QUANTILES = (0.1, 0.5, 0.9)  # as the predictor's
_MIN_BUCKET = 30  # fewest training points a turn-index bucket of the tables needs
_RIDGE = 0.01  # L2 penalty per training point on the linear design's standardised features


def ridge(a: np.ndarray, y: np.ndarray, lam: float = _RIDGE) -> np.ndarray:
    """Least squares of ``y`` on ``a`` (first column: the intercept) with an L2 penalty
    of ``lam`` per point on the standardised other columns: features that barely vary
    at a turn index (siblings not yet measured) get small, stable weights."""
    mean, sd = a[:, 1:].mean(0), a[:, 1:].std(0)
    sd[sd < 1e-9] = 1.0
    z = np.column_stack([np.ones(len(a)), (a[:, 1:] - mean) / sd])
    pen = np.full(z.shape[1], lam * len(a))
    pen[0] = 0.0
    w = np.linalg.solve(z.T @ z + np.diag(pen), z.T @ y)
    coef = np.empty_like(w)
    coef[1:] = w[1:] / sd
    coef[0] = w[0] - coef[1:] @ mean
    return coef


def components(records: list, mu: dict, sd: dict) -> tuple[float, float]:
    """Prompt and trajectory variance components of the standardised residuals (method
    of moments: the mean product of two residuals of one trajectory estimates
    ``v_prompt + v_traj``; of two sibling trajectories, ``v_prompt``)."""
    within_num = within_n = 0.0
    by_group: dict[object, list[tuple[float, float]]] = {}
    for r in records:
        res = [(math.log(g) - mu[GEN]) / sd[GEN] for _, g, _ in r.turns[1:] if g > 0]
        res += [(math.log(d) - mu[n]) / sd[n] for n, _, d in r.turns if d > 0]
        s, s2, n = sum(res), sum(v * v for v in res), len(res)
        within_num += (s * s - s2) / 2
        within_n += n * (n - 1) / 2
        if r.group is not None:
            by_group.setdefault(r.group, []).append((s, n))
    between_num = between_n = 0.0
    for sums in by_group.values():
        s = sum(a for a, _ in sums)
        n = sum(b for _, b in sums)
        between_num += (s * s - sum(a * a for a, _ in sums)) / 2
        between_n += (n * n - sum(b * b for _, b in sums)) / 2
    vpt = min(max(within_num / within_n if within_n else 0.0, 0.0), 0.95)
    vp = min(max(between_num / between_n if between_n else 0.0, 0.0), vpt)
    return vp, vpt - vp


def table(by_k: dict[int, list[float]], stat) -> np.ndarray:
    """``stat`` (mean or median) per turn index, the buckets with fewer than
    ``_MIN_BUCKET`` points pooled into one after the last that has enough."""
    out, pooled = [], []
    for k in range(max(by_k) + 1):
        v = by_k.get(k, [])
        if len(v) >= _MIN_BUCKET and not pooled:
            out.append(float(stat(v)))
        else:
            pooled += v
    if pooled or not out:
        out.append(float(stat(pooled)) if pooled else 0.0)
    return np.array(out)


def quantile_table(resid: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Per bucket, the residuals' p10/p50/p90 offsets from the median prediction."""
    rows = []
    for b in range(int(k.max()) + 1):
        r = resid[k >= b] if (k == b).sum() < _MIN_BUCKET else resid[k == b]
        rows.append(np.quantile(r, QUANTILES) if len(r) else np.zeros(3))
    return np.array(rows)


def lightgbm():
    """LightGBM, or a one-line error naming the extra that brings it."""
    try:
        import lightgbm
    except ImportError:
        raise ConfigError("predictor", "the boost and gbm designs need LightGBM: pip "
                          "install 'metasched[predict]' (or design shrinkage or linear)"
                          ) from None
    return lightgbm


def fit_gbm(x: np.ndarray, y: np.ndarray, categorical: list[int]):
    """LightGBM's gradient-boosted trees for the median of ``y`` (the L1 objective: the
    mean |log error| is what is scored), deterministic, fitted on one thread."""
    lgb = lightgbm()
    params = {"objective": "l1", "learning_rate": 0.05, "num_leaves": 15,
              "min_data_in_leaf": 40, "feature_fraction": 0.8, "bagging_fraction": 0.8,
              "bagging_freq": 1, "lambda_l2": 1.0, "seed": 0, "deterministic": True,
              "num_threads": 1, "verbose": -1}
    data = lgb.Dataset(x, y, categorical_feature=categorical, free_raw_data=False)
    return lgb.train(params, data, num_boost_round=300)


__all__ = ["components", "fit_gbm", "lightgbm", "quantile_table", "ridge", "table"]
