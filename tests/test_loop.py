"""``metasched-loop``: calibrate -> train warm-started -> evaluate -> switch or keep, end
to end on a small trace at a tiny budget; the recommendation rule; one-line errors."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from metasched.cli.loop_app import RETRAINED, SHIPPED, recommend, run_loop
from metasched.compose import compose, profile
from metasched.errors import ConfigError
from metasched.evaluation.recording import record_trace

# A budget and a trainer small enough for the default suite; the loop's own stages.
TINY_TRAIN = ['train_overrides=["eval.cluster_scale=1.0","eval.seeds=1","eval.freq=128",'
              '"env.curriculum.enabled=false","ppo.n_steps=128","ppo.batch_size=64",'
              '"ppo.n_envs=1","ppo.vec_env=dummy","checkpoint_freq=256"]']


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    """A recorded trace of two RL steps of rm_math (cpu and gpu actions)."""
    w, c = profile("rm_math")
    w = replace(w, steps=2, trajectories_per_step=8)
    path = tmp_path_factory.mktemp("trace") / "small.jsonl"
    record_trace(w, c, path, scheduler="rate_greedy", seed=3)
    return path


@pytest.fixture(scope="module")
def looped(trace, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("loop")
    n = torch.get_num_threads()
    cfg = compose("loop", [f"trace={trace}", "budget=256", "evaluation.n_seeds=2",
                           "evaluation.workers=1", *TINY_TRAIN])
    result = run_loop(cfg, out, progress=False)
    torch.set_num_threads(n)
    return out, result


def test_the_loop_writes_profile_checkpoint_evaluation_and_summary(looped) -> None:
    out, result = looped
    assert (out / "profile" / "workload" / "small.yaml").is_file()
    assert (out / "profile" / "cluster" / "small.yaml").is_file()
    assert (out / "eval" / "results.json").is_file()
    saved = json.loads((out / "loop.json").read_text())
    assert saved["recommendation"] == result["recommendation"]
    assert saved["new_checkpoint"] == str(out / "checkpoint")
    # The new checkpoint is the warm-started run's best, a new run from the shipped one.
    meta = json.loads((out / "checkpoint" / "metadata.json").read_text())
    assert meta["training"]["initialised_from"].endswith("checkpoints/per_action/model.zip")
    assert meta["training"]["resumed_from"] is None
    assert meta["config"]["workload"]["name"] == "small"
    assert meta["config"]["ppo"]["bc"]["decisions"] == 0
    assert result["training"]["timesteps"] == {"start": 0, "end": 256}
    assert result["training"]["warm_start_validation"]["timesteps"] == 0
    for stage in ("calibrate_s", "train_s", "evaluate_s", "total_s"):
        assert result["timings"][stage] > 0


def test_the_loop_evaluates_both_policies_and_the_heuristics_on_held_out_seeds(looped) -> None:
    out, result = looped
    doc = json.loads((out / "eval" / "results.json").read_text())
    assert set(doc["schedulers"]) == {"fifo", "elastic_greedy", "rate_greedy", SHIPPED,
                                      RETRAINED}
    assert doc["seeds"] == result["seeds"] == [1_000_000, 1_000_001]
    assert result["best_heuristic"] == doc["best_heuristic"]
    # The paired comparison with the current policy is the one the recommendation uses.
    from metasched.evaluation.statistics import paired_comparison

    per = {n: doc["schedulers"][n]["per_seed"] for n in (SHIPPED, RETRAINED)}
    want = paired_comparison(per[RETRAINED]["mean_act_s"], per[SHIPPED]["mean_act_s"])
    got = result["retrained_vs_current"]["mean_act_s"]
    assert got["ratio"] == pytest.approx(want["ratio"])
    assert got["ratio_ci95"] == pytest.approx(want["ratio_ci95"])
    assert result["recommendation"] == recommend(result["retrained_vs_current"])
    assert result["retrained_vs_best_heuristic"]["mean_act_s"]["ratio"] > 0


def _cmp(ratio: float, lo: float, hi: float) -> dict:
    return {"ratio": ratio, "ratio_ci95": [lo, hi], "diff": 0.0, "diff_ci95": [0.0, 0.0]}


@pytest.mark.parametrize("act, step, decision", [
    ((0.90, 0.85, 0.95), (1.0, 0.99, 1.01), "switch"),   # clearly better, step the same
    ((0.90, 0.85, 0.95), (0.9, 0.85, 0.95), "switch"),   # better on both
    ((0.97, 0.90, 1.04), (1.0, 0.99, 1.01), "keep"),     # the CI reaches 1
    ((1.00, 1.00, 1.00), (1.0, 1.00, 1.00), "keep"),     # the same decisions
    ((1.10, 1.05, 1.15), (1.0, 0.99, 1.01), "keep"),     # worse
    ((0.90, 0.85, 0.95), (1.1, 1.05, 1.15), "keep"),     # faster actions, slower steps
    ((0.90, -math.inf, math.inf), (1.0, 1.0, 1.0), "keep"),  # an unbounded interval
])
def test_recommendation_rule(act, step, decision) -> None:
    rec = recommend({"mean_act_s": _cmp(*act), "mean_step_s": _cmp(*step)})
    assert rec["decision"] == decision
    assert "CI" in rec["why"] and rec["rule"].startswith("switch only if")


@pytest.mark.parametrize("overrides, field", [
    ([], "trace"),
    (["trace=/nonexistent/trace.jsonl"], "trace"),
    (["trace={trace}", "checkpoint=/nonexistent/ckpt"], "checkpoint"),
    (["trace={trace}", "checkpoint=checkpoints/default"], "checkpoint"),  # the meta-policy
    (["trace={trace}", "evaluation.heuristics=[fifo,oracle]"], "evaluation.heuristics[1]"),
    (["trace={trace}", "evaluation.n_seeds=1"], "evaluation.n_seeds"),
    (["trace={trace}", "evaluation.seed_offset=5"], "evaluation.seed_offset"),  # not held out
    (["trace={trace}", "budget=0"], "budget"),
    (["trace={trace}", "evaluation.estimates=exact"], "evaluation.estimates"),
])
def test_bad_settings_are_one_line_before_anything_is_written(trace, tmp_path, overrides,
                                                              field) -> None:
    cfg = compose("loop", [o.format(trace=trace) for o in overrides])
    with pytest.raises(ConfigError) as e:
        run_loop(cfg, tmp_path / "run", progress=False)
    assert e.value.field == field and "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()


def _app(*args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "metasched-loop"
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=120,
                          cwd="/tmp", env=dict(os.environ))


@pytest.mark.parametrize("make, message", [
    ("missing", "error: trace: /nonexistent/live.jsonl: no such file"),
    ("empty", "no measured actions"),
])
@pytest.mark.subprocess
def test_a_bad_trace_is_one_line_exit_2(tmp_path, make, message) -> None:
    path = "/nonexistent/live.jsonl"
    if make == "empty":
        path = str(tmp_path / "empty.jsonl")
        Path(path).write_text("")
    p = _app(f"trace={path}", f"hydra.run.dir={tmp_path / 'run'}")
    assert p.returncode == 2, p.stderr
    assert p.stderr.count("\n") == 1 and message in p.stderr and "Traceback" not in p.stderr
