"""The command-line apps: outputs, determinism, and one-line errors for user mistakes."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from metasched.cli.eval_app import run_eval
from metasched.cli.plan_app import run_plan
from metasched.compose import compose, config_dir
from metasched.core.scheduler import Scheduler

SMALL = ["workload.trajectories_per_step=8", "workload.steps=1", "n_seeds=2"]
RESULT_KEYS = {"mean_act_s", "p50_act_s", "p95_act_s", "p99_act_s", "mean_step_s",
               "max_step_s", "utilisation", "idle_held_resource_s", "failed", "ci95",
               "guard_fired"}


def eval_cfg(*overrides):
    return compose("eval", [*SMALL, "schedulers=[static,elastic_greedy]", "workers=1",
                            *overrides])


def test_eval_outputs(tmp_path):
    doc = run_eval(eval_cfg("workload=rm_math"), tmp_path, progress=False)
    for name in ("results.json", "results.md", "act_cdf.png", "utilisation.png",
                 "step_time.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["workload"] == "rm_math" and saved["seeds"] == [1_000_000, 1_000_001]
    assert saved["lower_bound"]["mean_act_s"] > 0
    for name in ("static", "elastic_greedy"):
        s = saved["schedulers"][name]
        assert RESULT_KEYS <= set(s)
        assert set(s["utilisation"]) == set(s["idle_held_resource_s"]) == {"cpu", "gpu", "api"}
        lo, hi = s["ci95"]["mean_act_s"]
        assert lo <= s["mean_act_s"] <= hi
        assert s["p50_act_s"] <= s["p95_act_s"] <= s["p99_act_s"]
    assert doc["schedulers"]["static"]["idle_held_resource_s"]["cpu"] > 0
    assert doc["schedulers"]["elastic_greedy"]["idle_held_resource_s"]["cpu"] == 0


def test_eval_says_under_each_table_what_every_column_means(tmp_path):
    """A line under each table names each of its columns (``failed``, ``guard`` ...), says
    why ``failed`` is what it is where every scheduler has the same, and introduces
    ``static`` as today's practice."""
    run_eval(eval_cfg("+workload.max_offpolicyness=1"), tmp_path, progress=False)
    lines = (tmp_path / "results.md").read_text().splitlines()
    heads = [i for i, ln in enumerate(lines) if ln.startswith("| scheduler |")]
    assert len(heads) >= 3  # results, asynchronous rollouts, paired
    notes = []
    for i in heads:
        end = next(j for j in range(i, len(lines)) if not lines[j].startswith("|"))
        note = lines[end + 1]
        notes.append(note)
        assert lines[end] == "" and note.startswith("Columns: "), lines[i]
        for col in lines[i].strip("| ").split(" | ")[1:]:
            name = re.sub(r" \(.*\)$", "", col)
            name = {"p50": "p50/p95/p99", "p95": "p50/p95/p99", "p99": "p50/p95/p99",
                    "util cpu/gpu/api": "util", "trajectories/h ÷ ref": "÷ ref",
                    "latency ÷ ref": "÷ ref", "mean ACT ÷ ref": "÷ ref",
                    "mean step ÷ ref": "÷ ref", "mean ACT − ref s": "− ref",
                    "mean step − ref s": "− ref"}.get(name, name)
            assert f"{name}:" in note, f"{name} is not explained under its table"
    assert "`static` is today's practice" in notes[0]


def test_eval_reports_paired_comparison_against_the_best_heuristic(tmp_path):
    doc = run_eval(eval_cfg("workload=rm_math", "plots=false",
                            "schedulers=[static,fifo,elastic_greedy,checkpoints/default]"),
                   tmp_path, progress=False)
    saved = json.loads((tmp_path / "results.json").read_text())
    heuristics = ("static", "fifo", "elastic_greedy")
    best = min(heuristics, key=lambda n: saved["schedulers"][n]["mean_act_s"])
    assert saved["best_heuristic"] == saved["reference"] == best == doc["best_heuristic"]
    ref = saved["schedulers"][best]["per_seed"]
    for s in saved["schedulers"].values():
        mine = s["per_seed"]
        assert mine["seeds"] == ref["seeds"] == saved["seeds"]
        for m in ("mean_act_s", "mean_step_s"):
            p = s["paired"][m]
            assert p["ratio"] == pytest.approx(sum(mine[m]) / sum(ref[m]))
            assert p["diff"] == pytest.approx((sum(mine[m]) - sum(ref[m])) / len(ref[m]))
            for v, (lo, hi) in ((p["ratio"], p["ratio_ci95"]), (p["diff"], p["diff_ci95"])):
                assert (lo is None or lo <= v) and (hi is None or v <= hi)  # None: unbounded
    table = (tmp_path / "results.md").read_text()
    assert f"Paired against `{best}` (the best heuristic by mean ACT)" in table
    assert "| checkpoints/default |" in table.split("Paired against")[1]


