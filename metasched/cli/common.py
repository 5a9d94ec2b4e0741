"""Shared plumbing of the Hydra command-line apps: config location, one-line errors."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from metasched.configs import config_dir
from metasched.errors import ConfigError

CONFIG_PATH = str(config_dir())


def user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a ``ConfigError`` (a user mistake) into one line on stderr and exit 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)

    return wrapper


def int_setting(cfg: dict[str, Any], key: str, lo: int) -> int:
    v = cfg.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ConfigError(key, f"must be a whole number >= {lo} (got {v!r})")
    return v


def seeds_setting(cfg: dict[str, Any]) -> list[int]:
    n = int_setting(cfg, "n_seeds", 1)
    off = int_setting(cfg, "seed_offset", 0)
    return list(range(off, off + n))


def run_dir() -> Path:
    """The Hydra run directory of the current job."""
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)
