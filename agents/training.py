"""Training the learned scheduler: env construction, callbacks, the training loop.

Flow (``train``): build vectorised envs over the profile (domain randomisation and a
load curriculum as configured; ``VecNormalize`` as configured) -> behaviour-clone a
heuristic (``ppo.bc.expert``, ``rate_greedy`` by default; DAgger rounds as configured)
-> MaskablePPO with checkpoint, curriculum and scheduler-metrics callbacks -> write the
final and the best checkpoint directories. Or resume: load a checkpoint's model (weights,
optimizer state, timesteps) and ``VecNormalize`` statistics and continue to
``ppo.total_timesteps``. Or warm-start (``init``): a new run from a checkpoint's policy
weights and ``VecNormalize`` statistics, no cloning.

"Best" means one thing: the lowest mean ACT on the validation seeds
(``SchedulerMetricsCallback``), the warm-started (or resumed) policy included. Validation
uses seeds at the top of the training range (never the evaluation seeds):
``VALIDATION_SEEDS``.
"""

from __future__ import annotations

import logging
import re
import time
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from stable_baselines3.common.callbacks import BaseCallback, CallbackList, CheckpointCallback
from stable_baselines3.common.monitor import Monitor
from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv, VecNormalize

from metasched.core.cluster_config import ClusterConfig
from metasched.core.observation import ObsConfig
from metasched.envs.scheduling import ActionSchedulingEnv, Randomization, RewardConfig
from metasched.errors import ConfigError
from metasched.sim.seeds import TRAIN_SIM_SEEDS, VALIDATION_SEEDS
from metasched.sim.workload_config import WorkloadConfig

log = logging.getLogger("metasched.train")

# Observation keys VecNormalize normalises when asked: the context features only. Slot
# rows are not: per-position statistics would break the scorer's permutation
# equivariance (slot i and slot j are the same kind of row), and the presence flag the
# pooling reads must stay 0/1.
NORM_OBS_KEYS = ("backlog", "pools")


def env_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    """ActionSchedulingEnv keyword arguments from the ``env`` and ``obs`` config sections."""
    e = cfg["env"]
    r = e.get("randomization") or {}
    rand = None
    if r.get("enabled", False):
        est, scale = r.get("estimate_error"), r.get("cluster_scale")
        rand = Randomization(load=tuple(r["load"]), estimate_error=tuple(est) if est else None,
                             generation_scale=tuple(r["generation_scale"]),
                             cluster_scale=tuple(scale) if scale else None)
    return {"obs_config": ObsConfig(**cfg["obs"]), "reward": RewardConfig(**e["reward"]),
            "episode_steps": int(e["episode_steps"]), "horizon_mean_s": e.get("horizon_mean_s"),
            "max_wait_s": e.get("max_wait_s"), "randomization": rand,
            "seed_range": TRAIN_SIM_SEEDS, "estimates": e.get("estimates", "given")}


def _make_env(workload: WorkloadConfig, cluster: ClusterConfig, kwargs: dict[str, Any],
              load: float, rank: int, seed: int):
    def thunk():
        torch.set_num_threads(1)
        env = ActionSchedulingEnv(workload, cluster, load=load, **kwargs)
        env.reset(seed=seed + 1000 * rank)
        return Monitor(env)
    return thunk


def _clone_profiles(names, workload: WorkloadConfig, cluster: ClusterConfig
                    ) -> list[tuple[WorkloadConfig, ClusterConfig]]:
    """(workload, cluster) of every profile named for cloning; the training profile (or
    no names) means the training workload on its configured cluster."""
    from metasched.compose import profile

    names = list(names or [workload.name])
    return [(workload, cluster) if n == workload.name else profile(n) for n in names]