def test_eval_reference_override(tmp_path):
    doc = run_eval(eval_cfg("workload=rm_math", "plots=false", "schedulers=[fifo,rate_greedy]",
                            "reference=fifo"), tmp_path, progress=False)
    s = doc["schedulers"]
    assert doc["reference"] == "fifo" and doc["best_heuristic"] == "rate_greedy"
    assert s["fifo"]["paired"]["mean_act_s"]["ratio"] == 1.0
    assert s["rate_greedy"]["paired"]["mean_act_s"]["ratio"] == pytest.approx(
        s["rate_greedy"]["mean_act_s"] / s["fifo"]["mean_act_s"])
    assert "best heuristic: `rate_greedy`" in (tmp_path / "results.md").read_text()


@pytest.mark.subprocess
def test_grid_benchmark_writes_one_table_with_paired_ratios(tmp_path):
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "grid.py"), "--seeds", "2",
                        "--points", "rm_math-gpu1,search-q0.25", "--workers", "1",
                        "--schedulers", "fifo,rate_greedy", "--versus", "fifo",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    grid = json.loads((tmp_path / "grid.json").read_text())
    assert list(grid["points"]) == ["rm_math-gpu1", "search-q0.25"]
    assert grid["points"]["rm_math-gpu1"]["overrides"] == ["cluster.gpu.devices=1"]
    for entry in grid["points"].values():
        doc = entry["results"]
        assert doc["best_heuristic"] in ("fifo", "rate_greedy") and doc["seeds"] == grid["seeds"]
        assert set(doc["schedulers"]["fifo"]["paired"]) == {"mean_act_s", "mean_step_s"}
    table = (tmp_path / "grid.md").read_text()
    assert table in r.stdout
    assert table.count("| rm_math-gpu1 (`cluster.gpu.devices=1`) |") == 2  # both tables
    assert "paired by seed against fifo" in table


@pytest.mark.subprocess
@pytest.mark.parametrize("args, field", [(["--points", "nope"], "points"),
                                         (["--seeds", "0"], "seeds"),
                                         (["--reference", "sjf", "--schedulers", "fifo"],
                                          "reference")])
def test_grid_benchmark_bad_arguments_are_one_line(args, field):
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "grid.py"), *args],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {field}: "), r.stderr


def test_eval_is_deterministic_across_runs_and_worker_counts(tmp_path):
    run_eval(eval_cfg("plots=false"), tmp_path / "a", progress=False)
    run_eval(eval_cfg("plots=false"), tmp_path / "b", progress=False)
    run_eval(eval_cfg("plots=false", "workers=2"), tmp_path / "c", progress=False)
    a, b, c = ((tmp_path / d / "results.json").read_text() for d in "abc")
    assert a == b == c


def test_eval_with_the_live_estimates(tmp_path):
    """estimates=online: schedulers see the dispatcher's cost model (learned from the
    run's measured durations); one that reads no estimates decides as before."""
    cfg = ["plots=false", "schedulers=[fifo,sjf]", "cluster.cpu.nodes=1",
           "cluster.cpu.cores_per_node=2"]  # actions queue
    prof = run_eval(eval_cfg(*cfg), tmp_path / "p", progress=False)["schedulers"]
    online = run_eval(eval_cfg(*cfg, "estimates=online"), tmp_path / "o",
                      progress=False)["schedulers"]
    assert online["fifo"]["mean_act_s"] == prof["fifo"]["mean_act_s"]
    assert online["sjf"]["mean_act_s"] != prof["sjf"]["mean_act_s"]


def test_eval_seeds_differ_from_training_seeds(tmp_path):
    from metasched.sim.seeds import TRAIN_SIM_SEEDS, VALIDATION_SEEDS

    doc = run_eval(eval_cfg("plots=false", "n_seeds=1"), tmp_path, progress=False)
    assert min(doc["seeds"]) >= max(TRAIN_SIM_SEEDS[1], VALIDATION_SEEDS[-1] + 1)


PLAN = ["workload=coding", "workload.trajectories_per_step=8", "workload.steps=1",
        "n_seeds=1", "workers=1", "resolution=0.1"]


def test_plan_finds_a_cluster_no_larger_than_full(tmp_path):
    cfg = compose("plan", [*PLAN, "scheduler=elastic_greedy"])
    doc = run_plan(cfg, tmp_path, progress=False)
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert list(saved["schedulers"]) == ["elastic_greedy"] and saved["complete"] is True
    plan = doc["schedulers"]["elastic_greedy"]
    assert saved["schedulers"]["elastic_greedy"]["scale"] == plan["scale"]
    assert 0 < plan["scale"] <= 1
    trial = next(t for t in plan["trials"] if t["scale"] == plan["scale"])
    bound = doc["target_step_s"] * (1 + doc["tolerance"])
    assert trial["meets"] and trial["mean_step_s"] <= bound
    assert all(0 <= v < 1 for v in plan["resources_saved"].values())
    # Every tested scale below the answer that was bisected missed the target.
    assert all(not t["meets"] for t in plan["trials"] if t["scale"] < plan["scale"])


