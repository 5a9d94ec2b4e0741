"""``metasched-train`` end to end at toy sizes: checkpoints that load and run, their
metadata, TensorBoard logs, one notion of best, VecNormalize statistics saved with the
model, resuming a run, and one-line errors for bad settings."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import torch
from sb3_contrib import MaskablePPO

from metasched.agents.learned import LearnedScheduler
from metasched.compose import compose, load_profile
from metasched.core.observation import ObsConfig
from metasched.errors import ConfigError
from metasched.sim.simulator import Simulator

TINY = ["workload=rm_math", "workload.trajectories_per_step=8", "ppo.total_timesteps=512",
        "ppo.n_steps=128", "ppo.batch_size=64", "ppo.n_envs=1", "ppo.vec_env=dummy",
        "ppo.bc.decisions=300", "ppo.bc.epochs=1", "ppo.bc.dagger_decisions=100",
        "eval.freq=256", "eval.seeds=1", "checkpoint_freq=256", "env.curriculum.enabled=false"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from metasched.cli.train_app import run_train

    n = torch.get_num_threads()
    cfg = compose("train", TINY)
    out = tmp_path_factory.mktemp("train")
    summary = run_train(cfg, out, progress=False)
    torch.set_num_threads(n)
    return cfg, out, summary


@pytest.mark.parametrize("which", ["checkpoint", "best"])
def test_checkpoints_load_and_run(run, which):
    cfg, out, _ = run
    sched = LearnedScheduler(out / which)
    assert sched.obs_config == ObsConfig(**cfg["obs"])
    w, c = load_profile(cfg)
    r = Simulator(w, c, 1_000_000, max_wait_s=300.0).run(sched)
    assert r.counters["pending"] == 0
    assert r.counters["completed"] + r.counters["failed"] == r.counters["submitted"] > 0


def test_metadata_records_schema_config_seeds_and_validation(run):
    cfg, out, summary = run
    meta = json.loads((out / "checkpoint" / "metadata.json").read_text())
    schema = meta["obs_schema"]
    assert {k: schema[k] for k in cfg["obs"]} == cfg["obs"]
    assert "slot_features" in schema and "version" in schema
    assert meta["config"]["ppo"]["total_timesteps"] == 512
    assert meta["config"]["workload"]["name"] == "rm_math"
    training = meta["training"]
    assert training["seed"] == cfg["seed"]
    lo, hi = training["sim_seed_range"]
    seeds = training["validation_seeds"]
    assert len(seeds) == 1 and 0 <= lo < hi <= seeds[0] < 1_000_000  # never eval seeds
    val = meta["validation"]
    assert val["mean_act_s"] > 0 and val["timesteps"] == 512
    assert {"mean_step_s", "act_vs_reference", "guard_fired"} <= set(val)
    assert meta["reference"]["mean_act_s"] > 0
    best = json.loads((out / "best" / "metadata.json").read_text())
    assert best["validation"]["mean_act_s"] == pytest.approx(
        summary["best_validation"]["mean_act_s"])
    assert best["validation"]["mean_act_s"] <= val["mean_act_s"] + 1e-12
    assert 0 < meta["parameters"] < 50_000
    saved = json.loads((out / "train_summary.json").read_text())
    assert saved["final_validation"]["mean_act_s"] == pytest.approx(val["mean_act_s"])
    rounds = cfg["ppo"]["bc"]["dagger_rounds"]
    assert rounds >= 1  # one epoch per fit: the clone's, then one per DAgger round
    assert len(saved["bc_losses"]) == 1 + rounds and min(saved["bc_losses"]) > 0


def test_one_notion_of_best_lowest_validation_mean_act(run):
    _, out, summary = run
    history = summary["history"]
    assert len(history) >= 2 and history[0]["timesteps"] == 0  # the warm start is a candidate
    best = min(history, key=lambda m: m["mean_act_s"])
    assert summary["best_validation"] == best
    meta = json.loads((out / "best" / "metadata.json").read_text())
    assert meta["validation"] == pytest.approx(best)
    assert not (out / "sb3_best").exists() and not (out / "sb3_eval").exists()


def _stats(path):
    with open(path, "rb") as f:
        return pickle.load(f)


def test_vecnormalize_statistics_are_saved_with_the_model(run):
    cfg, out, _ = run
    assert cfg["ppo"]["normalize_reward"] and not cfg["ppo"]["normalize_obs"]
    for which in ("checkpoint", "best"):
        meta = json.loads((out / which / "metadata.json").read_text())
        assert meta["normalization"] == {"obs": False, "reward": True}
        stats = _stats(out / which / "vecnormalize.pkl")
        assert stats.norm_reward and not stats.norm_obs
    assert _stats(out / "checkpoint" / "vecnormalize.pkl").ret_rms.count > 500  # 512 steps
    periodic = sorted((out / "sb3_checkpoints").glob("*vecnormalize_*_steps.pkl"))
    assert [p.name for p in periodic] == ["model_vecnormalize_256_steps.pkl",
                                          "model_vecnormalize_512_steps.pkl"]


@pytest.fixture(scope="module")
def resumed(run, tmp_path_factory):
    from metasched.cli.train_app import run_train

    _, out, _ = run
    n = torch.get_num_threads()
    cfg = compose("train", [*TINY, f"resume={out / 'checkpoint'}", "ppo.total_timesteps=768"])
    out2 = tmp_path_factory.mktemp("resumed")
    summary = run_train(cfg, out2, progress=False)
    torch.set_num_threads(n)
    return out, out2, summary


def _adam_steps(model_zip) -> list[float]:
    state = MaskablePPO.load(model_zip, device="cpu").policy.optimizer.state_dict()["state"]
    return [float(v["step"]) for v in state.values()]


def test_resume_continues_timesteps_optimizer_and_statistics(resumed):
    out, out2, summary = resumed
    assert summary["timesteps"] == {"start": 512, "end": 768}
    assert summary["bc_losses"] == []  # no second warm start
    meta = json.loads((out2 / "checkpoint" / "metadata.json").read_text())
    assert meta["training"]["resumed_from"] == str(out / "checkpoint" / "model.zip")
    assert meta["training"]["resumed_at_timesteps"] == 512
    assert meta["validation"]["timesteps"] == 768
    assert MaskablePPO.load(out2 / "checkpoint" / "model.zip", device="cpu").num_timesteps == 768
    # Adam's moments carried over: its step count goes on from the checkpoint's (a fresh
    # optimizer would count the resumed updates alone, fewer than the first run's).
    before, after = _adam_steps(out / "checkpoint" / "model.zip"), \
        _adam_steps(out2 / "checkpoint" / "model.zip")
    assert min(after) > max(before)
    # The return statistics too: they keep counting from the checkpoint's.
    assert (_stats(out2 / "checkpoint" / "vecnormalize.pkl").ret_rms.count
            > _stats(out / "checkpoint" / "vecnormalize.pkl").ret_rms.count + 200)
    history = summary["history"]
    assert history[0]["timesteps"] == 512 and history[-1]["timesteps"] == 768


def test_resume_from_a_periodic_sb3_checkpoint(run, tmp_path):
    from metasched.cli.train_app import run_train

    _, out, _ = run
    n = torch.get_num_threads()
    zipped = out / "sb3_checkpoints" / "model_256_steps.zip"
    summary = run_train(compose("train", [*TINY, f"resume={zipped}"]), tmp_path,
                        progress=False)
    torch.set_num_threads(n)
    assert summary["timesteps"] == {"start": 256, "end": 512}
    LearnedScheduler(tmp_path / "checkpoint")


@pytest.mark.parametrize("overrides, field", [
    (["ppo.total_timesteps=512"], "ppo.total_timesteps"),  # trained that much already
    (["obs.k_slots=8"], "obs"),
    (["ppo.normalize_reward=false"], "ppo.normalize_reward"),
])
def test_bad_resume_is_one_line_before_anything_is_written(run, tmp_path, overrides, field):
    from metasched.cli.train_app import run_train

    _, out, _ = run
    cfg = compose("train", [*TINY, f"resume={out / 'checkpoint'}", *overrides])
    with pytest.raises(ConfigError) as e:
        run_train(cfg, tmp_path / "run", progress=False)
    assert e.value.field == field and "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def warm(run, tmp_path_factory):
    from metasched.cli.train_app import run_train

    _, out, _ = run
    n = torch.get_num_threads()
    cfg = compose("train", [*TINY, f"init={out / 'checkpoint'}", "ppo.total_timesteps=256",
                            "seed=3"])
    out2 = tmp_path_factory.mktemp("warm")
    summary = run_train(cfg, out2, progress=False)
    torch.set_num_threads(n)
    return out, out2, summary


def test_init_warm_starts_a_new_run_from_weights_and_statistics(warm):
    out, out2, summary = warm
    assert summary["timesteps"] == {"start": 0, "end": 256}  # a new run
    assert summary["bc_losses"] == []  # the checkpoint is the warm start: no cloning
    assert summary["initialised_from"] == str(out / "checkpoint" / "model.zip")
    meta = json.loads((out2 / "checkpoint" / "metadata.json").read_text())
    assert meta["training"]["initialised_from"] == str(out / "checkpoint" / "model.zip")
    assert meta["training"]["resumed_from"] is None
    # Before any update the policy is the checkpoint's: same validation figure as the
    # checkpoint's own on the same seeds (validation config unchanged).
    first = summary["history"][0]
    assert first["timesteps"] == 0
    saved = json.loads((out / "checkpoint" / "metadata.json").read_text())["validation"]
    assert first["mean_act_s"] == pytest.approx(saved["mean_act_s"])
    # A fresh optimizer: Adam counts only this run's updates (fewer than the first run's).
    assert max(_adam_steps(out2 / "checkpoint" / "model.zip")) < \
        min(_adam_steps(out / "checkpoint" / "model.zip"))
    # The return statistics carry over and keep counting.
    assert (_stats(out2 / "checkpoint" / "vecnormalize.pkl").ret_rms.count
            > _stats(out / "checkpoint" / "vecnormalize.pkl").ret_rms.count + 200)


@pytest.mark.parametrize("overrides, field", [
    (["resume={ckpt}"], "init"),  # both at once
    (["obs.k_slots=8"], "obs"),
    (["ppo.normalize_reward=false"], "ppo.normalize_reward"),
    (["ppo.hidden=32"], "ppo.hidden"),  # another network shape
])
def test_bad_init_is_one_line_before_anything_is_written(run, tmp_path, overrides, field):
    from metasched.cli.train_app import run_train

    _, out, _ = run
    ckpt = out / "checkpoint"
    cfg = compose("train", [*TINY, f"init={ckpt}", *(o.format(ckpt=ckpt) for o in overrides)])
    with pytest.raises(ConfigError) as e:
        run_train(cfg, tmp_path / "run", progress=False)
    assert e.value.field == field and "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()


def test_normalised_observations_are_applied_at_inference(tmp_path):
    """With ppo.normalize_obs the checkpoint's NumPy policy carries the statistics and
    decides as SB3's predict does on VecNormalize-normalised observations."""
    from stable_baselines3.common.vec_env import VecNormalize

    from metasched.cli.train_app import run_train

    n = torch.get_num_threads()
    cfg = compose("train", [*TINY, "ppo.normalize_obs=true", "ppo.total_timesteps=256"])
    run_train(cfg, tmp_path, progress=False)
    torch.set_num_threads(n)
    ckpt = tmp_path / "checkpoint"
    meta = json.loads((ckpt / "metadata.json").read_text())
    assert meta["normalization"] == {"obs": True, "reward": True}
    stats: VecNormalize = _stats(ckpt / "vecnormalize.pkl")
    assert stats.norm_obs_keys == ["backlog", "pools"]
    sched = LearnedScheduler(ckpt)
    assert set(sched.policy.obs_norm) == {"backlog", "pools"}
    model = MaskablePPO.load(ckpt / "model.zip", device="cpu")
    w, c = load_profile(cfg)
    sim = Simulator(w, c, 1_000_000, max_wait_s=300.0)
    sched.reset(sim.state, sim.scheduler_rng())
    checked = changed = 0
    while sim.next_decision():
        obs = sched.encoder.observe(sim.state)
        normed = stats.normalize_obs({k: v[None] for k, v in obs.items()})
        changed += not np.array_equal(normed["pools"][0], obs["pools"])
        want, _ = model.predict(normed, action_masks=obs["action_mask"][None].astype(bool),
                                deterministic=True)
        got = sched.policy.act(obs)
        assert got == int(np.asarray(want).item())
        g = sched.encoder.grant(sim.state, got)
        if g is None:
            sim.wait()
        else:
            sim.apply(g)
        checked += 1
    assert checked > 50 and changed == checked  # every decision read normalised features