def _collect(envs: list[ActionSchedulingEnv], n: int, seed: int, expert: str, **kw
             ) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """``n`` expert-labelled decisions split evenly over ``envs``, concatenated."""
    from metasched.agents.imitation import collect_expert

    parts = [collect_expert(env, n // len(envs) + (i < n % len(envs)), seed + 7919 * i,
                            expert_name=expert, **kw) for i, env in enumerate(envs)]
    obs = {k: np.concatenate([p[0][k] for p in parts]) for k in parts[0][0]}
    return obs, np.concatenate([p[1] for p in parts])


class CurriculumCallback(BaseCallback):
    """Ramps the envs' load multiplier linearly from ``start`` to ``end`` over the first
    ``fraction`` of training (light -> heavy)."""

    def __init__(self, start: float, end: float, fraction: float, total: int) -> None:
        super().__init__()
        self.start, self.end, self.span = start, end, max(1, int(fraction * total))
        self.load = start

    def _on_step(self) -> bool:
        frac = min(1.0, self.num_timesteps / self.span)
        load = self.start + (self.end - self.start) * frac
        if abs(load - self.load) >= 0.01 or (frac == 1.0 and load != self.load):
            self.load = load
            self.training_env.env_method("set_load", load)
            self.logger.record("curriculum/load", load)
        return True


def simulate(workload: WorkloadConfig, cluster: ClusterConfig, scheduler, seeds, *,
             max_wait_s: float | None, estimates: str = "given") -> dict[str, float]:
    """Mean ACT, step time, utilisation and guard firings of ``scheduler`` over seeds."""
    from metasched.sim.simulator import Simulator, cost_model_for

    acts, steps, cpu, gpu, api, guard = [], [], [], [], [], 0
    for s in seeds:
        sim = Simulator(workload, cluster, s, max_wait_s=max_wait_s,
                        cost_model=cost_model_for(estimates))
        r = sim.run(scheduler)
        acts.append(float(r.act.mean()))
        steps.append(float(r.step_s.mean()))
        u = r.utilisation()
        cpu.append(u["cpu"])
        gpu.append(u["gpu"])
        api.append(u["api"])
        guard += r.counters["guard_fired"]
    return {"mean_act_s": float(np.mean(acts)), "mean_step_s": float(np.mean(steps)),
            "utilisation_cpu": float(np.mean(cpu)), "utilisation_gpu": float(np.mean(gpu)),
            "utilisation_api": float(np.mean(api)), "guard_fired": guard}


class SchedulerMetricsCallback(BaseCallback):
    """Every ``freq`` steps: simulate the current policy (NumPy fast path) on validation
    seeds; log mean ACT, step time, utilisation and the gap to the ``reference``
    heuristic; keep the best policy by ``select`` (mean ACT, or mean step time for the
    step objective) as a checkpoint directory."""

    def __init__(self, workload: WorkloadConfig, cluster: ClusterConfig, obs_config: ObsConfig,
                 seeds, freq: int, best_dir: Path, max_wait_s: float | None,
                 meta: dict[str, Any], reference: str = "rate_greedy",
                 estimates: str = "given", select: str = "mean_act_s") -> None:
        super().__init__()
        self.select = select
        from metasched.agents import make_scheduler

        self.workload, self.cluster, self.obs_config = workload, cluster, obs_config
        self.seeds, self.freq, self.best_dir = list(seeds), freq, best_dir
        self.max_wait_s, self.meta, self.estimates = max_wait_s, meta, estimates
        self.reference_name = reference
        self.reference = {"name": reference, **simulate(
            workload, cluster, make_scheduler(reference), self.seeds, max_wait_s=max_wait_s,
            estimates=estimates)}
        self.best: dict[str, float] | None = None
        self.history: list[dict[str, float]] = []
        self._last = 0

    def evaluate(self) -> dict[str, float]:
        from metasched.agents.learned import PolicyScheduler
        from metasched.agents.numpy_policy import NumpyPolicy

        policy = NumpyPolicy.from_sb3(self.model.policy, self.model.get_vec_normalize_env())
        sched = PolicyScheduler(policy, self.obs_config)
        m = simulate(self.workload, self.cluster, sched, self.seeds, max_wait_s=self.max_wait_s,
                     estimates=self.estimates)
        m["act_vs_reference"] = m["mean_act_s"] / self.reference["mean_act_s"]
        m["step_vs_reference"] = m["mean_step_s"] / self.reference["mean_step_s"]
        m["timesteps"] = self.num_timesteps
        return m

    def _on_training_start(self) -> None:
        self._last = self.num_timesteps  # a resumed run counts on from its checkpoint
        self.record(self.evaluate())  # the warm-started policy, before any PPO update

    def _on_step(self) -> bool:
        if self.num_timesteps - self._last < self.freq:
            return True
        self._last = self.num_timesteps
        self.record(self.evaluate())
        return True

    def record(self, m: dict[str, float]) -> None:
        from metasched.agents.checkpoint import save_checkpoint

        self.history.append(m)
        for k, v in m.items():
            if k != "timesteps":
                self.logger.record(f"scheduler/{k}", v)
        if self.best is None or m[self.select] < self.best[self.select]:
            self.best = m
            save_checkpoint(self.best_dir, self.model, self.obs_config,
                            {**self.meta, "validation": m, "reference": self.reference})
        self.logger.dump(self.num_timesteps)