def test_plan_every_scheduler_learned_included_in_one_table(tmp_path):
    cfg = compose("plan", [*PLAN, "schedulers=[fifo,elastic_greedy,checkpoints/default]"])
    doc = run_plan(cfg, tmp_path, progress=False)
    assert list(doc["schedulers"]) == ["fifo", "elastic_greedy", "checkpoints/default"]
    assert doc["target_source"] == "static on the full cluster"
    table = (tmp_path / "plan.md").read_text()
    rows = [ln for ln in table.splitlines() if ln.startswith("| ") and "---" not in ln][1:]
    assert [r.split(" | ")[0].lstrip("| ") for r in rows] == list(doc["schedulers"])
    for row, plan in zip(rows, doc["schedulers"].values(), strict=True):
        assert plan["target_step_s"] == doc["target_step_s"]
        scale = plan["scale"]
        assert (f"| {scale:.3f} |" if scale is not None else "| misses at full size |") in row
    assert doc["schedulers"]["checkpoints/default"]["scale"] is not None


@pytest.mark.subprocess
def test_plan_keeps_each_finished_plan_through_ctrl_c(tmp_path):
    """plan.json is rewritten whole as each plan finishes: a SIGINT mid-run (Ctrl-C)
    leaves every finished plan in it, marked incomplete, and says so in one line."""
    import signal
    import time

    exe = Path(sys.executable).parent / "metasched-plan"
    # Plans of about 2 s each (a searched scale, 128 trajectories), so the signal lands
    # while later plans run even on a fast, idle machine.
    plan = [a for a in PLAN if not a.startswith("workload.trajectories_per_step=")]
    p = subprocess.Popen([str(exe), *plan, "workload.trajectories_per_step=128",
                          "schedulers=[fifo,elastic_greedy,sjf,rate_greedy]",
                          "target_step_s=3000", f"hydra.run.dir={tmp_path}"], cwd="/tmp",
                         text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    saved = tmp_path / "plan.json"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not saved.exists() and p.poll() is None:
            time.sleep(0.05)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130, err
    doc = json.loads(saved.read_text())
    kept = list(doc["schedulers"])
    assert doc["complete"] is False and kept and kept == ["fifo", "elastic_greedy", "sjf",
                                                          "rate_greedy"][:len(kept)]
    assert doc["schedulers"]["fifo"]["trials"]
    assert "[1/" in out and "plans finished, kept in" in err and "Traceback" not in err
    assert err.strip().endswith("interrupted (SIGINT)")
    assert not list(tmp_path.glob(".plan.json.*"))  # no half-written file left


@pytest.mark.parametrize("tolerance, meets", [(0.0, False), (0.01, True)])
def test_plan_tolerance_decides_a_target_just_below(tmp_path, tolerance, meets):
    """A target 0.5% below the full cluster's step time: missed when matched strictly,
    met within a 1% tolerance."""
    from metasched.compose import load_profile
    from metasched.evaluation.planning import mean_step

    cfg = compose("plan", [*PLAN, "scheduler=elastic_greedy"])
    w, c = load_profile(cfg)
    full = mean_step(w, c, "elastic_greedy", {}, [1_000_000], 1, False, 300.0)
    cfg = compose("plan", [*PLAN, "scheduler=elastic_greedy", f"tolerance={tolerance}",
                           f"target_step_s={full * 0.995}"])
    plan = run_plan(cfg, tmp_path, progress=False)["schedulers"]["elastic_greedy"]
    full_trial = next(t for t in plan["trials"] if t["scale"] == 1.0)
    assert full_trial["mean_step_s"] == pytest.approx(full)
    assert full_trial["meets"] is meets
    assert (plan["scale"] is not None) is meets


class _WaitsUnlessServed(Scheduler):
    """Never grants: only the core's guard runs anything."""

    name = "waits"

    def decide(self, state):
        return []


@pytest.mark.parametrize("max_wait_s", [300, None])
def test_plan_runs_under_the_guard(tmp_path, monkeypatch, max_wait_s):
    """Plans are simulated with the starvation guard, as evaluation is: a scheduler that
    waits when only it could act is served by it; without the guard the run cannot
    finish, which is one line naming max_wait_s, not a traceback."""
    import metasched.agents as agents
    from metasched.errors import ConfigError

    monkeypatch.setitem(agents.REGISTRY, "waits", _WaitsUnlessServed)
    cfg = compose("plan", [*PLAN, "scheduler=waits", "baseline=fifo", "n_seeds=1",
                           f"max_wait_s={'null' if max_wait_s is None else max_wait_s}"])
    if max_wait_s is None:
        with pytest.raises(ConfigError) as e:
            run_plan(cfg, tmp_path, progress=False)
        assert e.value.field == "max_wait_s" and "waited when only it could act" in str(e.value)
        assert "\n" not in str(e.value)
    else:
        plan = run_plan(cfg, tmp_path, progress=False)["schedulers"]["waits"]
        assert plan["trials"][0]["mean_step_s"] > 0


@pytest.mark.subprocess
def test_plan_learned_checkpoint_from_any_directory(tmp_path):
    r = cli("metasched-plan", *PLAN, "scheduler=checkpoints/default", "workload.steps=1",
            f"hydra.run.dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert list(doc["schedulers"]) == ["checkpoints/default"]
    assert "| checkpoints/default |" in (tmp_path / "plan.md").read_text()


def cli(app: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / app
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})}, cwd="/tmp")


