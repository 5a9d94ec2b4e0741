"""Checkpoint directories: round trip, schema checks with one-line errors, loading by
path through ``make_scheduler`` and ``metasched-eval``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import needs_train
from helpers import shrunk as shared_shrunk

from metasched.agents import make_scheduler
from metasched.agents.checkpoint import (
    METADATA,
    MODEL,
    WEIGHTS,
    is_checkpoint,
    load_metadata,
    save_checkpoint,
)
from metasched.agents.learned import LearnedScheduler, PolicyScheduler
from metasched.agents.numpy_policy import NumpyPolicy
from metasched.compose import compose, package_dir
from metasched.core.observation import OBS_SCHEMA_VERSION, SLOT_FEATURES, ObsConfig
from metasched.envs.scheduling import ActionSchedulingEnv
from metasched.errors import ConfigError
from metasched.sim.simulator import Simulator

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def shrunk(name: str):
    return shared_shrunk(name, steps=1)


@pytest.fixture(scope="module")
def model():
    from sb3_contrib import MaskablePPO

    from metasched.agents.policy import SlotPolicy

    w, c = shrunk("rm_math")
    env = ActionSchedulingEnv(w, c)
    return MaskablePPO(SlotPolicy, env, n_steps=64, batch_size=64, seed=0, verbose=0)


@pytest.fixture
def saved(tmp_path, model):
    """A checkpoint saved from an SB3 model (needs the train extra)."""
    return save_checkpoint(tmp_path / "ckpt", model, ObsConfig(),
                           {"config": {"seed": 3}, "validation": {"mean_act_s": 1.5}})


@pytest.fixture
def ckpt(tmp_path):
    """A copy of the shipped per-action checkpoint (the checks below need no torch)."""
    return Path(shutil.copytree(package_dir("metasched.checkpoints") / "per_action",
                                tmp_path / "ckpt"))


def assert_one_line_naming(err: ConfigError, path) -> None:
    msg = str(err)
    assert "\n" not in msg and "\r" not in msg
    assert str(path) in msg
    assert err.field == "checkpoint"


# ------------------------------------------------------------------ round trip


@needs_train
def test_round_trip(saved, model):
    import torch
    from sb3_contrib import MaskablePPO

    ckpt = saved
    assert sorted(p.name for p in ckpt.iterdir()) == sorted([METADATA, MODEL, WEIGHTS])
    assert is_checkpoint(ckpt) and not is_checkpoint(ckpt / METADATA)
    meta = load_metadata(ckpt)
    assert meta["obs_config"] == ObsConfig()
    assert meta["obs_schema"]["version"] == OBS_SCHEMA_VERSION
    assert meta["obs_schema"]["slot_features"] == list(SLOT_FEATURES)
    assert meta["config"] == {"seed": 3} and meta["validation"] == {"mean_act_s": 1.5}
    sched = LearnedScheduler(ckpt)
    assert sched.obs_config == ObsConfig() and sched.name == str(ckpt)
    ref = NumpyPolicy.from_sb3(model.policy)
    for k, v in ref.w.items():
        np.testing.assert_array_equal(sched.policy.w[k], v)
    # The loaded scheduler runs exactly like the in-memory policy.
    w, c = shrunk("rm_math")
    r1 = Simulator(w, c, 5, max_wait_s=300.0).run(sched)
    r2 = Simulator(w, c, 5, max_wait_s=300.0).run(PolicyScheduler(ref, ObsConfig()))
    assert r1.counters["pending"] == 0 and r1.act.size > 0
    assert np.array_equal(r1.start, r2.start) and np.array_equal(r1.end, r2.end)
    # The SB3 model loads back for resuming.
    again = MaskablePPO.load(ckpt / MODEL)
    for p, q in zip(again.policy.parameters(), model.policy.parameters(), strict=True):
        assert torch.equal(p.cpu(), q.cpu())


def test_make_scheduler_by_path(ckpt):
    s = make_scheduler(str(ckpt))
    assert isinstance(s, LearnedScheduler)
    with pytest.raises(ConfigError, match="unknown scheduler"):
        make_scheduler(str(ckpt / "nope"))


# ------------------------------------------------------------------ schema checks


def _edit_meta(ckpt, fn) -> None:
    meta = json.loads((ckpt / METADATA).read_text())
    fn(meta)
    (ckpt / METADATA).write_text(json.dumps(meta))


def test_other_schema_version_rejected(ckpt):
    _edit_meta(ckpt, lambda m: m["obs_schema"].update(version=OBS_SCHEMA_VERSION + 1))
    for load in (load_metadata, LearnedScheduler, make_scheduler):
        with pytest.raises(ConfigError, match=f"v{OBS_SCHEMA_VERSION + 1}") as e:
            load(str(ckpt))
        assert_one_line_naming(e.value, ckpt)


@pytest.mark.parametrize("edit", [
    lambda f: f[:-1],                      # a feature dropped
    lambda f: [*f, "new_feature"],         # one added
    lambda f: [f[1], f[0], *f[2:]],        # two swapped
], ids=["dropped", "added", "swapped"])
def test_other_slot_features_rejected(ckpt, edit):
    _edit_meta(ckpt, lambda m: m["obs_schema"].update(slot_features=edit(
        m["obs_schema"]["slot_features"])))
    with pytest.raises(ConfigError, match="slot_features") as e:
        LearnedScheduler(ckpt)
    assert_one_line_naming(e.value, ckpt)


@pytest.mark.parametrize("text", ["{not json", "", "[]", "null", '{"obs_schema": 3}',
                                  '{"obs_schema": {"version": 1}}', "{\n\"a\":\n"])
def test_corrupt_metadata_rejected(ckpt, text):
    (ckpt / METADATA).write_text(text)
    with pytest.raises(ConfigError) as e:
        LearnedScheduler(ckpt)
    assert_one_line_naming(e.value, ckpt)


def test_checkpoint_from_before_a_new_obs_field(ckpt):
    """A checkpoint saved before ``ObsConfig`` grew a field (``advisor``) and its slot
    features: rejected with a one-line error naming the checkpoint."""
    def old(meta):
        meta["obs_schema"].pop("advisor")
        meta["obs_schema"]["slot_features"] = [
            f for f in meta["obs_schema"]["slot_features"] if not f.startswith("advised")]
    _edit_meta(ckpt, old)
    with pytest.raises(ConfigError) as e:
        LearnedScheduler(ckpt)
    assert_one_line_naming(e.value, ckpt)


def test_checkpoint_from_before_a_new_obs_field_says_retrain(ckpt):
    _edit_meta(ckpt, lambda m: m["obs_schema"].pop("advisor"))
    with pytest.raises(ConfigError, match="Retrain") as e:
        LearnedScheduler(ckpt)
    assert "advisor" in str(e.value) and "unreadable" not in str(e.value)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(ConfigError, match="not a checkpoint") as e:
        load_metadata(tmp_path)
    assert_one_line_naming(e.value, tmp_path)


@pytest.mark.parametrize("damage", ["missing", "garbage"])
def test_unreadable_weights_rejected(ckpt, damage):
    if damage == "missing":
        (ckpt / WEIGHTS).unlink()
    else:
        (ckpt / WEIGHTS).write_bytes(b"not an npz file")
    with pytest.raises(ConfigError) as e:
        LearnedScheduler(ckpt)
    assert_one_line_naming(e.value, ckpt)


def test_truncated_weights_rejected(ckpt):
    data = (ckpt / WEIGHTS).read_bytes()
    (ckpt / WEIGHTS).write_bytes(data[: len(data) // 2])  # e.g. a save interrupted
    with pytest.raises(ConfigError) as e:
        LearnedScheduler(ckpt)
    assert_one_line_naming(e.value, ckpt)


@needs_train
def test_caps_too_small_for_the_cluster(tmp_path, model):
    # Saved for at most one node; coding has four: a one-line error on use.
    path = save_checkpoint(tmp_path / "small", model, ObsConfig(max_nodes=1), {})
    sched = LearnedScheduler(path)
    w, c = shrunk("coding")
    with pytest.raises(ConfigError, match="CPU nodes") as e:
        Simulator(w, c, 0).run(sched)
    assert "\n" not in str(e.value) and str(path) in str(e.value)


# ------------------------------------------------------------------ metasched-eval


def test_eval_app_with_checkpoint(tmp_path, ckpt, capsys):
    from metasched.cli.eval_app import run_eval

    cfg = compose("eval", ["workload=rm_math", f"schedulers=[elastic_greedy,'{ckpt}']",
                           "n_seeds=1", "workers=1", "plots=false",
                           "workload.trajectories_per_step=8", "workload.steps=1"])
    out = tmp_path / "eval"
    doc = run_eval(cfg, out, progress=False)
    saved = json.loads((out / "results.json").read_text())
    assert list(saved["schedulers"]) == ["elastic_greedy", str(ckpt)] == list(doc["schedulers"])
    for name, res in saved["schedulers"].items():
        assert isinstance(res["guard_fired"], int) and res["guard_fired"] >= 0, name
        assert res["actions"] > 0 and res["mean_act_s"] > 0, name
    # Both ran the same workload instance.
    a, b = saved["schedulers"].values()
    assert a["actions"] == b["actions"]
    assert (out / "results.md").is_file()
    assert not list(out.glob("*.png"))  # plots=false


def test_eval_app_rejects_a_broken_checkpoint(tmp_path, ckpt):
    from metasched.cli.eval_app import run_eval

    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    (broken / METADATA).write_text("{oops")
    cfg = compose("eval", ["workload=rm_math", f"schedulers=[elastic_greedy,'{broken}']",
                           "n_seeds=1", "workers=1", "plots=false",
                           "workload.trajectories_per_step=8", "workload.steps=1"])
    with pytest.raises(ConfigError) as e:
        run_eval(cfg, tmp_path / "eval", progress=False)
    assert "\n" not in str(e.value) and str(broken) in str(e.value)
    assert not (tmp_path / "eval" / "results.json").exists()


def test_eval_app_relative_checkpoint_in_worker_processes(tmp_path, ckpt, monkeypatch):
    """A checkpoint named relative to the working directory, run by the default worker
    pool (the name is resolved before the jobs go to other processes)."""
    from metasched.cli.eval_app import run_eval

    shutil.copytree(ckpt, tmp_path / "runs" / "mine")
    monkeypatch.chdir(tmp_path)
    cfg = compose("eval", ["workload=rm_math", "schedulers=[fifo,runs/mine]", "n_seeds=2",
                           "workers=2", "plots=false", "workload.trajectories_per_step=8",
                           "workload.steps=1"])
    doc = run_eval(cfg, tmp_path / "eval", progress=False)
    assert list(doc["schedulers"]) == ["fifo", "runs/mine"]
    assert doc["seeds"] == [1_000_000, 1_000_001]
    res = doc["schedulers"]["runs/mine"]
    assert res["actions"] > 0 and res["decisions"] > 0 and "guard_fired" in res


def test_the_shipped_meta_policy_is_no_warm_start(tmp_path):
    meta = Path(shutil.copytree(package_dir("metasched.checkpoints") / "default",
                                tmp_path / "meta"))
    with pytest.raises(ConfigError, match="meta-policy over the rules") as e:
        load_metadata(meta)
    assert_one_line_naming(e.value, meta)