def _ppo_settings(ppo: dict[str, Any]) -> dict[str, Any]:
    """MaskablePPO keyword arguments from the ``ppo`` config section."""
    out = {k: float(ppo[k]) for k in ("learning_rate", "gamma", "gae_lambda", "clip_range",
                                         "ent_coef", "vf_coef", "max_grad_norm")}
    out.update({k: int(ppo[k]) for k in ("n_steps", "batch_size", "n_epochs")})
    out["target_kl"] = None if ppo.get("target_kl") is None else float(ppo["target_kl"])
    return out


def _normalized(venv, ppo: dict[str, Any], stats: Path | None):
    """``venv`` behind ``VecNormalize`` as configured: the saved statistics of ``stats``
    (a resumed run's), else fresh ones; unwrapped when nothing is normalised."""
    norm_obs = bool(ppo.get("normalize_obs", False))
    norm_reward = bool(ppo.get("normalize_reward", False))
    if stats is not None and stats.is_file():
        venv = VecNormalize.load(str(stats), venv)
        venv.training = True
        venv.norm_obs, venv.norm_reward = norm_obs, norm_reward
        return venv
    if not (norm_obs or norm_reward):
        return venv
    # Returns of -time-in-system are large; the critic learns them better scaled.
    return VecNormalize(venv, norm_obs=norm_obs, norm_reward=norm_reward,
                        norm_obs_keys=list(NORM_OBS_KEYS) if norm_obs else None,
                        gamma=float(ppo["gamma"]))


@dataclass(frozen=True)
class ResumeFrom:
    """What a resumed run loads: the SB3 model, its ``VecNormalize`` statistics (if any
    were saved) and the timesteps it has trained."""

    model: Path
    stats: Path | None
    timesteps: int


def resume_source(cfg: dict[str, Any]) -> ResumeFrom | None:
    """What ``resume`` names, checked against the config (one-line errors), or None.

    ``resume`` is a checkpoint directory (``checkpoint/``, ``best/``) or one of the
    periodic SB3 checkpoints (``sb3_checkpoints/model_<n>_steps.zip``, its statistics
    beside it as ``model_vecnormalize_<n>_steps.pkl``)."""
    if cfg.get("resume") is not None and cfg.get("init") is not None:
        raise ConfigError("init", "give resume= (continue a run) or init= (a new run "
                          "warm-started from a checkpoint), not both")
    got = _checkpoint_source(cfg, "resume")
    if got is not None and got.timesteps >= int(cfg["ppo"]["total_timesteps"]):
        raise ConfigError("ppo.total_timesteps", f"{cfg['resume']} has trained "
                          f"{got.timesteps} timesteps already; ask for more than that to "
                          f"resume it (got {cfg['ppo']['total_timesteps']})")
    return got


