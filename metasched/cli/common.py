"""Shared plumbing of the Hydra command-line apps: config location, one-line errors."""

from __future__ import annotations

import functools
import json
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


def preflight(config_name: str, argv: list[str] | None = None) -> None:
    """Compose the config with the command line's overrides before Hydra runs, so a bad
    override is reported as one line (Hydra's own report spans several). Sweeps
    (``--multirun``) are left to Hydra."""
    args = sys.argv[1:] if argv is None else argv
    if any(a.startswith("-") for a in args):
        return
    import yaml
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(CONFIG_PATH, version_base="1.3"):
            compose(config_name, overrides=args, return_hydra_config=True)
    except yaml.YAMLError as e:  # a config file that is not valid YAML
        mark = getattr(e, "problem_mark", None)
        where = f"{mark.name}:{mark.line + 1}" if mark is not None else "a config file"
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        print(f"error: {where}: invalid YAML ({problem})", file=sys.stderr)
        sys.exit(2)
    except (HydraException, OmegaConfBaseException) as e:
        lines = [ln.strip() for ln in str(e).splitlines()]
        keep = [ln for ln in lines if ln and not ln.startswith((
            "full_key", "object_type", "provider=", "Set the env", "Config search path"))]
        for i, ln in enumerate(keep):  # "Available options in 'g':" + one option a line
            if ln.startswith("Available options"):
                keep[i:] = [f"{ln} {', '.join(keep[i + 1:])}"]
                break
        keys = [a.split("=", 1)[0].lstrip("+~") for a in args]
        field = max((k for k in keys if k in str(e)), key=len, default="overrides")
        print(f"error: {field}: {'; '.join(keep)}", file=sys.stderr)
        sys.exit(2)


def int_setting(cfg: dict[str, Any], key: str, lo: int, default: int | None = None) -> int:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ConfigError(key, f"must be a whole number >= {lo} (got {v!r})")
    return v


def max_wait_setting(cfg: dict[str, Any]) -> float | None:
    """``max_wait_s``: the core's starvation guard, a number > 0 or null (off)."""
    wait = cfg.get("max_wait_s")
    if wait is not None and (isinstance(wait, bool) or not isinstance(wait, (int, float))
                             or not wait > 0):
        raise ConfigError("max_wait_s", f"must be a number > 0 or null (got {wait!r})")
    return None if wait is None else float(wait)


def write_report(out: Path, doc: dict[str, Any], table: str) -> None:
    """Write ``results.json`` and ``results.md`` into ``out`` and print the table."""
    (out / "results.json").write_text(json.dumps(json_safe(doc), indent=2, default=repr) + "\n")
    (out / "results.md").write_text(table)
    print(table)
    print(f"results written to {out}")


def seeds_setting(cfg: dict[str, Any]) -> list[int]:
    n = int_setting(cfg, "n_seeds", 1)
    off = int_setting(cfg, "seed_offset", 0)
    return list(range(off, off + n))


def json_safe(x: Any) -> Any:
    """``x`` with non-finite floats as None, so the JSON written is standard."""
    if isinstance(x, float):
        return x if x == x and abs(x) != float("inf") else None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def make_main(config_name: str, run: Callable[[dict[str, Any], Path], Any]) -> Callable[[], None]:
    """The console entry point of an app: check the overrides (one-line errors), then
    let Hydra compose ``configs/<config_name>.yaml`` and call ``run(config, run_dir)``."""
    import hydra
    from omegaconf import DictConfig, OmegaConf

    @hydra.main(config_path=CONFIG_PATH, config_name=config_name, version_base="1.3")
    @user_errors
    def hydra_main(cfg: DictConfig) -> None:
        run(OmegaConf.to_container(cfg, resolve=True), run_dir())

    def main() -> None:
        try:
            preflight(config_name)
            hydra_main()
        except KeyboardInterrupt:  # Ctrl-C is not an error: no traceback
            print("\ninterrupted", file=sys.stderr)
            sys.exit(130)

    return main


def run_dir() -> Path:
    """The Hydra run directory of the current job."""
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)
