"""Prompt groups: the latent per-prompt difficulty and per-trajectory persistence
(``metasched.sim.groups``), the grouped profiles' fit to the measured figures, the
prompt id through traces, and its recovery by metasched-calibrate.

Tolerances come from sampling error: each grouped profile is sampled in independent
batches (seeds), and a figure's standard error is the spread of its batch values over
sqrt(batches). A configured share must come back within K standard errors of the
batches' mean, K = 4.3: the t quantile (9 degrees of freedom) that leaves a 0.1% chance
each, for some 25 shares checked together. A measured figure (mini-swe-agent on 30
SWE-bench instances) is itself an estimate from 30 prompts: its standard error is the
batch spread scaled to 30 prompts (sd x sqrt(prompts per batch / 30)), and the
profile's figure must lie within 2 combined standard errors of it.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import yaml

from metasched.calibration.groups import group_figures, records_of
from metasched.cli.calibrate_app import run_calibrate
from metasched.compose import PROFILES, compose, profile
from metasched.errors import ConfigError
from metasched.evaluation.recording import record_trace
from metasched.sim.dists import parse_dist
from metasched.sim.groups import anova_share, explained, loading_for, nested_shares, parse_groups
from metasched.sim.sampling import sample_workload
from metasched.sim.trace import read_trace, trace_from_workload, write_trace
from metasched.sim.workload_config import parse_workload

GROUPED = ("retool_grouped", "retool_grouped_c10", "swe_grouped")
BATCHES = 10
K = 4.3  # see the module docstring
REAL_PROMPTS = 30  # the measured figures' instances
# The measured figures (WORKLOADS "Rollout structure"; mini-swe-agent).
TARGETS = {"turns": 0.53, "tool_s": 0.45, "generation_total_s": 0.45,
           "history_ratio": 0.249 / 0.278, "done_remaining_corr": -0.42}


def _flat(f: dict) -> dict[str, float]:
    out = {k: f[k] for k in ("turns", "tool_s", "generation_total_s", "gap_halves_corr",
                              "done_remaining_corr")}
    out["history_ratio"] = f["history_log_error"] / f["static_log_error"]
    for name, a in f["actions"].items():
        out[f"{name}.share"], out[f"{name}.persistence"] = (a["share"], a["trajectory_share"]
                                                            - a["share"])
    g = f["generation_s"]
    out["gap.share"], out["gap.persistence"] = g["share"], g["trajectory_share"] - g["share"]
    return out


@pytest.fixture(scope="module", params=["swe_grouped", "retool_grouped"])
def batches(request) -> tuple:
    """(profile name, workload, per figure: the batch values, prompts per batch)."""
    name = request.param
    w, _ = profile(name)
    steps = 6 if name == "swe_grouped" else 2
    rows, prompts = [], 0
    for seed in range(BATCHES):
        f = group_figures(records_of(sample_workload(replace(w, steps=steps),
                                                     np.random.default_rng(seed))))
        rows.append(_flat(f))
        prompts = f["prompts"]
    return name, w, {k: np.array([r[k] for r in rows]) for k in rows[0]}, prompts


def _mean_se(v: np.ndarray) -> tuple[float, float]:
    return float(v.mean()), float(v.std(ddof=1) / math.sqrt(len(v)))


def test_configured_shares_come_back(batches) -> None:
    """Every share and persistence the profile configures is what the sampled rollouts
    have: turns, each action type, generation gaps."""
    name, w, vals, _ = batches
    g = w.groups
    expect = {"turns": g.turns, "gap.share": g.generation_s,
              "gap.persistence": g.generation_persistence}
    for t in w.tasks:
        for a in t.actions:
            expect[f"{a.name}.share"] = g.action_share(a.name)
            expect[f"{a.name}.persistence"] = g.persistence
    for key, want in expect.items():
        mean, se = _mean_se(vals[key])
        assert abs(mean - want) <= K * se, f"{name} {key}: {mean:.3f} +- {se:.3f}, " \
                                           f"configured {want}"


@pytest.mark.parametrize("figure", sorted(TARGETS))
def test_grouped_profiles_reproduce_the_measured_figures(batches, figure: str) -> None:
    """The prompt's share of log turns, log total tool time and log total generation
    time, the history estimate's gain and the turns-done/turns-left correlation land on
    the measured figures, within their sampling error and the simulation's. (retool's
    turn counts, 0-8, are its own: the correlation is checked on swe_grouped only.)"""
    name, _, vals, prompts = batches
    if figure == "done_remaining_corr" and name != "swe_grouped":
        pytest.skip("retool's turn distribution is retool's (max 8 calls)")
    v = vals[figure]
    mean, se = _mean_se(v)
    se_real = float(v.std(ddof=1)) * math.sqrt(prompts / REAL_PROMPTS)
    tol = 2 * math.hypot(se, se_real)
    assert abs(mean - TARGETS[figure]) <= tol, f"{name} {figure}: {mean:.3f} (tolerance " \
                                               f"{tol:.3f}), measured {TARGETS[figure]}"


def test_swe_grouped_history_and_shares_of_the_measured_types(batches) -> None:
    """The per-type shares measured apart (tests 44%, installs 52%, python 19%, code
    search 23%) and the gaps' persistence (first- vs second-half mean, 0.36)."""
    name, _, vals, prompts = batches
    if name != "swe_grouped":
        pytest.skip("the types measured apart are swe_grouped's")
    for key, want in (("test_run.share", 0.44), ("pip_install.share", 0.52),
                      ("python.share", 0.19), ("code_search.share", 0.23),
                      ("gap_halves_corr", 0.36)):
        mean, se = _mean_se(vals[key])
        se_real = float(vals[key].std(ddof=1)) * math.sqrt(prompts / REAL_PROMPTS)
        assert abs(mean - want) <= 2 * math.hypot(se, se_real), (key, mean, want)