@pytest.mark.parametrize("app, args, field", [
    ("metasched-eval", ["workload=nope"], "workload"),
    ("metasched-eval", ["n_seeds=abc"], "n_seeds"),
    ("metasched-eval", ["schedulers=[nope]"], "schedulers"),
    ("metasched-eval", ["foo=1"], "foo"),
    ("metasched-eval", ["workload.tasks.swe.share=-1"], "workload.tasks.swe.share"),
    ("metasched-eval", ["workload.trace=/nonexistent.jsonl"], "/nonexistent.jsonl"),
    ("metasched-eval", ["n_seeds=[1"], "overrides"),
    ("metasched-eval", ["estimates=exact"], "estimates"),
    ("metasched-eval", ["reference=nope"], "reference"),
    ("metasched-eval", ["cluster.scale=0"], "cluster.scale"),
    ("metasched-plan", ["scale_pools=[disk]"], "scale_pools"),
    ("metasched-plan", ["scheduler=nope"], "scheduler"),
    ("metasched-plan", ["schedulers=[fifo,nope]"], "schedulers"),
    ("metasched-plan", ["baseline=nope"], "baseline"),
    ("metasched-plan", ["tolerance=-0.1"], "tolerance"),
    ("metasched-plan", ["resolution=0"], "resolution"),
    ("metasched-plan", ["max_wait_s=0"], "max_wait_s"),
    ("metasched-plan", ["scale_pools=[gpu]"], "scale_pools"),  # coding has no GPU
    ("metasched-train", ["obs.levels=1"], "obs.levels"),
])
@pytest.mark.subprocess
def test_bad_input_is_one_line_without_traceback(app, args, field):
    r = cli(app, *args, "hydra.run.dir=/tmp/metasched-test-bad-input")
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ") and field in lines[0]
    assert "Traceback" not in r.stderr + r.stdout


@pytest.mark.subprocess
def test_invalid_yaml_profile_is_one_line(tmp_path):
    configs = tmp_path / "configs"
    shutil.copytree(config_dir(), configs)
    (configs / "workload" / "broken.yaml").write_text("name: broken\nsteps: [1\n")
    r = cli("metasched-eval", "workload=broken", "hydra.run.dir=/tmp/metasched-test-bad-input",
            env={"METASCHED_CONFIG_DIR": str(configs)})
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "broken.yaml" in lines[0] and "invalid YAML" in lines[0]


def test_default_schedulers_including_the_shipped_checkpoint_load_and_run():
    from metasched.agents import make_scheduler
    from metasched.cli.eval_app import eval_settings
    from metasched.compose import load_profile
    from metasched.envs.scheduling import scale_workload
    from metasched.sim.simulator import Simulator

    cfg = compose("eval", ["workload=rm_math"])
    settings = eval_settings(cfg)  # resolves checkpoints/default from the repository root
    assert "checkpoints/default" in settings["schedulers"]
    w, c = load_profile(cfg)
    w = scale_workload(w, load=0.1, steps=1)
    for name in settings["schedulers"]:
        r = Simulator(w, c, 1_000_000, max_wait_s=300).run(
            make_scheduler(settings["paths"][name], **settings["params"][name]))
        assert r.counters["completed"] + r.counters["failed"] == r.counters["submitted"] > 0


