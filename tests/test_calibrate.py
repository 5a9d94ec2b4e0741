"""metasched-calibrate: the fits, the recovery of a known profile from a simulated trace,
the files it writes (read by the other apps) and its one-line errors."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from metasched.calibration.fits import (
    censored_quantile,
    count_quantile,
    fit_amdahl,
    fit_duration,
)
from metasched.cli.calibrate_app import run_calibrate
from metasched.compose import compose, profile
from metasched.core.cluster_config import parse_cluster
from metasched.evaluation.recording import record_trace
from metasched.sim.dists import Z90, Dist, parse_dist
from metasched.sim.trace import trace_from_workload, write_trace
from metasched.sim.workload_config import parse_workload

PY = sys.executable
PROFILE = Path(__file__).parent / "data" / "recovery_profile.yaml"
CLUSTER = {"name": "recovery", "cpu": {"nodes": 2, "cores_per_node": 32, "mem_gb_per_node": 64},
           "gpu": {"devices": 1, "mem_gb": 24},
           "api": {"endpoints": {"web": {"rpm": 1200, "max_concurrency": 32}}}}
# The recovery tolerances: relative, for medians, p90s and turn counts; absolute for
# Amdahl fractions.
TOL = 0.05
AMDAHL_TOL = 0.05
# Every checked quantile's sampling standard error is at most TOL / SE_MARGIN for the
# sample the trace holds (checked below): the tolerance is not met by luck of the seed.
SE_MARGIN = 4.0


def calibrate_app(*overrides: str) -> dict:
    """Calibrate as ``metasched-calibrate <overrides>`` does, in this process."""
    return run_calibrate(compose("calibrate", list(overrides)))


# ---------------------------------------------------------------- fits


def test_censored_quantile_is_exact_below_the_censored_and_unknown_above() -> None:
    x = np.arange(1.0, 11.0)
    cens = x >= 9  # killed at 9 and 10: only known to be longer
    assert censored_quantile(x, cens, 0.5) == pytest.approx(5.5)
    assert censored_quantile(x, cens, 0.9) is None
    assert censored_quantile(x, np.zeros(10, bool), 0.9) == pytest.approx(9.1)


@pytest.mark.parametrize(("counts", "q", "expected"), [
    ([5] * 10, 0.5, 5.0), ([5] * 10, 0.1, 4.6), ([5] * 10, 0.9, 5.4),
    ([1, 2, 3, 4], 0.5, 2.5), ([0, 0, 10, 10], 0.25, 0.0),
])
def test_count_quantile_reads_counts_as_rounded_values(counts, q, expected) -> None:
    assert count_quantile(np.array(counts), q) == pytest.approx(expected)


@pytest.mark.parametrize("spec", [{"median": 2.0, "p90": 5.0}, {"median": 0.3, "p90": 0.5,
                                                                  "p99": 3.0}])
def test_fit_duration_recovers_the_profile_form(spec: dict) -> None:
    d = parse_dist(spec, "d")
    x = d.sample(np.random.default_rng(5), 1_000_000)
    fit = fit_duration(x)
    for q, key in ((0.5, "median"), (0.9, "p90"), (0.99, "p99")):
        if key in spec:
            assert fit.quantiles[q] == pytest.approx(spec[key], rel=0.03)
    assert fit.ks < 0.01


def test_fit_duration_reads_the_tail_from_the_fraction_killed() -> None:
    d = parse_dist({"median": 1.0, "p90": 2.0, "p99": 10.0}, "d")
    x = d.sample(np.random.default_rng(7), 200_000)
    timeout = 6.0  # between the p90 and the p99: the p99 itself is never seen
    cens = x > timeout
    fit = fit_duration(np.minimum(x, timeout), cens)
    assert fit.tail_from_censoring and fit.censored == cens.sum()
    assert fit.quantiles[0.9] == pytest.approx(2.0, rel=0.02)
    assert fit.quantiles[0.99] == pytest.approx(10.0, rel=0.05)


def test_fit_amdahl_corrects_for_cores_given_by_the_estimate() -> None:
    rng = np.random.default_rng(11)
    n, p = 20_000, 0.7
    base = np.exp(rng.normal(1.0, 0.6, n))
    est = base * np.exp(0.3 * rng.standard_normal(n))
    # A scheduler that gives long-looking runs more cores: k and the base are dependent.
    cores = np.where(est > np.median(est), 8, 1) * rng.integers(1, 3, n)
    run = base * ((1 - p) + p / cores)
    fit = fit_amdahl(run, cores, est)
    assert fit is not None and fit.p == pytest.approx(p, abs=0.02)
    assert fit.core_counts == (1, 2, 8, 16)
    naive = fit_amdahl(run, cores, est, bins=1)  # no estimate bins: confounded
    assert abs(naive.p - p) > 0.1
    assert fit_amdahl(run, np.full(n, 4), est) is None  # one core count: p is unknowable
    few = np.where(np.arange(n) < 29, 1, 16)  # 29 runs off the usual count: too loose
    assert fit_amdahl(run, few, est) is None


# ---------------------------------------------------------------- recovery


def simulated_trace(path: Path, seed: int) -> tuple:
    """A trace of the known profile, recorded by the simulator under ``random``: its
    random core counts make every Amdahl fraction identifiable, and it leaves real queue
    waits, batches and timeouts."""
    w = parse_workload(yaml.safe_load(PROFILE.read_text()))
    _, n = record_trace(w, parse_cluster(CLUSTER), path, scheduler="random", seed=seed)
    return w, n


@pytest.fixture(scope="module")
def recovered(tmp_path_factory) -> dict:
    """Trace the known profile, calibrate it with the app, read back what it wrote."""
    root = tmp_path_factory.mktemp("recovery")
    trace = root / "recovery.jsonl"
    truth, n_actions = simulated_trace(trace, seed=424242)
    out = root / "configs"
    calibrate_app(f"trace={trace}", "name=rec", f"out={out}", "quiet=true")
    fitted = parse_workload(yaml.safe_load((out / "workload" / "rec.yaml").read_text()))
    doc = json.loads((out / "calibration.json").read_text())
    return {"truth": truth, "fitted": fitted, "doc": doc, "out": out, "n": n_actions}


def _types(w) -> dict[str, object]:
    out = {}
    for t in w.tasks:
        for a in t.actions:
            out[f"{t.name}/{a.name}"] = a
        out[f"{t.name}/reward"] = t.reward
    return out


LABELS = ["code/run", "code/test", "code/build", "code/reward", "judge/search", "judge/reward"]


def _se(d: Dist, q: float, n: int) -> float:
    """Relative standard error of a sample quantile of ``d`` (its log-scale slope at the
    quantile; at the p90 kink the steeper side's)."""
    z = {0.5: 0.0, 0.9: Z90}[q]
    slope = d.sigma if q == 0.5 else max(d.sigma, d.tail_sigma or d.sigma)
    density = math.exp(-z * z / 2) / math.sqrt(2 * math.pi)
    return math.sqrt(q * (1 - q) / n) / density * slope


def test_recovery_trace_is_large_enough(recovered: dict) -> None:
    assert recovered["n"] >= 20_000
    assert recovered["doc"]["actions"] == recovered["n"]


@pytest.mark.parametrize("label", LABELS)
@pytest.mark.parametrize("q", [0.5, 0.9])
def test_recovery_duration_quantiles(recovered: dict, label: str, q: float) -> None:
    true_d = _types(recovered["truth"])[label].duration_s
    fit_d = _types(recovered["fitted"])[label].duration_s
    n = recovered["doc"]["types"][label]["n"]
    assert TOL >= SE_MARGIN * _se(true_d, q, n), "the trace is too small for the tolerance"
    want, got = (float(d.quantile(np.array([q]))[0]) for d in (true_d, fit_d))
    assert got == pytest.approx(want, rel=TOL)


@pytest.mark.parametrize("task", ["code", "judge"])
@pytest.mark.parametrize("q", [0.5, 0.9])
def test_recovery_turns_and_generation_gaps(recovered: dict, task: str, q: float) -> None:
    truth = {t.name: t for t in recovered["truth"].tasks}[task]
    fitted = {t.name: t for t in recovered["fitted"].tasks}[task]
    n_traj = recovered["doc"]["tasks"][task]["trajectories"]
    assert TOL >= SE_MARGIN * _se(truth.turns, q, n_traj)
    for want, got in ((truth.turns, fitted.turns), (truth.generation_s, fitted.generation_s)):
        assert float(got.quantile(np.array([q]))[0]) == pytest.approx(
            float(want.quantile(np.array([q]))[0]), rel=TOL)
    assert fitted.share == pytest.approx(truth.share, abs=0.01)


@pytest.mark.parametrize("label", ["code/test", "code/build", "code/reward"])
def test_recovery_amdahl_fractions(recovered: dict, label: str) -> None:
    assert recovered["doc"]["types"][label]["amdahl_fitted"]
    want = _types(recovered["truth"])[label].parallel_fraction
    got = _types(recovered["fitted"])[label].parallel_fraction
    assert abs(got - want) <= AMDAHL_TOL


def test_recovery_timeouts_estimates_steps_and_services(recovered: dict) -> None:
    truth, fitted, doc = recovered["truth"], recovered["fitted"], recovered["doc"]
    run = doc["types"]["code/run"]
    # The profile's own timeout rate: P(duration > timeout) for a one-core action.
    d = _types(truth)["code/run"].duration_s
    u = math.log(_types(truth)["code/run"].timeout_s / d.median)
    z = Z90 + (u - d.sigma * Z90) / d.tail_sigma
    rate = 1 - 0.5 * math.erfc(-z / math.sqrt(2))
    se = math.sqrt(rate * (1 - rate) / run["n"])
    assert rate > 0.01
    assert abs(run["timeout_rate"] - rate) <= SE_MARGIN * se
    assert abs(run["fitted_timeout_rate"] - rate) <= SE_MARGIN * se
    # The p99 beyond the timeout comes from the fraction killed.
    assert float(_types(fitted)["code/run"].duration_s.quantile(np.array([0.99]))[0]) == (
        pytest.approx(float(d.quantile(np.array([0.99]))[0]), rel=0.1))
    assert fitted.estimate_error == pytest.approx(truth.estimate_error, abs=0.02)
    assert (fitted.steps, fitted.trajectories_per_step) == (truth.steps,
                                                            truth.trajectories_per_step)
    assert fitted.services["rm"].restore_s == truth.services["rm"].restore_s
    assert _types(fitted)["code/test"].max_cores == 8
    assert _types(fitted)["judge/search"].endpoint == "web"


@pytest.mark.subprocess
def test_calibrated_profile_runs_in_metasched_eval(recovered: dict, tmp_path: Path) -> None:
    out = recovered["out"]
    p = subprocess.run([PY, "-m", "metasched.cli.eval_app", "--config-dir", str(out),
                        "workload=rec", "workload.steps=1", "workload.trajectories_per_step=30",
                        "n_seeds=1", "schedulers=[fifo]", "plots=false", "workers=1",
                        f"hydra.run.dir={tmp_path}"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["workload"] == "rec" and res["schedulers"]["fifo"]["actions"] > 0


@pytest.mark.subprocess
@pytest.mark.parametrize("app", ["metasched.cli.plan_app", "metasched.cli.train_app"])
def test_calibrated_profile_composes_for_plan_and_train(recovered: dict, app: str) -> None:
    p = subprocess.run([PY, "-m", app, "--config-dir", str(recovered["out"]), "workload=rec",
                        "--cfg", "job"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    cfg = yaml.safe_load(p.stdout)
    assert cfg["workload"]["name"] == "rec" and cfg["cluster"]["name"] == "rec"
    assert cfg["cluster"]["cpu"]["cores_per_node"] == 32


def test_report_and_plot_are_written(recovered: dict) -> None:
    out = recovered["out"]
    report = (out / "fit_report.md").read_text()
    for label in LABELS:
        assert f"| {label} |" in report
    assert (out / "qq.png").stat().st_size > 10_000
    # Every fitted parameter is commented with its fit and sample size.
    text = (out / "workload" / "rec.yaml").read_text()
    for line in text.splitlines():
        if any(line.strip().startswith(k) for k in ("duration_s:", "turns:", "generation_s:",
                                                    "parallel_fraction:", "prob:")):
            assert "#" in line and any(ch.isdigit() for ch in line.split("#", 1)[1]), line


# ---------------------------------------------------------------- the app


def _run(args: list[str], cwd: Path) -> tuple[int, str, str]:
    """``metasched-calibrate <args>`` in a process of its own, from ``cwd``."""
    p = subprocess.run([PY, "-m", "metasched.cli.calibrate_app", *args], capture_output=True,
                       text=True, timeout=300, cwd=cwd)
    return p.returncode, p.stdout, p.stderr


@pytest.mark.subprocess
def test_base_profile_supplies_the_cluster_and_sandboxes(tmp_path: Path) -> None:
    w, c = profile("coding")
    w = type(w)(**{**{f: getattr(w, f) for f in w.__dataclass_fields__},
                   "steps": 1, "trajectories_per_step": 4})
    trace = tmp_path / "coding.jsonl"
    record_trace(w, c, trace, seed=1)
    headless = tmp_path / "headless.jsonl"
    headless.write_text("".join(trace.read_text().splitlines(keepends=True)[1:]))
    code, _, err = _run([f"trace={headless}", f"out={tmp_path / 'o'}", "quiet=true"], tmp_path)
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: base: ")
    out = tmp_path / "o"
    code, stdout, err = _run([f"trace={headless}", f"out={out}", "base=coding"], tmp_path)
    assert code == 0 and "| swe/reward |" in stdout, err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(  # nothing of Hydra's
        ["coding.jsonl", "headless.jsonl", "o"])
    cluster = yaml.safe_load((out / "cluster" / "headless.yaml").read_text())
    assert cluster["defaults"][0] == "coding"
    workload = parse_workload(yaml.safe_load((out / "workload" / "headless.yaml").read_text()))
    assert workload.tasks[0].sandbox == w.tasks[0].sandbox
    p = subprocess.run([PY, "-m", "metasched.cli.plan_app", "--config-dir", str(out),
                        "workload=headless", "--cfg", "job"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert yaml.safe_load(p.stdout)["cluster"]["cpu"]["cores_per_node"] == c.cores_per_node


@pytest.mark.parametrize(("make", "args", "message"), [
    (None, ["trace=missing.jsonl"], "error: missing.jsonl: cannot read trace"),
    (None, [], r"error: trace: required: the trace to calibrate \(metasched-calibrate trace="),
    (None, ["missing.jsonl"], "error: missing.jsonl: not a setting: settings are key=value"),
    ("plain", [], "no measured actions"),
    ("bad", [], r"error: .*t.jsonl:2: measured.status: must be one of"),
    ("good", ["name=a b"], "error: name: must be letters"),
    ("good", ["bogus=1"], "error: bogus: not a setting; --cfg job prints every setting"),
    ("good", ["base=nosuch"], "error: base: .*workload/nosuch"),
    ("good", ["plot=maybe"], "error: plot: must be true or false"),
    ("good", ["out=[1]"], "error: out: must be a non-empty string"),
])
@pytest.mark.subprocess
def test_mistakes_are_one_line(make, args, message, tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    w, c = profile("coding")
    w = type(w)(**{**{f: getattr(w, f) for f in w.__dataclass_fields__},
                   "steps": 1, "trajectories_per_step": 2})
    if make == "plain":
        write_trace(trace_from_workload(w, 0), trace)
    elif make in ("good", "bad"):
        record_trace(w, c, trace, scheduler="fifo", seed=1)
        if make == "bad":
            rows = trace.read_text().splitlines()
            rows[1] = rows[1].replace('"status":"done"', '"status":"fine"')
            trace.write_text("\n".join(rows) + "\n")
    argv = [*(args if not make else [f"trace={trace}", *args]), f"out={tmp_path / 'o'}",
            "quiet=true"]
    if "out=[1]" in args:
        argv.remove(f"out={tmp_path / 'o'}")
    code, _, err = _run(argv, tmp_path)
    assert code == 2 and err.count("\n") == 1, err
    assert re.search(message, err), err


# ---------------------------------------------------------------- agent turns


def _grouped_trace(path: Path, n_traj: int, seed: int, *, runs: int = 1,
                   restarts: bool = False, endpoint: dict | None = None) -> dict:
    """A live-like trace: each agent turn is a request of two steps (``w`` then ``r``,
    the second submitted as the first finishes) with probability 0.6, two programs
    posted at once (``t``, ``t``) with probability 0.25, else one search (``s``); LLM
    generation before each turn. ``runs`` runs appended one after the other, 10 s apart,
    reusing the trajectories' names (as a client naming them per step does); with
    ``restarts`` each run after the first is a service started anew (a cluster line of
    its own before it, as the dispatcher writes). ``endpoint``: the search quota on the
    cluster line. Returns what was drawn."""
    rng = np.random.default_rng(seed)
    header = {"type": "cluster", "name": "local",
              "cpu": {"nodes": 1, "cores_per_node": 2, "mem_gb_per_node": 8.0},
              "gpu": {"devices": 0, "mem_gb": 0.0},
              "api": {"endpoints": {"web": endpoint or {"rpm": 600.0, "max_concurrency": 4}}},
              "services": {}, "started_at": 0.0}
    lines, groups, gens, turns = [json.dumps(header)], [], [], []
    start = end = 0.0

    def line(t: float, name: str, run_s: float, traj: int, turn: int, gap: float | None,
             reward: bool) -> None:
        kind = "api" if name == "s" else "cpu"
        act = {"kind": kind, "name": name, "duration_s": run_s, "timeout_s": 60.0}
        if kind == "api":
            act["endpoint"] = "web"
        if reward:
            act["reward"] = True
        m = {"queue_s": 0.0, "run_s": run_s, "status": "done", "trajectory": f"traj-{traj}",
             "turn": turn}
        if kind == "cpu":
            m["cores"] = 1
        if gap is not None:
            m["gap_s"] = gap
        lines.append(json.dumps({"type": "action", "arrival_s": t, "task": "agent",
                                 "action": act, "measured": m}))

    for r in range(runs):
        if r and restarts:
            lines.append(json.dumps({**header, "started_at": start - 1.0}))
        for i in range(n_traj):  # a run's trajectories start together
            t = start
            k = int(rng.integers(2, 7))
            turns.append(k)
            prev_end = None
            for turn in range(k + 1):
                gen = float(rng.lognormal(0.0, 0.5))
                t += gen
                if prev_end is not None and turn < k:
                    gens.append(gen)
                gap = None if prev_end is None else t - prev_end
                if turn == k:
                    run_s = float(rng.lognormal(-1.0, 0.3))
                    line(t, "reward", run_s, i, turn, gap, True)
                    t += run_s
                    continue
                u = rng.random()
                if u < 0.5:  # a request of two steps
                    groups.append(((("w",),), (("r",),)))
                    for j, name in enumerate(("w", "r")):
                        run_s = float(rng.lognormal(-1.0, 0.3))
                        line(t, name, run_s, i, turn, gap if j == 0 else 0.002, False)
                        t += run_s + (0.002 if j == 0 else 0.0)
                elif u < 0.7:  # two programs posted at once
                    groups.append(((("t",), ("t",)),))
                    runs_s = [float(rng.lognormal(-1.0, 0.3)) for _ in range(2)]
                    for j, run_s in enumerate(sorted(runs_s)):
                        line(t, "t", run_s, i, turn, gap if j == 0 else 0.0, False)
                    t += max(runs_s)
                elif u < 0.85:  # two programs posted at once, each run after its write
                    groups.append(((("c", "x"), ("c", "x")),))
                    ends = []
                    writes_s = sorted(float(rng.lognormal(-2.0, 0.3)) for _ in range(2))
                    for j, write_s in enumerate(writes_s):
                        line(t, "c", write_s, i, turn, gap if j == 0 else 0.0, False)
                        run_s = float(rng.lognormal(0.0, 0.3))
                        line(t + write_s + 0.002, "x", run_s, i, turn, 0.002, False)
                        ends.append(t + write_s + 0.002 + run_s)
                    t = max(ends)
                else:
                    groups.append(((("s",),),))
                    run_s = float(rng.lognormal(-1.0, 0.3))
                    line(t, "s", run_s, i, turn, gap, False)
                    t += run_s
                prev_end = t
            end = max(end, t)
        start = end + 10.0  # the next run starts after this one
    path.write_text("\n".join(lines) + "\n")
    return {"groups": groups, "gens": gens, "turns": turns}


def test_turns_of_several_actions_are_fitted_as_turn_groups(tmp_path: Path) -> None:
    trace = tmp_path / "grouped.jsonl"
    drawn = _grouped_trace(trace, 200, seed=5)
    out = tmp_path / "o"
    calibrate_app(f"trace={trace}", "name=g", f"out={out}", "quiet=true", "plot=false")
    w = parse_workload(yaml.safe_load((out / "workload" / "g.yaml").read_text()))
    task = w.tasks[0]
    n = len(drawn["groups"])
    got = {g.actions: g.prob for g in task.turn_groups}
    # In the order the agent issued them: stages, a stage's chains submitted together,
    # a chain's actions each after the one before it.
    assert set(got) == {((("w",),), (("r",),)), ((("t",), ("t",)),),
                        ((("c", "x"), ("c", "x")),), ((("s",),),)}
    for g, p in got.items():
        assert p == pytest.approx(drawn["groups"].count(g) / n, abs=1e-6)
    # Turns and generation are per agent turn: the gaps inside a request are left out.
    assert task.turns.median == pytest.approx(np.median(drawn["turns"]), abs=0.5)
    assert task.generation_s.zero == 0.0
    assert task.generation_s.median == pytest.approx(np.median(drawn["gens"]), rel=1e-3)
    # The simulator draws turns as groups: each w followed by its r once it has
    # finished, the two t submitted together.
    from metasched.sim.sampling import sample_trajectory

    spec = sample_trajectory(task, np.random.default_rng(0), 0.0)
    tools = spec.turns[:-1]
    for i, t in enumerate(tools):
        if t.action.name == "w":
            assert tools[i + 1].action.name == "r" and tools[i + 1].gen_s == 0.0
            assert not t.together
        if t.action.name == "t" and t.together:
            assert tools[i + 1].action.name == "t" and not tools[i + 1].together
        if t.action.name == "c":  # c, x, c, x: the group's two chains
            assert t.chained is False and tools[i + 1].action.name == "x"
            assert tools[i + 1].chained and t.together
    assert any(t.together for t in tools) or all(t.action.name != "t" for t in tools)
    # Written and read back: the chains as lists of names in their stage.
    text = (out / "workload" / "g.yaml").read_text()
    assert '[[["c", "x"], ["c", "x"]]]' in text


def test_trajectory_names_reused_after_their_reward_are_new_trajectories(tmp_path: Path) -> None:
    from metasched.calibration.samples import read_samples

    trace = tmp_path / "appended.jsonl"
    drawn = _grouped_trace(trace, 20, seed=6, runs=3)
    samples = read_samples(trace)
    steps = samples.steps()
    assert [len(s) for s in steps] == [20, 20, 20]
    assert sorted(t.groups for s in steps for t in s) == sorted(drawn["turns"])
    # The pause between the runs (10 s here) is the profile's pause between steps.
    from metasched.calibration.profile import calibrate

    gap, n = calibrate(samples, "appended").step_gap
    assert n == 2 and gap == pytest.approx(10.0, abs=1.5)


@pytest.mark.parametrize("restarts", [True, False])
def test_steps_on_restarted_services_start_with_fresh_quotas(tmp_path: Path, restarts: bool
                                                             ) -> None:
    # Runs appended one after another, each on its own service: every step after the
    # first began with its quotas full, and the profile says so; runs of one service
    # do not (the pause alone refills them).
    trace = tmp_path / "runs.jsonl"
    _grouped_trace(trace, 10, seed=7, runs=4, restarts=restarts)
    out = tmp_path / "o"
    calibrate_app(f"trace={trace}", "name=r", f"out={out}", "quiet=true", "plot=false")
    w = parse_workload(yaml.safe_load((out / "workload" / "r.yaml").read_text()))
    assert w.step_fresh_quotas is restarts and w.steps == 4


def test_calibrated_cluster_keeps_the_quota_allowance_of_the_trace(tmp_path: Path) -> None:
    # The proxy's quota: 6 RPM derated by its 0.25 s margin (6 calls over 60.25 s). A
    # rounded rate (5.975 RPM) would admit 5 calls a window in the replay, not 6.
    from metasched.core.pools import EndpointSpec
    from metasched.serve.config import derated

    spec = derated(EndpointSpec(rpm=6.0, max_concurrency=16), 0.25)
    trace = tmp_path / "proxied.jsonl"
    _grouped_trace(trace, 10, seed=8, endpoint={"rpm": spec.rpm, "max_concurrency": 16,
                                                "window_s": spec.window_s})
    out = tmp_path / "o"
    calibrate_app(f"trace={trace}", "name=p", f"out={out}", "quiet=true", "plot=false")
    c = parse_cluster(yaml.safe_load((out / "cluster" / "p.yaml").read_text()))
    assert spec.req_capacity == 6.0
    assert c.endpoints["web"].req_capacity == spec.req_capacity
    assert c.endpoints["web"] == spec


def test_a_point_mass_at_zero() -> None:
    d = parse_dist({"median": 2.0, "p90": 4.0, "zero": 0.4}, "g", positive=False)
    x = d.sample(np.random.default_rng(1), 100_000)
    assert (x == 0).mean() == pytest.approx(0.4, abs=0.01)
    assert np.median(x[x > 0]) == pytest.approx(2.0, rel=0.02)
    assert d.quantile([0.2, 0.4 + 0.6 * 0.5]).tolist() == pytest.approx([0.0, 2.0])
    from metasched.calibration.fits import dist_cdf, fit_gaps

    assert float(dist_cdf(d, np.array([0.0]))[0]) == pytest.approx(0.4)
    fit = fit_gaps(x)
    assert fit.zero == pytest.approx(0.4, abs=0.01)
    assert fit.config()["median"] == pytest.approx(2.0, rel=0.03)
    assert fit_gaps(x[x > 0]).zero == 0.0 and "zero" not in fit_gaps(x[x > 0]).config()


@pytest.mark.parametrize("spec, positive, field", [
    ({"median": 1.0, "zero": 0.1}, True, "d.zero"),     # durations cannot be 0
    ({"median": 1.0, "zero": 1.0}, False, "d.zero"),
    ({"median": 1.0, "zero": -0.1}, False, "d.zero"),
])
def test_bad_zero_is_one_line(spec, positive, field) -> None:
    from metasched.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        parse_dist(spec, "d", positive=positive)
    assert e.value.field == field and "\n" not in str(e.value)


@pytest.mark.parametrize("groups, message", [
    ([{"prob": 1.0, "actions": ["nope"]}], "unknown action 'nope'"),
    ([{"prob": 0.5, "actions": ["test"]}], "must sum to 1"),
    ([{"prob": 1.0, "actions": []}], "actions: must have at least 1 item(s)"),
    ([{"prob": 1.0, "actions": [["test", []]]}], "a chain must be a non-empty list"),
    ([{"prob": 1.0, "actions": [[["test", ["test"]]]]}], "a chain must be a non-empty list"),
    ([{"prob": 1.0, "actions": [[["test", "nope"]]]}], "unknown action 'nope'"),
    ("test", "turn_groups: must be a list"),
    ([], "turn_groups: must have at least 1 item(s)"),
])
def test_bad_turn_groups_are_one_line(groups, message) -> None:
    from metasched.errors import ConfigError

    d = yaml.safe_load(PROFILE.read_text())
    task = next(iter(d["tasks"].values()))
    task["actions"] = {"test": next(iter(task["actions"].values()))}
    task["actions"]["test"]["prob"] = 1.0
    task["turn_groups"] = groups
    with pytest.raises(ConfigError) as e:
        parse_workload(d)
    assert message in str(e.value) and "turn_groups" in e.value.field
