"""Readers of the apps' own settings (``n_seeds``, ``max_wait_s``, ...): one-line errors."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from metasched.core.schema import Count, Flag, Number, Text, parse, valid
from metasched.errors import ConfigError, short


def int_setting(cfg: dict[str, Any], key: str, lo: int, default: int | None = None,
                hi: int | None = None) -> int:
    """A whole number in ``[lo, hi]`` (``hi`` None: no upper bound)."""
    v = cfg.get(key, default)
    if not valid(Count(lo, hi), v):
        bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ConfigError(key, f"must be a whole number {bounds} (got {short(v)})")
    return int(v)


def bool_setting(cfg: dict[str, Any], key: str, default: bool) -> bool:
    """A switch: true or false (absent or null: ``default``); nothing else passes for one."""
    v = cfg.get(key)
    return default if v is None else parse(Flag, v, key)


def max_wait_setting(cfg: dict[str, Any]) -> float | None:
    """``max_wait_s``: the core's starvation guard, a finite number > 0 or null (off)."""
    wait = cfg.get("max_wait_s")
    if not valid(Number(gt=0.0) | None, wait):
        raise ConfigError("max_wait_s", f"must be a number > 0, finite, or null (got "
                          f"{short(wait)})")
    return None if wait is None else float(wait)


def seeds_setting(cfg: dict[str, Any]) -> list[int]:
    n = int_setting(cfg, "n_seeds", 1)
    off = int_setting(cfg, "seed_offset", 0)
    return list(range(off, off + n))


def schedulers_setting(cfg: dict[str, Any], key: str = "schedulers"
                       ) -> tuple[list[str], dict[str, str], dict[str, dict[str, Any]]]:
    """``schedulers`` (a name or a list of names; a name may be a checkpoint directory)
    with their ``scheduler_params``: (names, what loads each name, params per name).
    Each is built once here, so a bad name or parameter fails before any run."""
    from metasched.agents import make_scheduler
    from metasched.agents.checkpoint import resolve_scheduler

    scheds = cfg.get(key)
    if isinstance(scheds, str):
        scheds = [scheds]
    scheds = parse(Annotated[list[Text], Field(min_length=1)], scheds, key)
    if len(set(scheds)) != len(scheds):
        raise ConfigError(key, f"lists a scheduler twice ({scheds})")
    params = parse(dict[str, dict[str, Any] | None] | None, cfg.get("scheduler_params"),
                   "scheduler_params") or {}
    paths = {s: resolve_scheduler(s) for s in scheds}
    out = {s: dict(params.get(s) or {}) for s in scheds}
    for s in scheds:
        try:
            make_scheduler(paths[s], **out[s])
        except ConfigError as e:  # named by the setting that holds the name
            raise ConfigError(key if e.field == "schedulers" else e.field, e.problem) from None
    return scheds, paths, out
