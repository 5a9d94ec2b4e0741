"""Statistics over evaluation seeds: confidence intervals of means, and paired
comparisons of one scheduler against a reference on the same seeds.

Every scheduler evaluated on a seed runs the same workload instance (common random
numbers), so per-seed results of two schedulers are paired: their differences vary far
less than either alone, and a paired interval is the honest (and tighter) one. The t
quantiles come from ``scipy.stats``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy import stats


def _t975(n: int) -> float:
    """The 0.975 quantile of Student's t with ``n - 1`` degrees of freedom."""
    return float(stats.t.ppf(0.975, n - 1))


def ci95(values: Sequence[float]) -> list[float]:
    """Student-t 95% confidence interval of the mean of ``values``."""
    x = np.asarray(values, dtype=float)
    m = float(x.mean())
    if x.size < 2:
        return [m, m]
    return ci95_of(x.size, m, float(x.std(ddof=1)))


def ci95_of(n: int, mean: float, sd: float) -> list[float]:
    """The same interval from a sample's size, mean and standard deviation (ddof=1):
    for samples summarised as they come."""
    if n < 2:
        return [mean, mean]
    half = _t975(n) * sd / math.sqrt(n)
    return [mean - half, mean + half]


def paired_difference(x: Sequence[float], ref: Sequence[float]) -> tuple[float, list[float]]:
    """Mean of ``x - ref`` over paired seeds and its 95% t interval (the interval of
    ``scipy.stats.ttest_rel(x, ref)``)."""
    d = np.asarray(x, dtype=float) - np.asarray(ref, dtype=float)
    return float(d.mean()), ci95(d)


def paired_ratio(x: Sequence[float], ref: Sequence[float]) -> tuple[float, list[float]]:
    """``mean(x) / mean(ref)`` over paired seeds and its 95% Fieller interval.

    The interval is every ratio R for which a paired t-test of ``x - R * ref`` does not
    reject zero at 5%: the roots of ``(mean(x) - R mean(ref))^2 = t^2 Var(x - R ref) / n``.
    It is exact for normal per-seed means and, unlike a ratio of two separate intervals,
    uses the pairing. When ``mean(ref)`` is not clearly away from zero the set is
    unbounded and the interval is ``[-inf, inf]``.
    """
    xa = np.asarray(x, dtype=float)
    ya = np.asarray(ref, dtype=float)
    n = xa.size
    mx, my = float(xa.mean()), float(ya.mean())
    r = mx / my if my else math.nan
    if n < 2 or not math.isfinite(r):
        return r, [r, r]
    if np.all(xa == r * ya):
        return r, [r, r]  # exactly proportional (e.g. identical): no spread to bound
    cov = np.cov(xa, ya, ddof=1)
    k = _t975(n) ** 2 / n
    a = my * my - k * cov[1, 1]
    b = -2.0 * (mx * my - k * cov[0, 1])
    c = mx * mx - k * cov[0, 0]
    if a <= 0:
        return r, [-math.inf, math.inf]
    disc = max(b * b - 4.0 * a * c, 0.0)  # >= 0 in exact arithmetic (r is inside)
    root = math.sqrt(disc)
    return r, [(-b - root) / (2.0 * a), (-b + root) / (2.0 * a)]


def paired_comparison(x: Sequence[float], ref: Sequence[float]) -> dict[str, Any]:
    """Ratio and difference of means of ``x`` against ``ref`` (paired by position),
    each with its 95% interval."""
    ratio, ratio_ci = paired_ratio(x, ref)
    diff, diff_ci = paired_difference(x, ref)
    return {"ratio": ratio, "ratio_ci95": ratio_ci, "diff": diff, "diff_ci95": diff_ci}


__all__ = ["ci95", "ci95_of", "paired_comparison", "paired_difference", "paired_ratio"]