# ---------------------------------------------------------------- the model's pieces


@pytest.mark.parametrize("spec,share", [({"median": 0.397, "p90": 1.02, "p99": 61.4}, 0.44),
                                        ({"median": 0.8, "p90": 2.5, "p99": 30}, 0.19),
                                        ({"median": 4.6, "p99": 59, "max": 600}, 0.6)])
def test_loadings_give_the_share_through_the_distribution_shape(spec: dict, share: float
                                                                ) -> None:
    """The loading solved for a share gives it (the integral), and a Monte Carlo of
    3,000 prompts measures it within 3 standard errors."""
    d = parse_dist(spec, "d")
    a = loading_for(d, share)
    assert explained(d, a) == pytest.approx(share, abs=1e-3)
    rng = np.random.default_rng(7)
    k, m = 3000, 8
    z = a * rng.standard_normal(k)[:, None] + math.sqrt(1 - a * a) * rng.standard_normal((k, m))
    v = np.log(np.clip(d._unclipped(z), d.lo, d.hi)).ravel()
    got = anova_share(v, np.repeat(np.arange(k), m))
    se = math.sqrt(2 * (1 - share) ** 2 * (1 + (m - 1) * share) ** 2 / (m * (m - 1) * (k - 1)))
    assert abs(got - share) <= 3 * se


def test_nested_shares_tell_persistence_from_the_prompt() -> None:
    """Draws nested in trajectories nested in prompts: the prompt's share and the
    trajectory's come back as built (a one-way ANOVA by prompt would count part of the
    trajectory's in the prompt's)."""
    rng = np.random.default_rng(3)
    k, t, m = 2000, 8, 6
    v = (math.sqrt(0.3) * rng.standard_normal(k)[:, None, None]
         + math.sqrt(0.2) * rng.standard_normal((k, t))[:, :, None]
         + math.sqrt(0.5) * rng.standard_normal((k, t, m))).ravel()
    prompts = np.repeat(np.arange(k), t * m)
    trajs = np.repeat(np.arange(k * t), m)
    between, within = nested_shares(v, prompts, trajs)
    assert between == pytest.approx(0.3, abs=0.03)
    assert within == pytest.approx(0.5, abs=0.03)
    assert anova_share(v, prompts) > between + 0.02


@pytest.mark.parametrize("name", PROFILES)
def test_shipped_profiles_have_no_groups(name: str) -> None:
    """Groups are off unless a profile switches them on (its results stay as they were)."""
    w, _ = profile(name)
    assert not w.groups.on
    inst = sample_workload(replace(w, steps=1), np.random.default_rng(0))
    assert all(ts.prompt is None for s in inst.steps for ts in s)


def test_groups_of_one_draw_as_before() -> None:
    """``groups: {size: 1}`` is the default: the same instance, draw for draw."""
    w, _ = profile("retool")
    w1 = replace(w, steps=1, groups=parse_groups({"size": 1}, "groups"))
    a = sample_workload(replace(w, steps=1), np.random.default_rng(5))
    b = sample_workload(w1, np.random.default_rng(5))
    assert a.steps == b.steps


@pytest.mark.parametrize("name", GROUPED)
def test_grouped_profiles_load_with_prompt_groups(name: str) -> None:
    w, c = profile(name)
    assert w.groups.on and w.name == name and c.name == name
    inst = sample_workload(replace(w, steps=2), np.random.default_rng(0))
    sizes = np.unique([ts.prompt for s in inst.steps for ts in s], return_counts=True)[1]
    assert set(sizes) == {w.groups.size}
    assert len(sizes) == 2 * w.trajectories_per_step // w.groups.size  # new prompts a step
    # Seeded: the same seed, the same instance.
    assert inst.steps == sample_workload(replace(w, steps=2), np.random.default_rng(0)).steps