def init_source(cfg: dict[str, Any]) -> ResumeFrom | None:
    """What ``init`` names (a warm start: a new run from the checkpoint's policy weights
    and ``VecNormalize`` statistics, with a fresh optimizer, timesteps counted from 0 and
    no behaviour cloning), checked against the config (one-line errors), or None. Takes
    the same checkpoints as ``resume``."""
    if cfg.get("resume") is not None and cfg.get("init") is not None:
        raise ConfigError("init", "give resume= (continue a run) or init= (a new run "
                          "warm-started from a checkpoint), not both")
    return _checkpoint_source(cfg, "init")


def _checkpoint_source(cfg: dict[str, Any], key: str) -> ResumeFrom | None:
    """The checkpoint ``cfg[key]`` names, checked against the observation and
    normalisation settings of ``cfg`` (one-line errors naming ``key``), or None."""
    from metasched.agents.checkpoint import (
        MODEL,
        VEC_NORMALIZE,
        load_metadata,
        normalization,
        resolve_scheduler,
    )

    name = cfg.get(key)
    if name is None:
        return None
    ppo = cfg["ppo"]
    periodic = re.fullmatch(r"(.+)_(\d+)_steps\.zip", Path(str(name)).name)
    if periodic is not None:
        path = Path(str(name)).resolve()
        if not path.is_file():
            raise ConfigError(key, f"{name} does not exist")
        prefix, steps = periodic.groups()
        stats = path.with_name(f"{prefix}_vecnormalize_{steps}_steps.pkl")
        got = ResumeFrom(path, stats if stats.is_file() else None, int(steps))
        saved = {"obs": None, "reward": got.stats is not None}
    else:
        path = Path(resolve_scheduler(str(name)))
        if not (path / MODEL).is_file():
            raise ConfigError(key, f"{name} is neither a checkpoint directory with "
                              f"{MODEL} nor an SB3 checkpoint (model_<n>_steps.zip)")
        try:
            meta = load_metadata(path)
        except ConfigError as e:
            raise ConfigError(key, e.problem) from None
        if meta["obs_config"] != ObsConfig(**cfg["obs"]):
            raise ConfigError("obs", f"differs from the observation {name} was trained on "
                              f"({meta['obs_config'].to_dict()})")
        stats = path / VEC_NORMALIZE
        got = ResumeFrom(path / MODEL, stats if stats.is_file() else None,
                         int((meta.get("validation") or {}).get("timesteps", 0)))
        trained = (meta.get("config") or {}).get("ppo") or {}
        if "hidden" in trained and int(trained["hidden"]) != int(ppo["hidden"]):
            raise ConfigError("ppo.hidden", f"must be {trained['hidden']} to {key} from "
                              f"{name} (its network's width; got {ppo['hidden']})")
        saved = normalization(meta)
    for k, what in (("normalize_obs", "obs"), ("normalize_reward", "reward")):
        if saved[what] is not None and bool(ppo.get(k, False)) != bool(saved[what]):
            raise ConfigError(f"ppo.{k}", f"must be {str(bool(saved[what])).lower()} to "
                              f"{key} from {name} (it was trained so)")
    if saved["obs"] and got.stats is None:
        raise ConfigError(key, f"{name} reads normalised observations but its "
                          f"statistics ({VEC_NORMALIZE}) are missing")
    return got


def _load_policy_weights(model, source: ResumeFrom) -> None:
    """Copy the policy weights of ``source`` into ``model`` (a warm start: its optimizer
    and timesteps stay fresh)."""
    from stable_baselines3.common.save_util import load_from_zip_file

    try:
        _, params, _ = load_from_zip_file(source.model, device="cpu")
        model.policy.load_state_dict(params["policy"])
    except (RuntimeError, ValueError, KeyError, TypeError, OSError, zipfile.BadZipFile) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError("init", f"cannot take the policy of {source.model} (is "
                          f"ppo.hidden the one it was trained with?): {first}") from None


