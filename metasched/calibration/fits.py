"""The fits calibration makes: durations in the profiles' log-normal form, Amdahl
fractions, turn counts, estimate errors.

Durations are fitted in the form the profiles use (:class:`~metasched.sim.workload_config.Dist`):
a log-normal through the median and p90 with its own log-scale slope above the p90 up
to the p99. Its three parameters are quantiles, so they are fitted as the sample's
quantiles (robust to the heavy tails measured action times have); runs killed at their
timeout are right-censored and count as longer than every finished run, so a quantile is
given only where no censored run could change it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
from scipy import optimize, stats

from metasched.sim.dists import Z90, Z99, Dist, parse_dist

QUANTILES = (0.5, 0.9, 0.99)
# Fewest samples for each quantile of the fitted form: below them it is left out (a p99
# from 20 runs is their maximum, not a p99).
MIN_N = {0.5: 1, 0.9: 10, 0.99: 100}


@dataclass(frozen=True)
class DistFit:
    """A fitted duration distribution and how it was fitted."""

    dist: Dist
    n: int  # samples
    censored: int  # of them, killed at their timeout
    quantiles: dict[float, float]  # the fitted form's defining quantiles
    ks: float  # Kolmogorov-Smirnov distance of the finished runs from the fit
    tail_from_censoring: bool = False  # the p99 extrapolated from the fraction killed
    zero: float = 0.0  # the fraction of zeros (the quantiles are those of the rest)

    def config(self) -> dict[str, float] | float:
        """The profile's ``{median, p90, p99}`` (or a constant), with ``zero`` if any."""
        q = self.quantiles
        z = {"zero": round(self.zero, 4)} if self.zero > 0 else {}
        if len(q) == 1 and not z:
            return q[0.5]
        return {"median": q[0.5], **{f"p{round(k * 100)}": v for k, v in q.items() if k != 0.5},
                **z}


