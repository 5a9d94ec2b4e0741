"""Names that changed, in one place: a setting's old key or value, or a reported metric's
old name, still works (with a one-line deprecation warning) where users would otherwise
break (docs/concepts/glossary.md lists every rename).

- :func:`overrides`: command-line overrides (``old.key=v`` -> ``new.key=v``), before the
  config is composed;
- :func:`settings`: a composed config, its old values (``estimates=profile``);
- :func:`metrics`: a dispatcher's counters, which say under ``renamed`` what each old
  name is now called (the value is reported once, under the new name).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("metasched")

# An old setting key (a dotted path, or a config group) -> its new name.
KEYS: dict[str, str] = {"agent": "ppo"}
# A setting (dotted path) -> {old value: new value}.
VALUES: dict[str, dict[str, str]] = {
    "estimates": {"profile": "given", "request": "given"},
    "env.estimates": {"profile": "given"},
    "evaluation.estimates": {"profile": "given"},
    "ray.submit": {"agent": "daemon"},
}
# A reported counter's new name -> its old name (named under ``renamed``).
METRICS: dict[str, str] = {"ahead_at_node": "queued_at_node", "sandboxes": "confinement"}


def _deprecated(old: str, new: str) -> None:
    log.warning("%s is deprecated: say %s (the old name will go in a later release)",
                old, new)


def overrides(items: list[str]) -> list[str]:
    """Command-line overrides with each old key (``agent.x=1``, ``+agent.x=1``,
    ``agent=name``) under its new name."""
    out = []
    for item in items:
        prefix = item[: len(item) - len(item.lstrip("+~"))]
        key, eq, value = item[len(prefix):].partition("=")
        for old, new in KEYS.items():
            if key == old or key.startswith(old + "."):
                renamed = new + key[len(old):]
                _deprecated(f"{prefix}{key}", f"{prefix}{renamed}")
                key = renamed
                break
        out.append(f"{prefix}{key}{eq}{value}")
    return out


def settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` (a composed config) with each old value of a renamed one in its place."""
    for path, renames in VALUES.items():
        *parents, leaf = path.split(".")
        node: Any = cfg
        for p in parents:
            node = node.get(p) if isinstance(node, Mapping) else None
        if isinstance(node, dict) and isinstance(node.get(leaf), str) \
                and node[leaf] in renames:
            new = renames[node[leaf]]
            _deprecated(f"{path}={node[leaf]}", f"{path}={new}")
            node[leaf] = new
    return cfg


def value(path: str, given: Any) -> Any:
    """One setting's value (``VALUES[path]``), the old name of a renamed one replaced."""
    renames = VALUES.get(path, {})
    if isinstance(given, str) and given in renames:
        _deprecated(f"{path}={given}", f"{path}={renames[given]}")
        return renames[given]
    return given


def stored(cfg: Any) -> Any:
    """A config saved by an earlier release (a checkpoint's), each old top-level key under
    its new name (silently: the user did not write it)."""
    if not isinstance(cfg, dict):
        return cfg
    return {KEYS.get(k, k) if "." not in KEYS.get(k, "") else k: v for k, v in cfg.items()}


def metrics(counters: dict[str, Any]) -> dict[str, Any]:
    """``counters`` with ``renamed``: each old name of a counter there -> its new name
    (a reader of an old name finds where its value went; no value is said twice)."""
    counters["renamed"] = {old: new for new, old in sorted(METRICS.items(), key=lambda x: x[1])
                           if new in counters}
    return counters


__all__ = ["KEYS", "METRICS", "VALUES", "metrics", "overrides", "settings", "stored", "value"]
