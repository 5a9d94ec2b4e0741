"""No predictor figure of a trace replay reads a model fitted on what it replays: the
cross-fitted predictor (metasched.core.predictor_folds), the evaluation's
``predictor.fit_on`` and the dispatcher's refusal of its own trace."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import metasched.core.predictor_folds as folds_mod
from metasched.compose import profile
from metasched.core.predictor import Predictor, records_of
from metasched.core.predictor_folds import CrossFitted, fold_of, folds_of
from metasched.errors import ConfigError
from metasched.evaluation.predictors import fitted_predictor
from metasched.evaluation.runs import Job, run_job
from metasched.sim.sampling import sample_workload
from metasched.sim.trace import read_trace, trace_from_workload, write_trace


def _trace(tmp_path: Path, prompts: bool = True, steps: int = 2) -> Path:
    w, _ = profile("retool_grouped")
    w = replace(w, steps=steps, trajectories_per_step=64)
    inst = trace_from_workload(w, seed=3)
    if not prompts:
        inst = replace(inst, steps=[[replace(t, prompt=None) for t in s] for s in inst.steps])
    path = tmp_path / "t.jsonl"
    write_trace(inst, path)
    return path


def test_each_trajectory_is_served_by_a_model_that_never_saw_its_prompt(tmp_path, monkeypatch):
    steps = read_trace(_trace(tmp_path)).steps
    records = records_of(steps)
    fits = []
    real_fit = Predictor.fit.__func__

    def spy(cls, recs, design="linear", prompts=None):
        fits.append({r.group for r in recs})
        return real_fit(cls, recs, design, prompts)

    monkeypatch.setattr(folds_mod.Predictor, "fit", classmethod(spy))
    cf = CrossFitted.fit(records, folds_of(steps, 5), 5, "shrinkage")
    assert len(fits) == 5
    for i, step in enumerate(steps):
        for ts in step:
            k = fold_of(ts.prompt, i, 5)
            assert (i, ts.prompt) not in fits[k]
            assert any((i, ts.prompt) in f for j, f in enumerate(fits) if j != k)
    # Siblings share a fold; the fold of a live trajectory is its prompt's.
    traj = type("T", (), {"id": 7, "prompt": steps[0][0].prompt, "step": 0})()
    assert cf._of_traj(traj) is cf.parts[fold_of(steps[0][0].prompt, 0, 5)]


def test_a_trace_replay_is_cross_fitted_and_runs(tmp_path: Path) -> None:
    path = _trace(tmp_path)
    w, c = profile("retool_grouped", [f"workload.trace={path}"])
    assert isinstance(fitted_predictor(w), CrossFitted)
    assert isinstance(fitted_predictor(w, fit_on=str(path)), Predictor)
    r = run_job(Job(w, c, "critical_path_predicted", {}, seed=0, max_wait_s=300.0))
    assert len(r["act"]) > 0 and len(r["step_s"]) == 2


@pytest.mark.parametrize(("fit_on", "prompts", "steps", "message"), [
    ("cross", True, 2, None),
    ("nowhere.jsonl", True, 2, "nowhere.jsonl"),
    ("auto", False, 1, "cross-fitting needs prompt ids or several RL steps"),
])
def test_fit_on_errors_are_one_line(tmp_path, fit_on, prompts, steps, message) -> None:
    w, _ = profile("retool_grouped", [f"workload.trace={_trace(tmp_path, prompts, steps)}"])
    if message is None:
        assert isinstance(fitted_predictor(w, fit_on=fit_on), CrossFitted)
        return
    with pytest.raises(ConfigError, match=message):
        fitted_predictor(w, fit_on=fit_on)


def test_cross_is_for_a_trace_workload() -> None:
    w, _ = profile("retool_grouped")
    with pytest.raises(ConfigError, match="cross is for a trace workload"):
        fitted_predictor(replace(w, steps=1), fit_on="cross")


def test_a_prompt_less_trace_of_several_steps_folds_by_step(tmp_path: Path) -> None:
    steps = read_trace(_trace(tmp_path, prompts=False, steps=3)).steps
    assert folds_of(steps, 5) == [i for i, s in enumerate(steps) for _ in s]
    assert np.unique(folds_of(sample_workload(replace(profile("retool_grouped")[0], steps=1),
                                              np.random.default_rng(0)).steps, 5)).size > 1
