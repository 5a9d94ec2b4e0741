"""Checkpoints of a learned scheduler: a directory holding

- ``model.zip``: the SB3 MaskablePPO model, optimizer state and timesteps included (to
  resume training: ``metasched-train resume=<dir>``);
- ``vecnormalize.pkl``: the ``VecNormalize`` statistics (returns, and observations if
  they are normalised), when training normalises (SB3's format, loaded on resume);
- ``policy.npz``: the policy's weights for the NumPy forward pass (all inference), with
  the observation statistics when the policy reads normalised observations;
- ``metadata.json``: observation schema (version, K, L, slot feature names, caps),
  what is normalised, the resolved training config, training seeds and eval metrics.

Loading checks the schema against the running code and fails with a clear error when
they differ.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from metasched.core import renamed
from metasched.core.observation import OBS_SCHEMA_VERSION, SLOT_FEATURES, ObsConfig
from metasched.errors import ConfigError

METADATA = "metadata.json"
WEIGHTS = "policy.npz"
MODEL = "model.zip"
VEC_NORMALIZE = "vecnormalize.pkl"


def is_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a checkpoint directory."""
    p = Path(path)
    return p.is_dir() and (p / METADATA).is_file()


def resolve_scheduler(name: str) -> str:
    """A scheduler name as given, or a checkpoint path made absolute. A path is looked up
    from the working directory first, then among the shipped checkpoints (the package data
    ``metasched.checkpoints``), as ``checkpoints/<name>`` or ``<name>``: so
    ``checkpoints/default`` names the shipped policy from any directory."""
    from metasched.agents.baselines import BASELINES
    from metasched.compose import package_dir

    if name in BASELINES:
        return name
    if is_checkpoint(name):
        return str(Path(name).resolve())
    shipped = package_dir("metasched.checkpoints")
    rel = Path(name)
    if rel.parts[:1] == ("checkpoints",):
        rel = Path(*rel.parts[1:])
    if not rel.is_absolute() and rel.parts and is_checkpoint(shipped / rel):
        return str((shipped / rel).resolve())
    return name


def save_checkpoint(path: str | Path, model, obs_config: ObsConfig,
                    extra: dict[str, Any]) -> Path:
    """Write ``model`` (a MaskablePPO with a ``SlotPolicy``) as a checkpoint directory,
    with the statistics of its ``VecNormalize`` if it trains behind one."""
    from metasched.agents.numpy_policy import NumpyPolicy

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save(out / MODEL)
    vec_norm = model.get_vec_normalize_env()
    if vec_norm is not None:
        vec_norm.save(out / VEC_NORMALIZE)
    else:
        (out / VEC_NORMALIZE).unlink(missing_ok=True)  # none stale from an earlier save
    NumpyPolicy.from_sb3(model.policy, vec_norm).save(out / WEIGHTS)
    meta = {"obs_schema": schema(obs_config),
            "normalization": {"obs": bool(vec_norm is not None and vec_norm.norm_obs),
                              "reward": bool(vec_norm is not None and vec_norm.norm_reward)},
            **extra}
    (out / METADATA).write_text(json.dumps(meta, indent=2, default=str) + "\n")
    return out


def normalization(meta: dict[str, Any]) -> dict[str, bool]:
    """What a checkpoint's policy was trained to read normalised (``obs``) and whether its
    returns were (``reward``), from its metadata (for checkpoints from before it was
    recorded: from the training config)."""
    trained = (meta.get("config") or {}).get("ppo") or {}
    return meta.get("normalization") or {
        "obs": bool(trained.get("normalize_obs", False)),
        "reward": bool(trained.get("normalize_reward", False))}


def schema(obs_config: ObsConfig) -> dict[str, Any]:
    """What a checkpoint records about the observation it was trained on."""
    return {"version": OBS_SCHEMA_VERSION, "slot_features": list(SLOT_FEATURES),
            **obs_config.to_dict()}


def load_metadata(path: str | Path) -> dict[str, Any]:
    """A checkpoint's metadata, its schema checked against this code."""
    p = Path(path)
    if not is_checkpoint(p):
        raise ConfigError("checkpoint", f"{p} is not a checkpoint directory (no {METADATA})")
    try:
        meta = json.loads((p / METADATA).read_text())
        if "meta_policy" in meta and "obs_schema" not in meta:
            raise ConfigError("checkpoint", f"{p} is a meta-policy over the rules, not a "
                              "per-action policy (a warm start needs one: "
                              "checkpoints/per_action)")
        saved = meta["obs_schema"]
        version = saved["version"]
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError("checkpoint", f"{p / METADATA} is unreadable ({e!r})") from None
    if "config" in meta:  # saved by an earlier release: its old names, renamed
        meta["config"] = renamed.stored(meta["config"])
    if version != OBS_SCHEMA_VERSION:
        raise ConfigError("checkpoint", f"{p} was trained on observation schema v{version}; "
                          f"this code encodes v{OBS_SCHEMA_VERSION}. Retrain with metasched-train")
    missing = sorted(set(ObsConfig.__dataclass_fields__) - set(saved))
    if missing:
        raise ConfigError("checkpoint", f"{p} was trained on an observation schema without "
                          f"{', '.join(missing)}. Retrain with metasched-train")
    try:
        cfg = ObsConfig(**{k: saved[k] for k in ObsConfig.__dataclass_fields__})
    except TypeError as e:
        raise ConfigError("checkpoint", f"{p / METADATA} is unreadable ({e!r})") from None
    current = schema(cfg)
    if saved != current:
        diff = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))
        raise ConfigError("checkpoint", f"{p} was trained on observation schema "
                          f"v{saved.get('version')}, this code encodes v{OBS_SCHEMA_VERSION}; "
                          f"they differ in: {', '.join(diff)}. Retrain with metasched-train")
    meta["obs_config"] = cfg
    return meta
