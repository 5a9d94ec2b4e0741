"""Statistics over evaluation seeds: confidence intervals of means."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

# Student t 0.975 quantiles for 1..30 degrees of freedom.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom."""
    if df <= len(_T975):
        return _T975[df - 1]
    return 1.959964 + 2.37 / df  # within 0.1% of the exact quantile above 30 df


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
    half = t975(n - 1) * sd / math.sqrt(n)
    return [mean - half, mean + half]