def test_tensorboard_logs(run):
    _, out, _ = run
    events = list((out / "tensorboard").rglob("events.out.tfevents.*"))
    assert events and all(e.stat().st_size > 0 for e in events)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = set()
    for e in events:
        acc = EventAccumulator(str(e))
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    assert "scheduler/mean_act_s" in tags
    assert any(t.startswith("train/") for t in tags)


@pytest.mark.parametrize("override, field", [
    ("ppo.total_timesteps=0", "ppo.total_timesteps"),
    ("ppo.learning_rate=-1", "ppo.learning_rate"),
    ("ppo.gamma=1.5", "ppo.gamma"),
    ("obs.levels=1", "obs.levels"),
    ("obs.k_slots=0", "obs.k_slots"),
    ("obs.max_nodes=1", "obs"),          # rm_math has two nodes
    ("obs.max_services=2", "obs"),       # and three reward models
    ("seed=-1", "seed"),
    ("ppo.bc.expert=oracle", "ppo.bc.expert"),
    ("eval.reference=oracle", "eval.reference"),
    ("obs.advisor=oracle", "obs.advisor"),
    ("ppo.bc.profiles=[mixed,nosuch]", "ppo.bc.profiles[1]"),
    ("env.randomization.cluster_scale=[0.5,0.1]", "env.randomization.cluster_scale"),
    ("env.randomization.cluster_scale=[0,1]", "env.randomization.cluster_scale"),
    ("eval.cluster_scale=0", "eval.cluster_scale"),
    ("resume=/nonexistent/checkpoint", "resume"),
    ("init=/nonexistent/checkpoint", "init"),
    ("env.estimates=exact", "env.estimates"),
    ("env.reward.objective=steps", "env.reward.objective"),
    ("+workload.max_offpolicyness=1 env.reward.objective=step", "env.reward.objective"),
])
def test_bad_settings_raise_config_error(tmp_path, override, field):
    from metasched.cli.train_app import run_train

    cfg = compose("train", [*TINY, *override.split()])
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as e:
        run_train(cfg, out, progress=False)
    assert e.value.field == field
    assert "\n" not in str(e.value)
    assert not out.exists()  # rejected before anything is written