@pytest.mark.subprocess
@pytest.mark.parametrize("sig, status", [("SIGTERM", 143), ("SIGHUP", 129)])
def test_a_stop_signal_ends_an_evaluation_and_its_workers_at_once(tmp_path, sig, status):
    """SIGTERM or SIGHUP sent to the app alone (as a service manager sends it): its
    worker processes end with it, the queued runs are dropped, one line, no traceback."""
    import signal
    import time

    import psutil

    exe = Path(sys.executable).parent / "metasched-eval"
    p = subprocess.Popen([str(exe), "workload=mixed", "n_seeds=200", "workers=2",
                          "schedulers=[elastic_greedy]", "plots=false",
                          f"hydra.run.dir={tmp_path}"], cwd="/tmp", text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    workers: list[psutil.Process] = []
    try:
        me = psutil.Process(p.pid)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(me.children()) < 2:  # the pool is up
            time.sleep(0.1)
        workers = me.children(recursive=True)
        assert len(workers) >= 2
        time.sleep(1.0)  # runs in progress
        t0 = time.monotonic()
        p.send_signal(getattr(signal, sig))
        _, err = p.communicate(timeout=60)
        took = time.monotonic() - t0
        _, alive = psutil.wait_procs(workers, timeout=10)  # terminated: ending, if not gone
    finally:
        p.kill()
        for w in workers:  # whatever happened above, none outlives the test
            try:
                w.kill()
            except psutil.NoSuchProcess:
                pass
    assert p.returncode == status, err
    assert err.strip().endswith(f"interrupted ({sig})") and "Traceback" not in err, err
    assert took < 20  # not the 200 seeds' worth of runs
    assert not alive
    assert not (tmp_path / "results.json").exists()


@pytest.mark.subprocess
def test_live_replay_benchmark_prints_sim_and_live_side_by_side(tmp_path):
    """One tiny step (one trajectory, durations x 0.005) simulated and replayed live, two
    rounds of a heuristic and the shipped policy: the table, and the policy's paired
    ratio against the heuristic with its interval."""
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "live_replay.py"),
                        "--trajectories", "1", "--scale", "0.005", "--repeats", "2",
                        "--sim-runs", "2", "--launch-samples", "8", "--isolation", "off",
                        "--schedulers", f"fifo,{root / 'checkpoints' / 'default'}",
                        "--trace", str(tmp_path / "live.jsonl")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    # --trace: every live run's actions (2 schedulers x 2 rounds of the one trajectory)
    lines = [json.loads(x) for x in (tmp_path / "live.jsonl").read_text().splitlines()]
    acts = [x for x in lines if x.get("type") == "action"]
    assert acts and len(acts) % 4 == 0
    assert all(x["measured"]["trajectory"] == "t0" for x in acts)
    live_acts = {}
    for name in ("fifo", str(root / "checkpoints" / "default")):
        rows = [ln for ln in r.stdout.splitlines() if ln.startswith(f"| {name} | off |")]
        assert len(rows) == 1, r.stdout
        # "mean (min–max)" over the runs where there are several: the mean comes first
        cells = [c.strip() for c in rows[0].strip("|").split("|")]
        sim_act, live_act, ratio = (float(cells[i].split()[0]) for i in (2, 3, 4))
        assert sim_act > 0 and live_act > 0
        assert ratio == pytest.approx(live_act / sim_act, rel=0.01)
        sim_step, live_step = (float(cells[i].split()[0]) for i in (5, 6))
        assert sim_step > 0 and live_step > 0
        median, mean = (float(x) for x in cells[9].split("/"))
        assert median > 0 and mean > 0  # the start-up measured here, in ms
        live_acts[name] = live_act
    paired = [ln for ln in r.stdout.splitlines() if " ÷ fifo (the best heuristic live" in ln]
    assert len(paired) == 1, r.stdout
    m = re.search(r"2 paired rounds: mean ACT ([\d.]+) \(95% CI (-?[\d.inf]+)–([\d.inf]+)\)",
                  paired[0])
    assert m, paired[0]
    ratio, lo, hi = (float(x) for x in m.groups())
    policy = live_acts[str(root / "checkpoints" / "default")]
    # The means are printed to 4 decimals (ms-scale ACTs here), the ratio to 3: equal
    # within what that rounding allows.
    rel = 0.5e-4 / policy + 0.5e-4 / live_acts["fifo"] + 0.5e-3 / ratio
    assert ratio == pytest.approx(policy / live_acts["fifo"], rel=rel + 1e-9)
    assert lo <= ratio <= hi


async def test_live_replay_sends_a_grouped_profiles_prompts(monkeypatch):
    """Replayed live, a grouped profile's trajectories name their prompts, as in
    simulation: the live dispatcher opens each trajectory with its prompt."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "live_replay", Path(__file__).resolve().parents[1] / "benchmarks" / "live_replay.py")
    lr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lr)
    opened = {}

    class Recording(lr.Dispatcher):
        def submit_job(self, job, traj):
            opened.setdefault(job.request.trajectory, traj.prompt)
            super().submit_job(job, traj)

    monkeypatch.setattr(lr, "Dispatcher", Recording)
    _, inst = lr.scaled_step("retool_grouped", 4, 1e-4, 0)
    prompts = [t.prompt for t in inst.steps[0]]
    assert None not in prompts and len(set(prompts)) < len(prompts)  # siblings share one
    await lr.live(inst, [0], "fifo", True, "off")
    assert opened == {f"t{i}": p for i, p in enumerate(prompts)}


def test_live_replay_feeds_predictor_schedulers_the_same_fitted_predictor(monkeypatch):
    """A predictor-fed scheduler replayed on a grouped profile: every simulated and
    live run gets its own copy of one predictor, fitted for the replay's time scale,
    whose groups are the step's prompt groups (the live one fed by the dispatcher)."""
    import asyncio
    import importlib.util
    import math

    from metasched.core.predictor import Predictor
    from metasched.evaluation import predictors

    spec = importlib.util.spec_from_file_location(
        "live_replay", Path(__file__).resolve().parents[1] / "benchmarks" / "live_replay.py")
    lr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lr)
    monkeypatch.setattr(predictors, "TRAIN_TRAJECTORIES", 320)  # a smaller fit, same code
    finished: dict[int, tuple[Predictor, bool, set]] = {}
    finish = Predictor.finish

    def spy(self, key, turns=None):
        if self.boost is None:  # the fit's own replay of its training trajectories
            return finish(self, key, turns)
        try:
            asyncio.get_running_loop()
            is_live = True  # the live runs run in an event loop, the simulated ones not
        except RuntimeError:
            is_live = False
        finished.setdefault(id(self), (self, is_live, set()))[2].add(self.trajs[key].group)
        finish(self, key, turns)

    monkeypatch.setattr(Predictor, "finish", spy)
    n, scale = 4, 0.001
    assert lr.main(["--profile", "retool_grouped", "--trajectories", str(n), "--scale",
                    str(scale), "--schedulers", "slack_first_predicted", "--repeats", "1",
                    "--sim-runs", "2", "--isolation", "off"]) == 0
    _, inst = lr.scaled_step("retool_grouped", n, scale, 1_000_000)
    groups = {(0, t.prompt) for t in inst.steps[0]}
    assert len(groups) < n  # siblings share a prompt
    runs = list(finished.values())
    assert sorted(is_live for _, is_live, _ in runs) == [False, False, True]
    assert all(seen == groups for _, _, seen in runs)
    assert len({id(p.boost) for p, _, _ in runs}) == 1  # one fitted model on both sides
    # fitted on the training trajectories time-scaled as the replay is
    unscaled = predictors.fitted_predictor(lr.profile("retool_grouped")[0])
    for name, mu in unscaled.mu.items():
        assert runs[0][0].mu[name] == pytest.approx(mu + math.log(scale))
        assert runs[0][0].sd[name] == pytest.approx(unscaled.sd[name])


