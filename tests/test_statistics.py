"""Confidence intervals and paired comparisons over evaluation seeds, checked against
scipy.stats on known data; and the paired comparison in results documents."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from metasched.evaluation.runs import best_by_mean_act, compare_paired
from metasched.evaluation.statistics import (
    ci95,
    paired_comparison,
    paired_difference,
    paired_ratio,
)

# Per-seed means of two schedulers on the same 8 seeds: seeds differ a lot, the
# schedulers little (common random numbers), as in evaluation.
REF = np.array([1.78, 1.33, 2.24, 1.51, 1.95, 1.10, 2.60, 1.42])
DATA = [
    (REF * 0.8 + np.array([0.02, -0.03, 0.01, 0.04, -0.02, 0.0, 0.03, -0.01]), REF),
    (np.array([5.1, 4.4, 5.9, 4.8, 5.2, 4.1, 6.3, 4.6]), REF),
    (np.array([10.0, 12.0, 11.5]), np.array([9.0, 11.0, 11.0])),
]


@pytest.mark.parametrize("x", [REF, DATA[1][0], np.array([3.0, 1.0]), np.arange(30.0)])
def test_ci95_is_scipy_one_sample_t_interval(x):
    ci = stats.ttest_1samp(x, 0.0).confidence_interval(0.95)
    assert ci95(x) == pytest.approx([ci.low, ci.high], rel=1e-12)


def test_ci95_of_one_value_is_that_value():
    assert ci95([2.5]) == [2.5, 2.5]


@pytest.mark.parametrize("x, ref", DATA)
def test_paired_difference_is_scipy_paired_t_interval(x, ref):
    d, (lo, hi) = paired_difference(x, ref)
    ci = stats.ttest_rel(x, ref).confidence_interval(0.95)
    assert d == pytest.approx(float(np.mean(x - ref)))
    assert (lo, hi) == pytest.approx((ci.low, ci.high), rel=1e-12)


@pytest.mark.parametrize("x, ref", DATA)
def test_paired_ratio_ends_are_where_the_paired_t_test_rejects(x, ref):
    # Fieller's interval: the ratios R whose paired t-test of x - R ref is not rejected.
    r, (lo, hi) = paired_ratio(x, ref)
    assert r == pytest.approx(x.mean() / ref.mean())
    assert lo < r < hi
    for end in (lo, hi):
        assert stats.ttest_1samp(x - end * ref, 0.0).pvalue == pytest.approx(0.05, rel=1e-6)
    for inside in (r, (lo + r) / 2, (r + hi) / 2):
        assert stats.ttest_1samp(x - inside * ref, 0.0).pvalue > 0.05


def test_ratio_interval_excludes_one_exactly_when_the_difference_excludes_zero():
    for x, ref in DATA:
        _, (rlo, rhi) = paired_ratio(x, ref)
        _, (dlo, dhi) = paired_difference(x, ref)
        assert (rlo < 1 < rhi) == (dlo < 0 < dhi)


def test_pairing_narrows_the_interval_on_common_random_numbers():
    x, ref = DATA[0]
    _, (lo, hi) = paired_difference(x, ref)
    welch = stats.ttest_ind(x, ref, equal_var=False).confidence_interval(0.95)
    assert hi - lo < (welch.high - welch.low) / 5
    assert hi < 0  # paired: clearly better; unpaired: not even significant
    assert welch.low < 0 < welch.high


def test_identical_schedulers_compare_exactly():
    p = paired_comparison(REF, REF)
    assert p == {"ratio": 1.0, "ratio_ci95": [1.0, 1.0], "diff": 0.0, "diff_ci95": [0.0, 0.0]}


def test_ratio_against_a_reference_near_zero_is_unbounded():
    r, ci = paired_ratio([1.0, 2.0, 1.5], [0.1, -0.1, 0.05])
    assert ci == [-math.inf, math.inf] and math.isfinite(r)


def _doc(means: dict[str, list[float]]) -> dict:
    seeds = list(range(len(next(iter(means.values())))))
    return {"schedulers": {
        n: {"mean_act_s": float(np.mean(v)),
            "per_seed": {"seeds": seeds, "mean_act_s": v, "mean_step_s": [100.0 + x for x in v]}}
        for n, v in means.items()}}


def test_best_heuristic_is_the_lowest_mean_act_among_heuristics():
    doc = _doc({"fifo": [3.0, 4.0], "sjf": [2.0, 2.5], "checkpoints/x": [1.0, 1.0]})
    assert best_by_mean_act(doc, ["fifo", "sjf"]) == "sjf"
    compare_paired(doc, ["fifo", "sjf"])
    assert doc["best_heuristic"] == doc["reference"] == "sjf"
    learned = doc["schedulers"]["checkpoints/x"]["paired"]
    assert learned["mean_act_s"]["ratio"] == pytest.approx(1.0 / 2.25)
    assert learned["mean_act_s"]["diff"] == pytest.approx(-1.25)
    assert learned["mean_step_s"]["diff"] == pytest.approx(-1.25)
    assert doc["schedulers"]["sjf"]["paired"]["mean_act_s"]["ratio_ci95"] == [1.0, 1.0]


def test_reference_overrides_the_best_heuristic():
    doc = compare_paired(_doc({"fifo": [3.0, 4.0], "sjf": [2.0, 2.5]}), ["fifo", "sjf"], "fifo")
    assert doc["best_heuristic"] == "sjf" and doc["reference"] == "fifo"
    assert doc["schedulers"]["sjf"]["paired"]["mean_act_s"]["ratio"] == pytest.approx(2.25 / 3.5)


def test_no_heuristic_no_reference_no_pairs():
    doc = compare_paired(_doc({"checkpoints/x": [1.0, 1.0]}), [])
    assert doc["best_heuristic"] is None and doc["reference"] is None
    assert "paired" not in doc["schedulers"]["checkpoints/x"]
