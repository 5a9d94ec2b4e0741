"""Locating and composing the Hydra configs (``configs/``, installed as the package data
``metasched.configs``) into a validated workload and cluster."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from metasched.core import renamed
from metasched.core.cluster_config import ClusterConfig, parse_cluster
from metasched.errors import ConfigError
from metasched.sim.workload_config import WorkloadConfig, check_compatible, parse_workload

# The shipped profiles: ``configs/workload/<name>.yaml`` with ``configs/cluster/<name>.yaml``.
PROFILES: tuple[str, ...] = ("coding", "search", "rm_math", "mixed", "retool")


def config_dir() -> Path:
    """The shipped configs' directory, found through the installed package
    (``METASCHED_CONFIG_DIR`` overrides it)."""
    env = os.environ.get("METASCHED_CONFIG_DIR")
    if env:
        return Path(env).resolve()
    return package_dir("metasched.configs")


def package_dir(package: str) -> Path:
    """The directory of an installed package of metasched's (configs and checkpoints are
    package data), as a real path: Hydra and the checkpoint loader read files from it."""
    from importlib.resources import files

    return Path(str(files(package))).resolve()


def compose(config_name: str = "eval", overrides: list[str] | None = None) -> dict[str, Any]:
    """Compose ``configs/<config_name>.yaml`` with Hydra overrides into a plain dict
    (inside a running Hydra app, from that app's config search path)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    overrides = renamed.overrides(list(overrides or []))
    try:
        if GlobalHydra.instance().is_initialized():  # an app's Hydra cannot be re-entered
            cfg = hydra_compose(config_name, overrides=list(overrides or []))
        else:
            with initialize_config_dir(str(config_dir()), version_base="1.3"):
                cfg = hydra_compose(config_name, overrides=list(overrides or []))
        return renamed.settings(OmegaConf.to_container(cfg, resolve=True))
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError("overrides", str(e).splitlines()[0]) from None


def load_profile(cfg: dict[str, Any]) -> tuple[WorkloadConfig, ClusterConfig]:
    """Validated workload and cluster from a composed config dict."""
    if "workload" not in cfg:
        raise ConfigError("workload", "is required")
    if "cluster" not in cfg:
        raise ConfigError("cluster", "is required")
    workload = cfg["workload"]
    if cfg.get("generation") is not None:  # +generation=NAME: the LLM's turns as a pool
        if not isinstance(workload, dict):
            raise ConfigError("workload", "must be a mapping")
        workload = {**workload, "generation": cfg["generation"]}
    w = parse_workload(workload)
    c = parse_cluster(cfg["cluster"])
    if w.trace is not None:
        from metasched.sim.trace import read_trace, validate_against

        validate_against(read_trace(w.trace), w.services, c)
    else:
        check_compatible(w, c)
    return w, c


def profile(name: str, overrides: list[str] | None = None) -> tuple[WorkloadConfig, ClusterConfig]:
    """The named workload profile with its cluster, e.g. ``profile("coding")``."""
    return load_profile(compose("eval", [f"workload={name}", *(overrides or [])]))