@pytest.mark.parametrize("groups,message", [
    ({"size": 0}, "groups.size: must be >= 1"),
    ({"turns": 1.2}, "groups.turns: must be <= 0.99 (got 1.2)"),
    ({"duration_s": 0.6, "persistence": 0.5}, "groups.persistence: share + persistence"),
    ({"actions": {"nope": 0.1}}, "groups.actions.nope: unknown action"),
    ({"sizes": 4}, "groups"),
    ({"turns_coupling": 2}, "groups.turns_coupling: must be <= 1 (got 2)"),
])
def test_bad_groups_are_one_line(groups: dict, message: str) -> None:
    doc = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "workload"
                          / "retool.yaml").read_text())
    doc["groups"] = groups
    with pytest.raises(ConfigError) as e:
        parse_workload(doc)
    assert message in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------- traces and calibration


def test_traces_carry_the_prompt_and_old_ones_still_load(tmp_path: Path) -> None:
    w, _ = profile("retool_grouped")
    inst = trace_from_workload(replace(w, steps=1, trajectories_per_step=32), seed=1)
    path = tmp_path / "t.jsonl"
    write_trace(inst, path)
    assert '"prompt":"0"' in path.read_text()
    assert read_trace(path).steps == inst.steps
    old = tmp_path / "old.jsonl"  # a trace written before prompts: none known
    old.write_text("".join(
        json.dumps({k: v for k, v in json.loads(line).items() if k != "prompt"}) + "\n"
        for line in path.read_text().splitlines()))
    assert all(ts.prompt is None for s in read_trace(old).steps for ts in s)


def test_calibrate_recovers_the_group_structure(tmp_path: Path) -> None:
    """A simulated trace of retool_grouped with prompt ids (the action log's
    ``measured.prompt``), calibrated by the app: the size, and each share and
    persistence within 3 standard errors of an estimate from a trace of that size (the
    spread of the figure over independently sampled instances of the same size)."""
    w, c = profile("retool_grouped")
    w = replace(w, steps=4)
    trace = tmp_path / "grouped.jsonl"
    record_trace(w, c, trace, scheduler="fifo", seed=11)
    out = tmp_path / "cal"
    doc = run_calibrate(compose("calibrate", [f"trace={trace}", "name=grp", f"out={out}",
                                              "quiet=true", "plot=false"]))
    fitted = parse_workload(yaml.safe_load((out / "workload" / "grp.yaml").read_text()))
    g = fitted.groups
    assert g.size == 16 and doc["groups"]["prompts"] == 4 * 36
    spread = [_flat(group_figures(records_of(sample_workload(w, np.random.default_rng(s)))))
              for s in range(BATCHES)]
    sd = {k: float(np.std([r[k] for r in spread], ddof=1)) for k in spread[0]}
    truth = w.groups
    for got, want, key in ((g.turns, truth.turns, "turns"),
                           (g.generation_s, truth.generation_s, "gap.share"),
                           (g.generation_persistence, truth.generation_persistence,
                            "gap.persistence"),
                           (g.action_share("code_interpreter"), truth.duration_s,
                            "code_interpreter.share"),
                           (g.persistence, truth.persistence, "code_interpreter.persistence")):
        assert abs(got - want) <= 3 * sd[key], f"{key}: {got} for {want} (sd {sd[key]:.3f})"
    report = (out / "fit_report.md").read_text()
    assert "Prompt groups: 144 prompts of 16 responses" in report


def test_the_simulated_state_knows_each_trajectorys_prompt() -> None:
    """Schedulers and features read a trajectory's prompt and its siblings: the state's
    ``prompts`` holds the current step's groups, running and finished."""
    from metasched.agents import make_scheduler
    from metasched.sim.simulator import Simulator

    w, c = profile("retool_grouped")
    sim = Simulator(replace(w, steps=2, trajectories_per_step=64), c, 3)
    assert sim.next_decision()
    groups = sim.state.prompts
    assert len(groups) == 4 and all(len(g) == 16 for g in groups.values())
    assert all(t.prompt == p for p, g in groups.items() for t in g)
    fifo = make_scheduler("fifo")
    fifo.reset(sim.state, sim.scheduler_rng())
    while sim.state.step_index == 0 and sim.next_decision():  # on to the second step
        grants = fifo.decide(sim.state)
        for g in grants:
            sim.apply(g)
        if not grants:
            sim.wait()
    assert sim.state.step_index == 1
    assert len(sim.state.prompts) == 4 and set(sim.state.prompts).isdisjoint(groups)