def censored_quantile(x: np.ndarray, censored: np.ndarray, q: float) -> float | None:
    """The ``q`` quantile (linear interpolation) of ``x`` where censored values are only
    known to be at least what ``x`` holds; None when a censored value could move it."""
    v = np.where(censored, np.inf, x)
    v.sort()
    pos = q * (len(v) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    if not (math.isfinite(v[lo]) and math.isfinite(v[hi])):
        return None
    value = v[lo] + (v[hi] - v[lo]) * (pos - lo)
    # A censored run whose bound lies below the value might be above or below it.
    if censored.any() and x[censored].min() < value:
        return None
    return float(value)


def dist_from_quantiles(q: dict[float, float], lo: float = 0.0,
                        hi: float = math.inf, zero: float = 0.0) -> Dist:
    """The profile form through the given median (p90, p99) quantiles, as a profile
    would give it (with a fraction ``zero`` of zeros beside them)."""
    spec: dict[str, float] = {"median": q[0.5], "min": lo}
    if zero > 0:
        spec["zero"] = zero
    spec.update({f"p{round(k * 100)}": v for k, v in q.items() if k != 0.5})
    if hi < math.inf:
        spec["max"] = hi
    return parse_dist(spec, "fit", positive=False)


def dist_cdf(d: Dist, x: np.ndarray) -> np.ndarray:
    """P(X <= x) under a profile distribution (clipping ignored)."""
    x = np.asarray(x, float)
    if d.zero > 0.0:  # the point mass at 0, then the log-normal for the rest
        rest = dist_cdf(replace(d, zero=0.0), x)
        return np.where(x >= 0.0, d.zero + (1.0 - d.zero) * rest, 0.0)
    if d.sigma == 0.0 and d.tail_sigma is None:
        return (x >= d.median).astype(float)
    with np.errstate(divide="ignore"):
        u = np.log(np.maximum(x, 1e-300) / d.median)
    body = d.sigma * Z90
    tail = d.tail_sigma if d.tail_sigma is not None else d.sigma
    sig = d.sigma if d.sigma > 0 else 1e-12
    z = np.where(u <= body, u / sig, Z90 + (u - body) / max(tail, 1e-12))
    return stats.norm.cdf(z)


def fit_duration(x: np.ndarray, censored: np.ndarray | None = None) -> DistFit:
    """Fit the profile form to durations ``x`` (``censored``: killed at their timeout,
    so ``x`` is a lower bound)."""
    x = np.asarray(x, float)
    censored = np.zeros(len(x), bool) if censored is None else np.asarray(censored, bool)
    quantiles: dict[float, float] = {}
    for q in QUANTILES:
        if len(x) < MIN_N[q]:
            continue
        v = censored_quantile(x, censored, q)
        if v is None:
            continue
        # The form needs positive, ordered quantiles.
        prev = max(quantiles.values(), default=0.0)
        quantiles[q] = max(v, prev, 1e-6)
    if 0.5 not in quantiles:  # more than half censored: the median is a lower bound
        quantiles = {0.5: float(max(np.median(x), 1e-6))}
    tail_from_censoring = False
    c = float(censored.mean()) if len(x) else 0.0
    if 0.9 in quantiles and 0.99 not in quantiles and len(x) >= MIN_N[0.99] and 0 < c < 0.1:
        # The p99 lies beyond the timeout: the tail's slope is what puts the fraction
        # killed there above the (median) timeout bound: log(B / p90) = tail (z_B - Z90).
        bound = float(np.median(x[censored]))
        z_b = float(stats.norm.ppf(1.0 - c))
        if bound > quantiles[0.9] and z_b > Z90:
            tail = math.log(bound / quantiles[0.9]) / (z_b - Z90)
            quantiles[0.99] = quantiles[0.9] * math.exp(tail * (Z99 - Z90))
            tail_from_censoring = True
    dist = dist_from_quantiles(quantiles)
    done = x[~censored]
    ks = float(stats.ks_1samp(done, lambda v: dist_cdf(dist, v)).statistic) if (
        len(done) >= 2 and (dist.sigma > 0 or dist.tail_sigma)) else math.nan
    return DistFit(dist, len(x), int(censored.sum()), quantiles, ks, tail_from_censoring)


def fit_gaps(x: np.ndarray) -> DistFit:
    """Fit generation gaps: the fraction that are 0 (an action submitted before the one
    before it had finished: calls made together, whose recorded gap is 0) as the form's
    point mass at 0, the profile form to the rest. One log-normal through the median of
    all of them would put the median at 0 and miss the mean of the rest."""
    x = np.asarray(x, float)
    pos = x[x > 0.0]
    zero = 1.0 - len(pos) / len(x) if len(x) else 0.0
    if zero == 0.0 or len(pos) == 0:
        return fit_duration(x)
    body = fit_duration(pos)  # its KS distance: the non-zero gaps from the log-normal
    return DistFit(replace(body.dist, zero=zero), len(x), 0, body.quantiles, body.ks,
                   zero=zero)


@dataclass(frozen=True)
class CountFit:
    """A fitted count distribution (turns per trajectory)."""

    dist: Dist
    n: int
    quantiles: dict[float, float]
    lo: int
    hi: int

    def config(self) -> dict[str, float]:
        q = self.quantiles
        return {"median": q[0.5], **{f"p{round(k * 100)}": v for k, v in q.items() if k != 0.5},
                "min": self.lo, "max": self.hi}


def count_quantile(counts: np.ndarray, q: float) -> float:
    """The ``q`` quantile of the continuous quantity whose rounding gave ``counts``:
    each count n stands for the interval [n - 0.5, n + 0.5], spread evenly (profiles
    sample turns as the rounding of a log-normal)."""
    values, freq = np.unique(np.asarray(counts, int), return_counts=True)
    cdf = np.concatenate([[0.0], np.cumsum(freq) / freq.sum()])
    # Count values[i] holds the mass between cdf[i] and cdf[i + 1], spread over its
    # interval; between counts that never occur there is no mass.
    i = int(np.searchsorted(cdf, q, side="left"))
    i = min(max(i, 1), len(values))
    lo_c, hi_c = cdf[i - 1], cdf[i]
    frac = 0.0 if hi_c == lo_c else (q - lo_c) / (hi_c - lo_c)
    return float(max(0.0, values[i - 1] - 0.5 + frac))


def fit_counts(counts: np.ndarray) -> CountFit:
    """Fit the profile form to counts (turns), with their observed range as its clip."""
    counts = np.asarray(counts, int)
    quantiles = {}
    for q in QUANTILES:
        if len(counts) >= MIN_N[q]:
            prev = max(quantiles.values(), default=0.0)
            quantiles[q] = max(count_quantile(counts, q), prev, 1e-3)
    lo, hi = int(counts.min()), int(counts.max())
    return CountFit(dist_from_quantiles(quantiles, lo, hi), len(counts), quantiles, lo, hi)


@dataclass(frozen=True)
class AmdahlFit:
    """An Amdahl parallel fraction fitted from runs at different core counts."""

    p: float
    n: int
    core_counts: tuple[int, ...]
    rmse: float  # of log run time, after the fit


def fit_amdahl(run_s: np.ndarray, cores: np.ndarray, est_s: np.ndarray,
               bins: int = 50, min_runs: int = 30) -> AmdahlFit | None:
    """The parallel fraction p that best explains run times at the granted core counts:
    log run = log base + log((1 - p) + p / k).

    Bases differ from run to run, and schedulers give more cores to runs they expect to
    be long, so the base is not independent of k; it is independent given the estimate
    the scheduler saw. So the base's log is modelled as one level per estimate bin
    (quantile bins of ``est_s``), profiled out, and p found by bounded scalar
    minimisation of the residual sum of squares. None unless at least two core counts
    have ``min_runs`` runs each: a few runs off the usual count leave p so loose that
    the durations scaled by it are worse than with the declared fraction (on the shipped
    ``coding`` profile, 4 of 571 runs off 16 cores gave p 0.82 for 0.8, and one-core
    durations 8% too long).
    """
    run_s, cores, est_s = (np.asarray(a, float) for a in (run_s, cores, est_s))
    ok = (run_s > 0) & (cores >= 1)
    run_s, cores, est_s = run_s[ok], cores[ok], est_s[ok]
    distinct, per_count = np.unique(cores, return_counts=True)
    distinct = tuple(int(k) for k in distinct)
    if np.sum(per_count >= min_runs) < 2:
        return None
    nb = max(1, min(bins, len(run_s) // 40))
    edges = np.quantile(est_s, np.linspace(0, 1, nb + 1)[1:-1])
    group = np.searchsorted(edges, est_s)
    y = np.log(run_s)
    size = np.bincount(group, minlength=nb)

    def sse(p: float) -> float:
        r = y - np.log((1.0 - p) + p / cores)
        mean = np.bincount(group, weights=r, minlength=nb) / np.maximum(size, 1)
        return float(np.sum((r - mean[group]) ** 2))

    res = optimize.minimize_scalar(sse, bounds=(0.0, 1.0), method="bounded",
                                   options={"xatol": 1e-5})
    p = float(res.x)
    # The bounded search never evaluates the ends: take one if it is better.
    p = min((p, 0.0, 1.0), key=sse)
    return AmdahlFit(p, len(run_s), distinct, math.sqrt(sse(p) / len(run_s)))


def estimate_sigma(est_s: np.ndarray, x: np.ndarray) -> float:
    """The log-normal sigma of estimates around the durations they estimate."""
    est_s, x = np.asarray(est_s, float), np.asarray(x, float)
    ok = (est_s > 0) & (x > 0)
    if ok.sum() < 2:
        return math.nan
    return float(np.std(np.log(est_s[ok] / x[ok]), ddof=1))


__all__ = ["AmdahlFit", "CountFit", "DistFit", "censored_quantile", "count_quantile",
           "dist_cdf", "dist_from_quantiles", "estimate_sigma", "fit_amdahl",
           "fit_counts", "fit_duration"]