def train(cfg: dict[str, Any], workload: WorkloadConfig, cluster: ClusterConfig,
          out_dir: Path, *, progress: bool = True) -> dict[str, Any]:
    """Run behaviour cloning then MaskablePPO as configured, or continue the run of the
    checkpoint ``cfg["resume"]`` names; returns a summary and writes
    ``out_dir/checkpoint`` (final), ``out_dir/best`` and TensorBoard logs."""
    from sb3_contrib import MaskablePPO

    from metasched.agents.checkpoint import save_checkpoint
    from metasched.agents.imitation import behaviour_clone
    from metasched.agents.numpy_policy import NumpyPolicy
    from metasched.agents.policy import SlotPolicy, n_parameters

    torch.set_num_threads(1)
    t_start = time.perf_counter()
    ppo, seed = cfg["ppo"], int(cfg["seed"])
    resume = resume_source(cfg)
    init = init_source(cfg)
    kwargs = env_kwargs(cfg)
    cur = cfg["env"].get("curriculum") or {}
    load0 = float(cur["load_start"]) if cur.get("enabled") else 1.0
    n_envs = int(ppo["n_envs"])
    total = int(ppo["total_timesteps"])
    thunks = [_make_env(workload, cluster, kwargs, load0, i, seed) for i in range(n_envs)]
    venv = (SubprocVecEnv(thunks) if ppo.get("vec_env") == "subproc" and n_envs > 1
            else DummyVecEnv(thunks))
    try:
        source = resume or init
        venv = _normalized(venv, ppo, None if source is None else source.stats)
        if source is not None and source.stats is None and ppo.get("normalize_reward"):
            log.warning("%s has no saved VecNormalize statistics: return statistics start "
                        "afresh", cfg["resume"] if resume is not None else cfg["init"])
        if resume is None:
            model = MaskablePPO(
                SlotPolicy, venv, **_ppo_settings(ppo),
                policy_kwargs={"hidden": int(ppo["hidden"])},
                tensorboard_log=str(out_dir / "tensorboard"), seed=seed, verbose=0)
            if init is not None:  # weights only: a new run
                _load_policy_weights(model, init)
        else:  # weights, optimizer state and timesteps from the checkpoint
            try:
                model = MaskablePPO.load(resume.model, env=venv, device="cpu",
                                         **_ppo_settings(ppo))
            except (ValueError, KeyError, OSError, zipfile.BadZipFile) as e:
                raise ConfigError("resume", f"cannot continue {resume.model} here: "
                                  f"{e}") from None
            model.tensorboard_log = str(out_dir / "tensorboard")
            model.set_random_seed(seed)
    except BaseException:
        venv.close()
        raise
    started_at = model.num_timesteps
    meta = {"training": {"seed": seed, "sim_seed_range": list(TRAIN_SIM_SEEDS),
                         "validation_seeds": list(VALIDATION_SEEDS[: int(cfg['eval']['seeds'])]),
                         "resumed_from": None if resume is None else str(resume.model),
                         "resumed_at_timesteps": started_at,
                         "initialised_from": None if init is None else str(init.model)},
            "config": cfg, "parameters": n_parameters(model.policy)}

    bc = ppo.get("bc") or {}
    bc_losses: list[float] = []
    if resume is None and init is None and int(bc.get("decisions", 0)) > 0:
        # Full load (randomised as configured): the clone must know busy clusters too.
        # The expert's decisions come from every profile in ``bc.profiles`` (the training
        # profile's own cluster for it, each other profile's own cluster for the rest).
        envs = [ActionSchedulingEnv(w, c, load=1.0, **kwargs)
                for w, c in _clone_profiles(bc.get("profiles"), workload, cluster)]
        expert = str(bc.get("expert", "rate_greedy"))
        fit = {"epochs": int(bc["epochs"]), "batch_size": int(bc["batch_size"]),
               "lr": float(bc["lr"])}
        obs, actions = _collect(envs, int(bc["decisions"]), seed, expert)
        vec_norm = model.get_vec_normalize_env()
        normalize_obs = vec_norm is not None and vec_norm.norm_obs
        if normalize_obs:
            # Clone on what the policy will read: statistics first seeded from the
            # expert's observations, then every fit's observations normalised by them.
            for k in vec_norm.norm_obs_keys:
                vec_norm.obs_rms[k].update(obs[k])

        def seen(o: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            return vec_norm.normalize_obs(o) if normalize_obs else o

        bc_losses = behaviour_clone(model.policy, seen(obs), actions, seed=seed, **fit)
        for r in range(int(bc.get("dagger_rounds", 0))):
            # DAgger: the clone drives, the expert labels; refit on everything so far.
            more_obs, more_actions = _collect(
                envs, int(bc["dagger_decisions"]), seed + 1 + r, expert,
                learner=NumpyPolicy.from_sb3(model.policy, vec_norm),
                beta=float(bc.get("dagger_beta", 0)))
            obs = {k: np.concatenate([obs[k], more_obs[k]]) for k in obs}
            actions = np.concatenate([actions, more_actions])
            bc_losses += behaviour_clone(model.policy, seen(obs), actions, seed=seed + 1 + r,
                                         **fit)

    ev = cfg["eval"]
    val_seeds = VALIDATION_SEEDS[: int(ev["seeds"])]
    val_workload = replace(workload, steps=int(cfg["env"]["episode_steps"]))
    # Validation on the cluster scaled as configured: a contended one tells policies apart.
    val_cluster = cluster.scaled(float(ev.get("cluster_scale", 1.0)), ("cpu", "gpu", "api"))
    metrics_cb = SchedulerMetricsCallback(val_workload, val_cluster, kwargs["obs_config"],
                                          val_seeds, int(ev["freq"]), out_dir / "best",
                                          kwargs["max_wait_s"], meta,
                                          reference=str(ev.get("reference", "rate_greedy")),
                                          estimates=kwargs["estimates"],
                                          select="mean_step_s" if kwargs["reward"].objective
                                          == "step" else "mean_act_s")
    callbacks = [metrics_cb,
                 CheckpointCallback(max(1, int(cfg["checkpoint_freq"]) // n_envs),
                                    str(out_dir / "sb3_checkpoints"), name_prefix="model",
                                    save_vecnormalize=True)]
    if cur.get("enabled"):
        callbacks.append(CurriculumCallback(load0, float(cur["load_end"]),
                                            float(cur["fraction"]), total))
    t_bc = time.perf_counter() - t_start
    try:
        model.learn(total - started_at, callback=CallbackList(callbacks), progress_bar=progress,
                    tb_log_name="ppo", reset_num_timesteps=resume is None)
    finally:
        venv.close()
    final = metrics_cb.history[-1]
    if final["timesteps"] != model.num_timesteps:
        final = metrics_cb.evaluate()
        metrics_cb.record(final)
    elapsed = time.perf_counter() - t_start
    summary = {"elapsed_s": elapsed, "bc_s": t_bc, "bc_losses": bc_losses,
               "resumed_from": meta["training"]["resumed_from"],
               "initialised_from": meta["training"]["initialised_from"],
               "timesteps": {"start": started_at, "end": model.num_timesteps},
               "final_validation": final, "best_validation": metrics_cb.best,
               "reference": metrics_cb.reference, "history": metrics_cb.history}
    save_checkpoint(out_dir / "checkpoint", model, kwargs["obs_config"],
                    {**meta, "validation": final, "reference": metrics_cb.reference,
                     "training_summary": {k: v for k, v in summary.items() if k != "history"}})
    return summary