@pytest.mark.subprocess
@pytest.mark.parametrize("args, field", [(["--isolation", "docker"], "isolation"),
                                         (["--scale", "0"], "scale"),
                                         (["--estimates", "exact"], "estimates"),
                                         (["--launch-s", "soon"], "launch-s"),
                                         # the live runs' start-up needs live runs
                                         (["--launch-s", "live"], "launch-s"),
                                         (["--schedulers", "fifo,nope"], "schedulers"),
                                         # the predictor's training seed
                                         (["--schedulers", "critical_path_predicted",
                                           "--seed", "0"], "seed"),
                                         (["--profile", "rm_math"], "profile")])
def test_live_replay_bad_arguments_are_one_line(args, field):
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "live_replay.py"),
                        "--repeats", "0", "--launch-s", "auto", *args],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {field}: "), r.stderr


@pytest.mark.subprocess
def test_live_calibration_benchmark_replays_a_trace_beside_its_runs(tmp_path):
    """On a recorded trace (the simulator's, standing in for the live runs' trace): the
    runs it holds against the replay of its calibrated profile."""
    from dataclasses import replace

    from metasched.compose import profile
    from metasched.evaluation.recording import record_trace

    w, c = profile("rm_math")
    trace = tmp_path / "runs.jsonl"
    record_trace(replace(w, steps=2, trajectories_per_step=6), c, trace, "rate_greedy", 1)
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "live_calibration.py"),
                        "--trace", str(trace), "--sim-seeds", "2", "--scheduler",
                        "rate_greedy", "--out", str(tmp_path / "o")], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "2 runs of 6 trajectories" in r.stdout
    doc = json.loads((tmp_path / "o" / "live_calibration.json").read_text())
    assert len(doc["live"]) == 2 and len(doc["simulated"]) == 2
    for row in ("mean ACT (s)", "step time (s)"):
        assert any(ln.startswith(f"| {row} |") for ln in r.stdout.splitlines())
    assert doc["mean_act_s_ratio"] > 0 and doc["step_s_ratio"] > 0
    # Both sides measured from a trace each: the replay's steps, and the tables by
    # searches per step (every live step in one row of counts) and by action type.
    assert [len(s) for s in doc["simulated_steps"]] == [2, 2]
    lo, hi = doc["mean_act_s_live_ci95"]
    assert lo <= np.mean([x["mean_act_s"] for x in doc["live"]]) <= hi
    rows = [ln.split(" | ") for ln in r.stdout.splitlines() if ln.startswith("| ")]
    by_k = [c for c in rows if c[0].lstrip("| ").isdigit()]
    assert sum(int(c[1].split()[0]) for c in by_k) == 2
    assert sum(int(c[2].split()[0]) for c in by_k) == 4
    types = {c[0].lstrip("| ") for c in rows if len(c) == 5 and c[0] != "| action type"}
    assert "reward" in types and len(types) >= 2


@pytest.mark.subprocess
@pytest.mark.parametrize("args, field", [(["--sim-seeds", "1"], "sim-seeds"),
                                         (["--seeds", "0,x"], "seeds"),
                                         (["--seeds", "5..2"], "seeds"),
                                         (["--trajectories", "0"], "trajectories"),
                                         (["--pause-s", "-1"], "pause-s"),
                                         (["--trace", "/nonexistent.jsonl"], "trace")])
