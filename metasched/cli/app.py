"""The Hydra app skeleton shared by every command-line app: where the configs are, checking
overrides before Hydra runs (one-line errors), stopping on a signal, and the console
entry point."""

from __future__ import annotations

import functools
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from metasched.compose import config_dir
from metasched.core import renamed
from metasched.errors import ConfigError

CONFIG_PATH = str(config_dir())

# What service managers send to stop a process (systemd, docker and Kubernetes send
# SIGTERM; a closed terminal sends SIGHUP): handled as Ctrl-C is.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    """A stop signal, raised where Ctrl-C would raise KeyboardInterrupt, so that every
    clean-up Ctrl-C gets it gets too. The app then exits with 128 + the signal number
    (143 for SIGTERM, 129 for SIGHUP; 130 for Ctrl-C), as a shell reports it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_interrupted(signum: int, frame: object) -> None:
    raise Interrupted(signum)


def install_stop_handlers() -> None:
    """Make SIGTERM and SIGHUP raise :class:`Interrupted` (main thread only)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _raise_interrupted)


def stop_signal(exc: BaseException) -> int:
    """The signal behind an interruption: its own for :class:`Interrupted`, SIGINT for
    Ctrl-C."""
    return getattr(exc, "signum", signal.SIGINT)


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
    bare = next((a for a in args if "=" not in a and not a.startswith("~")), None)
    if bare is not None:  # e.g. a trace's path given without trace=
        print(f"error: {bare}: not a setting: settings are key=value (--help lists the main "
              "ones)", file=sys.stderr)
        sys.exit(2)
    import yaml
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(CONFIG_PATH, version_base="1.3"):
            try:
                if any(a.startswith(("+", "~")) and not a.startswith("++") for a in args):
                    _check_keys(config_name, args)  # a + must not let a typo in
                compose(config_name, overrides=args, return_hydra_config=True)
            except (HydraException, OmegaConfBaseException):
                _check_keys(config_name, args)  # an unknown key: name the nearest
                raise
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
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


def _check_keys(config_name: str, args: list[str]) -> None:
    """:func:`~metasched.cli.override_keys.check_keys` against the config composed with
    the overrides that choose config groups (``workload=rm_math``)."""
    from hydra import compose
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from metasched.cli.override_keys import check_keys

    cfg = compose(config_name, overrides=[], return_hydra_config=True)
    groups = {g for g in cfg.hydra.runtime.choices if not g.startswith("hydra/")}
    chosen = [a for a in args if a.split("=", 1)[0] in groups]
    if chosen:
        try:
            cfg = compose(config_name, overrides=chosen, return_hydra_config=True)
        except (HydraException, OmegaConfBaseException):
            return  # a bad choice: Hydra's own message names it
    check_keys(OmegaConf.to_container(cfg, resolve=False), args, groups)


def make_main(config_name: str, run: Callable[[dict[str, Any], Path], Any]) -> Callable[[], None]:
    """The console entry point of an app: check the overrides (one-line errors), then
    let Hydra compose ``configs/<config_name>.yaml`` and call ``run(config, run_dir)``."""
    import hydra
    from omegaconf import DictConfig, OmegaConf

    @hydra.main(config_path=CONFIG_PATH, config_name=config_name, version_base="1.3")
    @user_errors
    def hydra_main(cfg: DictConfig) -> None:
        run(renamed.settings(OmegaConf.to_container(cfg, resolve=True)), run_dir())

    def main() -> None:
        install_stop_handlers()
        sys.argv[1:] = renamed.overrides(sys.argv[1:])  # old names, with a warning
        try:
            preflight(config_name)
            hydra_main()
        except KeyboardInterrupt as e:  # Ctrl-C (or a stop signal) is not an error
            sig = stop_signal(e)
            print(f"\ninterrupted ({signal.Signals(sig).name})", file=sys.stderr)
            sys.exit(128 + sig)

    return main


def run_dir() -> Path:
    """The Hydra run directory of the current job."""
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)
