"""The step heuristics (``rate_greedy_step``, ``critical_path``, ``least_slack``), the
``oracle`` that knows each trajectory's true remaining work, the step's lower bound, and
the grid's step ratios."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from metasched.agents import BASELINES, ORACLES, make_scheduler
from metasched.compose import profile
from metasched.core.actions import ActionSpec, SandboxSpec, Turn
from metasched.evaluation.statistics import paired_ratio
from metasched.evaluation.step_bound import (
    cpu_work_s,
    critical_path_s,
    mean_step_lower_bound,
    step_lower_bounds,
)
from metasched.evaluation.step_story import step_ratios, story_lines
from metasched.sim.sampling import TrajectorySpec, WorkloadInstance
from metasched.sim.simulator import Simulator

STEP_SCHEDULERS = ("rate_greedy_step", "critical_path", "least_slack", "oracle")
ALL_PROFILES = ("coding", "search", "rm_math", "mixed", "retool", "retool_grouped",
                "retool_grouped_c10", "swe_grouped")


def _grid():
    spec = importlib.util.spec_from_file_location(
        "grid", Path(__file__).resolve().parents[1] / "benchmarks" / "grid.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@cache
def small(name: str, n: int = 16, steps: int = 2):
    w, c = profile(name)
    return dataclasses.replace(w, steps=steps, trajectories_per_step=n), c


def _run(name: str, scheduler: str, seed: int):
    w, c = small(name)
    return Simulator(w, c, seed).run(make_scheduler(scheduler))


def test_step_schedulers_are_registered():
    assert {"rate_greedy_step", "critical_path", "least_slack"} <= set(BASELINES)
    assert ORACLES == ("oracle", "slack_first_oracle")
    assert not set(ORACLES) & set(BASELINES)
    for name in STEP_SCHEDULERS:
        assert make_scheduler(name).name == name


@pytest.mark.parametrize("name", ALL_PROFILES)
@pytest.mark.parametrize("scheduler", STEP_SCHEDULERS)
def test_step_scheduler_completes_and_is_deterministic(scheduler, name):
    a, b = _run(name, scheduler, 3), _run(name, scheduler, 3)
    c = a.counters
    assert c["completed"] + c["failed"] == c["submitted"] > 0 and c["pending"] == 0
    assert len(a.step_s) == 2 and np.isfinite(a.step_s).all()
    for col in ("act", "submit", "start", "end", "ok"):
        assert np.array_equal(getattr(a, col), getattr(b, col)), col
    assert np.array_equal(a.step_s, b.step_s)


def test_oracle_step_is_at_most_every_heuristics_on_a_grouped_point():
    """``retool_grouped_c10`` at 64 trajectories, one step, 6 seeds: knowing the true
    remaining work orders the queue at least as well as any static estimate (measured:
    oracle 81.8 s; the best heuristic, ``rate_greedy_step``, 89.4 s)."""
    w, c = profile("retool_grouped_c10")
    w = dataclasses.replace(w, steps=1, trajectories_per_step=64)

    def mean_step(s: str) -> float:
        return float(np.mean([Simulator(w, c, seed).run(make_scheduler(s)).step_s[0]
                              for seed in range(6)]))

    oracle = mean_step("oracle")
    for h in BASELINES:
        assert oracle <= mean_step(h), h


@pytest.mark.parametrize("name", ["retool_grouped_c10", "swe_grouped"])
def test_no_run_beats_the_step_lower_bound(name):
    w, c = small(name)
    for seed in (0, 1):
        sim = Simulator(w, c, seed)
        bounds = step_lower_bounds(sim.instance, c)["bound"]
        for s in ("fifo", "critical_path", "oracle"):
            steps = Simulator(w, c, seed).run(make_scheduler(s)).step_s
            assert (np.asarray(steps) >= np.asarray(bounds) * (1 - 1e-9)).all(), s


def _cpu(true_s: float, p: float = 0.0, cores: tuple[int, int] = (1, 1),
         timeout_s: float = 1e9) -> ActionSpec:
    return ActionSpec("cpu", "x", true_s, true_s, timeout_s, min_cores=cores[0],
                      max_cores=cores[1], parallel_fraction=p)


def test_step_lower_bound_by_hand(make_cluster):
    # Turn 0: 3 s generation (the 5 s sandbox start-up overlaps it), a 10 s action at
    # p = 0.5 on up to 2 cores: 7.5 s, submitted together with a 4 s one.
    # Turn 2: 2 s generation, a 20 s action cut at its 6 s timeout.
    t = TrajectorySpec("t", (Turn(3.0, _cpu(10.0, 0.5, (1, 2)), together=True),
                             Turn(1.0, _cpu(4.0)),
                             Turn(2.0, _cpu(20.0, timeout_s=6.0))), SandboxSpec(1.0, 5.0))
    assert critical_path_s(t) == pytest.approx(5.0 + 7.5 + 2.0 + 6.0)
    assert cpu_work_s(t) == pytest.approx(10.0 + 4.0 + 6.0)
    c = make_cluster(cores=2)
    inst = WorkloadInstance(steps=[[t] * 5])
    b = step_lower_bounds(inst, c)
    assert b["cpu"] == [pytest.approx(5 * 20.0 / 2)] and b["quota"] == [0.0]
    assert b["bound"] == [pytest.approx(50.0)]
    assert mean_step_lower_bound(inst, c) == pytest.approx(50.0)


def _doc(per_seed: dict[str, tuple[list[float], list[float]]]) -> dict:
    """A results document with per-seed (mean step, mean ACT) for each scheduler."""
    return {"schedulers": {n: {"mean_step_s": float(np.mean(st)), "mean_act_s": float(np.mean(a)),
                               "per_seed": {"seeds": [0, 1, 2, 3], "mean_step_s": st,
                                            "mean_act_s": a}}
                           for n, (st, a) in per_seed.items()}}


def test_step_ratios_by_hand():
    doc = _doc({"fast_act": ([12.0, 14.0, 12.0, 14.0], [1.0, 1.0, 1.0, 1.0]),
                "fast_step": ([10.0, 12.0, 11.0, 13.0], [2.0, 2.0, 2.0, 2.0]),
                "oracle": ([5.0, 6.0, 5.5, 6.5], [3.0, 3.0, 3.0, 3.0]),
                "learned": ([10.0, 12.0, 11.0, 13.0], [1.5, 1.5, 1.5, 1.5])})
    st = step_ratios(doc, ["fast_act", "fast_step"], [5.0, 5.0, 6.0, 6.0], "oracle")
    assert st["best_by_step"] == "fast_step" and st["best_by_act"] == "fast_act"
    assert st["lower_bound_s"] == 5.5
    r = st["schedulers"]["learned"]
    assert r["step_vs_best"]["ratio"] == 1.0 and r["step_vs_best"]["ratio_ci95"] == [1.0, 1.0]
    assert r["act_vs_best"]["ratio"] == 1.5 and r["act_vs_best"]["ratio_ci95"] == [1.5, 1.5]
    assert r["step_vs_oracle"]["ratio"] == 2.0 and r["step_vs_oracle"]["ratio_ci95"] == [2.0, 2.0]
    # step ÷ bound: 11.5 / 5.5; the interval is Fieller's: at each end a paired t-test of
    # step - R x bound sits exactly at the 5% two-sided level.
    b = r["step_vs_bound"]
    assert b["ratio"] == pytest.approx(11.5 / 5.5)
    lo, hi = b["ratio_ci95"]
    assert lo < 11.5 / 5.5 < hi
    x, y = np.array([10.0, 12.0, 11.0, 13.0]), np.array([5.0, 5.0, 6.0, 6.0])
    for end in (lo, hi):
        assert stats.ttest_rel(x, end * y).pvalue == pytest.approx(0.05, abs=1e-9)
    assert (lo, hi) == tuple(paired_ratio(x, y)[1])
    # The best of the predictor-fed ones by step ("learned" standing for one here).
    st = step_ratios(doc, ["fast_act", "fast_step"], None, "oracle",
                             predicted=("learned", "absent"))
    assert st["best_predicted"] == "learned"
    assert st["schedulers"]["fast_act"]["step_vs_predicted"]["ratio"] == pytest.approx(13 / 11.5)
    # No oracle run, no bound: those columns are empty.
    st = step_ratios(doc, ["fast_act", "fast_step"], None, "absent")
    assert st["oracle"] is None and st["schedulers"]["learned"]["step_vs_oracle"] is None
    assert st["schedulers"]["learned"]["step_vs_bound"] is None and st["lower_bound_s"] is None


def test_step_story_by_hand():
    """The eval report's step story: the best heuristic by step and by ACT named, every
    scheduler against both, and what a learned one buys in a sentence (a tie where the
    interval holds 1)."""
    doc = _doc({"fast_act": ([12.0, 14.0, 12.0, 14.0], [1.0, 1.0, 1.0, 1.0]),
                "fast_step": ([10.0, 12.0, 11.0, 13.0], [2.0, 2.1, 1.9, 2.0]),
                "learned": ([9.0, 10.8, 9.9, 11.7], [1.0, 1.0, 1.0, 1.0])})
    lines = story_lines(doc, ["fast_act", "fast_step"], ["learned", "absent"])
    text = "\n".join(lines)
    assert "best heuristic by mean step (`fast_step`, 11.5 s)" in text
    assert "by mean ACT (`fast_act`, 1 s)" in text
    assert "| learned | 10.4 | 0.900 (0.900–0.900) | 1 | 1.000 (1.000–1.000) |" in lines
    assert ("`learned`: a step 10% shorter than `fast_step` (the best heuristic by step) and "
            "the same mean ACT as `fast_act` (the best by ACT)") in text
    assert "`absent`" not in text
    assert story_lines(doc, [], ["learned"]) == []  # no heuristic: no story
    doc["schedulers"]["learned"]["trajectories_per_hour"] = 1.0
    assert story_lines(doc, ["fast_act"], ["learned"]) == []  # asynchronous: no step


def test_grid_has_the_grouped_points():
    grid = _grid()
    for p in ("retool_grouped", "retool_grouped_c10", "swe_grouped"):
        assert grid.POINTS[p] == (p, ())
    assert "oracle" in grid.DEFAULT_SCHEDULERS
    assert math.isfinite(grid.step_lower_bounds("retool_grouped_c10", [0])[0])


@pytest.mark.parametrize("name", ["critical_path@reward_static", "slack_first_predicted@forest"])
def test_grid_design_variants_are_for_predicted_rules_and_known_designs(name, capsys):
    """``NAME@DESIGN`` runs a predictor-fed rule with another predictor design; on any
    other rule, or with an unknown design, the grid says so in one line before any run."""
    assert _grid().main(["--points", "retool_grouped", "--schedulers", name]) == 2
    err = capsys.readouterr().err
    assert "NAME@DESIGN" in err and len(err.strip().splitlines()) == 1