def test_live_calibration_bad_arguments_are_one_line(args, field, tmp_path):
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "live_calibration.py"),
                        *args, "--out", str(tmp_path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {field}: "), r.stderr


def test_plan_default_schedulers_include_rate_greedy():
    from metasched.cli.plan_app import plan_settings

    names = plan_settings(compose("plan"))["schedulers"]
    assert "rate_greedy" in names and "random" not in names
    assert set(names) == set(compose("eval")["schedulers"]) - {"random"}


def test_plan_prints_each_probe_as_it_is_measured(tmp_path, capsys):
    from metasched.evaluation.planning import plan_capacity

    cfg = compose("plan", [*PLAN, "scheduler=elastic_greedy", "per_pool=false"])
    doc = run_plan(cfg, tmp_path, progress=False)
    out = capsys.readouterr().out
    trials = doc["schedulers"]["elastic_greedy"]["trials"]
    probes = [ln for ln in out.splitlines() if ln.startswith("  scale ")]
    assert len(probes) == len(trials) >= 2
    assert out.index("bisecting") < out.index(probes[0]) < out.index("| scheduler |")
    # Called once per measured trial, in the order they were measured.
    from metasched.compose import load_profile

    w, c = load_profile(cfg)
    seen = []
    plan = plan_capacity(w, c, "elastic_greedy", [1_000_000], target_step_s=doc["target_step_s"],
                         resolution=0.1, progress=False, on_trial=seen.append)
    assert seen == plan.trials


def _trial(scale, cpu, gpu, meets):
    from metasched.evaluation.planning import Trial

    return Trial(scale, {"cpu": cpu, "gpu": gpu, "api": 0}, 100.0 if meets else 150.0, meets)


def test_plan_names_the_whole_unit_pool_that_limits_the_joint_scale():
    """rm_math's case: 2 GPUs become 1 below scale 0.75 and one GPU misses, so the joint
    plan stops at 0.75 (cpu 25% saved) while the cpu alone saves 97%; the table says the
    gpu limits it, and a note says how to read the joint and per-pool savings."""
    from metasched.cli.plan_app import TABLE_NOTE, plan_table
    from metasched.core.cluster_config import parse_cluster
    from metasched.evaluation.planning import Plan, limiting_pools

    full = {"cpu": 128, "gpu": 2, "api": 0}
    joint = Plan("x", 100.0, "given", 0.75, full, {"cpu": 96, "gpu": 2, "api": 0},
                 [_trial(1.0, 128, 2, True), _trial(0.5, 64, 1, False),
                  _trial(0.75, 96, 2, True), _trial(0.625, 80, 1, False),
                  _trial(0.6875, 88, 1, False), _trial(0.71875, 92, 1, False)])
    cpu = Plan("x", 100.0, "given", 0.03, full, {"cpu": 4, "gpu": 2, "api": 0},
               [_trial(1.0, 128, 2, True), _trial(0.02, 2, 2, False),
                _trial(0.03, 4, 2, True)])
    gpu = Plan("x", 100.0, "given", 1.0, full, {"cpu": 128, "gpu": 2, "api": 0},
               [_trial(1.0, 128, 2, True), _trial(0.01, 128, 1, False)])
    alone = {"cpu": cpu, "gpu": gpu}
    assert limiting_pools(joint, alone) == ["gpu"]
    assert limiting_pools(joint) == ["cpu", "gpu"]  # without per-pool plans: both shrank
    assert limiting_pools(cpu) == ["cpu"] and limiting_pools(gpu) == ["gpu"]
    assert limiting_pools(Plan("x", 1.0, "given", None, full, None)) == []
    cluster = parse_cluster({"name": "c", "cpu": {"nodes": 2, "cores_per_node": 64,
                                                   "mem_gb_per_node": 256},
                             "gpu": {"devices": 2, "mem_gb": 80}})
    table = plan_table({"x": (joint, alone)}, cluster, 100.0, "given", 0.01)
    head, _, row = table.splitlines()[2:5]
    cells = dict(zip(head.strip("|").split(" | "), row.strip("|").split(" | "), strict=True))
    assert cells["limited by"].strip() == "gpu (2 → 1 misses)"
    assert cells["saved"].strip() == "cpu 25%, gpu 0%"
    assert cells["cpu alone: saved"].strip() == "97%"
    assert table.rstrip().endswith(TABLE_NOTE) and "whole units" in TABLE_NOTE


@pytest.mark.parametrize("series, groups", [
    ({"a": ([1.0, 2.0],), "b": ([1.0, 2.0],), "c": ([1.0],)}, [["a", "b"], ["c"]]),
    ({"a": ([1.0], [0.5]), "b": ([1.0], [0.6]), "c": ([1.0], [0.5])}, [["a", "c"], ["b"]]),
    ({"a": ([],), "b": ([],)}, [["a", "b"]]),
    ({"a": ([1.0],), "b": ([1.0, 1.0],)}, [["a"], ["b"]]),
])
def test_tied_groups_join_only_identical_series(series, groups):
    from metasched.evaluation.report import tied_groups

    assert tied_groups(series) == groups


def test_plots_draw_identical_series_once_labelled_with_every_name(tmp_path):
    """Schedulers whose step times (or utilisation, or ACTs) are identical share one box
    (or line) named after all of them, rather than hiding under each other."""
    import matplotlib.pyplot as plt

    from metasched.cli.eval_app import eval_settings
    from metasched.compose import load_profile
    from metasched.evaluation.report import plot_all, plot_figures
    from metasched.evaluation.runs import evaluate

    cfg = compose("eval", ["workload=rm_math", "workload.steps=2", "n_seeds=2", "workers=1",
                           "schedulers=[static,task_isolated,fifo,sjf,random]"])
    w, c = load_profile(cfg)
    s = eval_settings(cfg)
    doc, runs = evaluate(w, c, s["schedulers"], s["seeds"], params=s["params"], workers=1,
                         timeline_dt=s["timeline_dt"], max_wait_s=s["max_wait_s"],
                         paths=s["paths"], progress=False)
    figs = plot_figures(doc, runs)
    ticks = [t.get_text() for t in figs["step_time"].axes[0].get_xticklabels()]
    assert ticks == ["static\n= task_isolated", "fifo\n= sjf", "random"]
    steps = {n: [x for r in runs if r["scheduler"] == n for x in r["step_s"]]
             for n in doc["schedulers"]}
    assert steps["static"] == steps["task_isolated"] and steps["fifo"] == steps["sjf"]
    assert steps["static"] != steps["fifo"]
    cpu_legend = [t.get_text() for t in figs["utilisation"].axes[0].get_legend().get_texts()]
    assert "fifo = sjf" in cpu_legend
    for fig in figs.values():  # every name once in every legend or axis
        ax = fig.axes[0]
        labels = ([t.get_text() for t in ax.get_legend().get_texts()] if ax.get_legend()
                  else [t.get_text() for t in ax.get_xticklabels()])
        shown = [n for lab in labels for n in lab.replace("\n", " ").split(" = ")]
        assert sorted(shown) == sorted(doc["schedulers"])
        plt.close(fig)
    assert [p.name for p in plot_all(doc, runs, tmp_path)] == [
        "act_cdf.png", "utilisation.png", "step_time.png"]


def test_utilisation_legend_is_beside_the_data_and_coinciding_lines_stay_visible():
    """utilisation.png: each pool's legend lies right of its axes (never over the data),
    and its schedulers' lines are drawn widest first, so lines that coincide (every
    scheduler at full use) each show as a stripe of its own colour."""
    import matplotlib.pyplot as plt

    from metasched.cli.eval_app import eval_settings
    from metasched.compose import load_profile
    from metasched.evaluation.report import plot_figures
    from metasched.evaluation.runs import evaluate

    cfg = eval_cfg("schedulers=[static,fifo,elastic_greedy]")
    w, c = load_profile(cfg)
    s = eval_settings(cfg)
    doc, runs = evaluate(w, c, s["schedulers"], s["seeds"], params=s["params"], workers=1,
                         timeline_dt=s["timeline_dt"], max_wait_s=s["max_wait_s"],
                         paths=s["paths"], progress=False)
    fig = plot_figures(doc, runs)["utilisation"]
    fig.canvas.draw()
    for ax in fig.axes:
        legend = ax.get_legend().get_window_extent()
        assert legend.x0 >= ax.get_window_extent().x1, "the legend overlaps the axes"
        solid = [ln.get_linewidth() for ln in ax.get_lines() if ln.get_linestyle() == "-"]
        assert len(solid) >= 2 and solid == sorted(solid, reverse=True)
        assert len(set(solid)) == len(solid)
    plt.close("all")


SCRIPTS = sorted(__import__("tomllib").loads(
    (Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["scripts"])


@pytest.mark.subprocess
@pytest.mark.parametrize("app", SCRIPTS)
def test_help_says_what_the_app_does_its_settings_and_an_example(app):
    """Every app's --help (one template, configs/hydra/help/metasched.yaml): what it does,
    its main settings and examples, not Hydra's banner and a dump of the config."""
    import shlex

    r = cli(app, "--help")
    assert r.returncode == 0, r.stderr
    text = r.stdout
    name = app.removeprefix("metasched-")
    assert text.startswith(f"{app}: ") and "\nMain settings:\n" in text
    examples = text.split("\nExamples:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert examples and all(ln.startswith("  metasched-") for ln in examples)
    assert any(ln.startswith(f"  {app} ") for ln in examples)
    assert "powered by Hydra" not in text and "== Config ==" not in text
    dumped = [k for k in compose(name) if re.search(rf"^{re.escape(k)}:", text, re.M)]
    assert not dumped and len(text.splitlines()) <= 40
    for ln in examples:  # the examples' settings compose (placeholders and sweeps aside)
        args = shlex.split(ln.split("  #", 1)[0])
        if args[0] == app and "<" not in ln and not any(a.startswith("-") for a in args):
            compose(name, args[1:])