def test_curriculum_sets_the_envs_load():
    from sb3_contrib import MaskablePPO
    from stable_baselines3.common.monitor import Monitor
    from stable_baselines3.common.vec_env import DummyVecEnv

    from metasched.agents.policy import SlotPolicy
    from metasched.agents.training import CurriculumCallback
    from metasched.envs.scheduling import ActionSchedulingEnv

    w, c = load_profile(compose("train", TINY))
    venv = DummyVecEnv([lambda: Monitor(ActionSchedulingEnv(w, c, load=0.25))])
    assert venv.get_attr("load") == [0.25]
    model = MaskablePPO(SlotPolicy, venv, n_steps=64, batch_size=64, n_epochs=1, seed=0)
    cb = CurriculumCallback(0.25, 1.0, 0.5, total=256)
    model.learn(256, callback=cb)
    assert cb.load == 1.0
    assert venv.get_attr("load") == [1.0]


@pytest.mark.slow
def test_default_vec_env_subproc_with_curriculum(tmp_path):
    """The default setup: two subprocess envs and the load curriculum."""
    from metasched.cli.train_app import run_train

    n = torch.get_num_threads()
    cfg = compose("train", [*[o for o in TINY if not o.startswith(("ppo.n_envs",
                                                                   "ppo.vec_env",
                                                                   "env.curriculum"))],
                            "ppo.total_timesteps=1024", "ppo.n_envs=2",
                            "ppo.vec_env=subproc"])
    assert cfg["env"]["curriculum"]["enabled"] and cfg["ppo"]["vec_env"] == "subproc"
    summary = run_train(cfg, tmp_path, progress=False)
    torch.set_num_threads(n)
    assert summary["final_validation"]["timesteps"] >= 1024
    LearnedScheduler(tmp_path / "checkpoint")
    LearnedScheduler(tmp_path / "best")
