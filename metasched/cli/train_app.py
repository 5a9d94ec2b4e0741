"""``metasched-train``: train a learned scheduler (behaviour cloning, then MaskablePPO).

Examples::

    metasched-train                                   # the default config (configs/train.yaml)
    metasched-train workload=rm_math ppo.total_timesteps=100000
    metasched-train --multirun seed=0,1,2             # a sweep, one run directory each
    metasched-train resume=outputs/train/mixed/<run>/checkpoint ppo.total_timesteps=600000
    metasched-train init=checkpoints/per_action ppo.bc.decisions=0   # a warm start

A run directory holds ``checkpoint/`` (final), ``best/`` (lowest validation mean ACT;
mean step with ``env.reward.objective=step``),
``tensorboard/`` (``tensorboard --logdir <run dir>/tensorboard``), periodic SB3
checkpoints (``sb3_checkpoints/``, with their VecNormalize statistics) and
``train_summary.json``. ``resume=<checkpoint>`` continues a run into a new run directory
(weights, optimizer state, timesteps and VecNormalize statistics; the other settings
from the command line, as for a fresh run) up to ``ppo.total_timesteps``.
``init=<checkpoint>`` starts a new run from a checkpoint's policy weights and VecNormalize
statistics (a fresh optimizer, timesteps from 0, no behaviour cloning).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any, Literal

from metasched.cli.app import make_main
from metasched.cli.output import json_safe
from metasched.compose import load_profile
from metasched.core.schema import Count, Number, parse
from metasched.errors import ConfigError, one_of
from metasched.sim.simulator import ESTIMATES

_POSITIVE = ("total_timesteps", "n_envs", "n_steps", "batch_size", "n_epochs", "hidden",
             "learning_rate")
_FRACTIONS = ("gamma", "gae_lambda", "clip_range")


# What training imports beyond the base install: the `train` extra.
TRAIN_MODULES = ("torch", "stable_baselines3", "sb3_contrib", "tensorboard")


def require_train_extra() -> None:
    """A one-line error naming what to install when the ``train`` extra is missing."""
    missing = [m for m in TRAIN_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError("metasched-train", f"needs the train extra (missing: "
                          f"{', '.join(missing)}): pip install 'metasched[train]'")


def check_train_settings(cfg: dict[str, Any]) -> None:
    """One-line errors for out-of-range training settings."""
    ppo = cfg.get("ppo") or {}
    for key in _POSITIVE:
        parse(Number(gt=0.0), ppo.get(key), f"ppo.{key}")
    for key in _FRACTIONS:
        parse(Number(gt=0.0, le=1.0), ppo.get(key), f"ppo.{key}")
    for key in ("k_slots", "levels", "max_nodes", "max_devices", "max_services",
                "max_endpoints"):
        parse(Count(1), (cfg.get("obs") or {}).get(key), f"obs.{key}")
    if cfg["obs"]["levels"] < 2:
        raise ConfigError("obs.levels", "must be >= 2 (one level cannot express elasticity)")
    est = (cfg.get("env") or {}).get("estimates", "given")
    one_of(est, ESTIMATES, "env.estimates")
    from metasched.envs.scheduling import OBJECTIVES

    objective = ((cfg.get("env") or {}).get("reward") or {}).get("objective", "act")
    one_of(objective, OBJECTIVES, "env.reward.objective")
    if objective == "step" and (cfg.get("workload") or {}).get("max_offpolicyness") is not None:
        raise ConfigError("env.reward.objective", "the step objective needs synchronous "
                          "steps (the workload sets max_offpolicyness)")
    parse(Count(0), cfg.get("seed"), "seed")
    from metasched.agents import BASELINES

    for field, name in (("ppo.bc.expert", (ppo.get("bc") or {}).get("expert", "rate_greedy")),
                        ("eval.reference", (cfg.get("eval") or {}).get("reference", "rate_greedy")),
                        ("obs.advisor", (cfg.get("obs") or {}).get("advisor", "rate_greedy"))):
        one_of(name, BASELINES, field, what="the heuristics", null=field == "obs.advisor")
    from metasched.compose import config_dir

    known = tuple(sorted(p.stem for p in (config_dir() / "workload").glob("*.yaml")))
    parse(list[Literal[known]], (ppo.get("bc") or {}).get("profiles") or [],
          "ppo.bc.profiles")
    scale = ((cfg.get("env") or {}).get("randomization") or {}).get("cluster_scale")
    if scale is not None and not (len(scale) == 2 and 0 < scale[0] <= scale[1]):
        raise ConfigError("env.randomization.cluster_scale",
                          f"must be [lo, hi] with 0 < lo <= hi (got {list(scale)!r})")
    parse(Number(gt=0.0), (cfg.get("eval") or {}).get("cluster_scale", 1.0),
          "eval.cluster_scale")


def run_train(cfg: dict[str, Any], out_dir: str | Path, progress: bool = True) -> dict[str, Any]:
    """Train as configured into ``out_dir``; returns the training summary."""
    from metasched.agents import make_advisor
    from metasched.core.observation import ObsConfig, ObservationEncoder
    from metasched.core.state import ClusterState

    workload, cluster = load_profile(cfg)
    check_train_settings(cfg)
    obs_cfg = ObsConfig(**cfg["obs"])
    try:
        ObservationEncoder(ClusterState(cluster, workload.services), obs_cfg,
                           make_advisor(obs_cfg))
    except ValueError as e:
        raise ConfigError("obs", str(e)) from None
    require_train_extra()  # after the settings: their errors need no torch
    from metasched.agents.training import init_source, resume_source, train

    resume_source(cfg)  # a bad resume or init fails before anything is written
    init_source(cfg)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = train(cfg, workload, cluster, out, progress=progress)
    (out / "train_summary.json").write_text(json.dumps(json_safe(summary), indent=2) + "\n")
    best, ref = summary["best_validation"], summary["reference"]
    step = ((cfg.get("env") or {}).get("reward") or {}).get("objective") == "step"
    key, what = ("mean_step_s", "step") if step else ("mean_act_s", "ACT")
    print(f"trained in {summary['elapsed_s'] / 60:.1f} min; validation mean {what} "
          f"{best[key]:.3f} s (best) vs {ref['name']} {ref[key]:.3f} s; "
          f"checkpoints: {out / 'checkpoint'} (final), {out / 'best'} (best)")
    return summary


main = make_main("train", run_train)


if __name__ == "__main__":
    main()
