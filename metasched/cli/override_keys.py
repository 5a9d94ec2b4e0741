"""The keys of command-line overrides, checked against the app's composed config before
Hydra runs: an unknown key is refused naming the nearest known one (``n_seed`` -> did you
mean ``n_seeds``?), and ``+key=value`` adds a key only where keys are the user's to add,
so a typo cannot slip in with a ``+``."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from metasched.errors import ConfigError, nearest

# Maps whose keys the user names (a scheduler, a GPU service, an API endpoint, a client's
# token, a workspace template): ``+`` adds any key under them, at any depth; what is added
# is checked where it is read.
OPEN_MAPS = ("scheduler_params", "services", "endpoints", "tokens", "sandbox.templates",
             "workload.services")
# Nodes read through a schema that takes fields their config may leave out (a workload's
# max_offpolicyness, a sandbox's env_allow ...): ``+`` under them is left to that schema,
# which refuses an unknown field naming the nearest one.
SCHEMA_NODES = ("workload", "cluster", "sandbox", "limits", "deadlines")


def _under(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == r or path.startswith(r + ".") for r in roots)


def _paths(node: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    """Every dotted key in ``node``."""
    for k, v in node.items():
        path = f"{prefix}{k}"
        yield path
        if isinstance(v, Mapping) and not _under(path, OPEN_MAPS):
            yield from _paths(v, path + ".")


def suggestion(key: str, cfg: Mapping[str, Any]) -> str | None:
    """The known key nearest to ``key``: a sibling spelled alike, else the shortest key of
    that name elsewhere in the config (``isolation`` -> ``sandbox.isolation``)."""
    *parents, leaf = key.split(".")
    node: Any = cfg
    for p in parents:
        node = node.get(p) if isinstance(node, Mapping) else None
    if isinstance(node, Mapping):
        near = nearest(leaf, [str(k) for k in node])
        if near is not None:
            return ".".join([*parents, near])
    same = [p for p in _paths(cfg)
            if p.rsplit(".", 1)[-1] == leaf and not p.startswith("hydra.") and p != key]
    return min(same, key=len) if same else None


def check_keys(cfg: Mapping[str, Any], overrides: list[str], groups: set[str]) -> None:
    """Refuse an override whose key ``cfg`` does not hold (``~key``, ``key=v``), and a
    ``+key=v`` that adds a key outside the open maps and the schema-read nodes.

    Args:
        cfg: the app's config composed with the overrides that choose config groups.
        overrides: the command line's overrides.
        groups: the config groups (``workload``, ``cluster``, ...), whose choices Hydra
            checks itself.

    Raises:
        ConfigError: naming the key, and the nearest known key where one is close.
    """
    for item in overrides:
        prefix = item[: len(item) - len(item.lstrip("+~"))]
        key = item[len(prefix):].split("=", 1)[0]
        if prefix == "++" or key in groups or key.split(".")[0] in ("hydra", ""):
            continue
        parts = key.split(".")
        node: Any = cfg
        depth = 0
        while depth < len(parts) and isinstance(node, Mapping) and parts[depth] in node:
            node = node[parts[depth]]
            depth += 1
        parent = ".".join(parts[:depth])
        if depth == len(parts) or not isinstance(node, Mapping) \
                or _under(parent, OPEN_MAPS):
            continue  # there; under a value that is no map (Hydra says so); an open map's
        if _under(parent, SCHEMA_NODES) and (prefix == "+" or nearest(
                parts[depth], [str(k) for k in node]) is None):
            continue  # the schema judges it (a key it takes is added with +)
        near = suggestion(key, cfg)
        hint = f"did you mean {near}?" if near else "--cfg job prints every setting"
        where = f" of {parent}" if parent else ""
        if prefix == "+" and not near:
            roots = [r for r in (*OPEN_MAPS, *SCHEMA_NODES) if _has(cfg, r)]
            where += f" (+ adds keys under {', '.join(roots)} only)" if roots \
                else " (+ adds none here)"
        raise ConfigError(key, f"not a setting{where}; {hint}")


def _has(cfg: Mapping[str, Any], path: str) -> bool:
    node: Any = cfg
    for p in path.split("."):
        if not isinstance(node, Mapping) or p not in node:
            return False
        node = node[p]
    return True


__all__ = ["OPEN_MAPS", "SCHEMA_NODES", "check_keys", "suggestion"]
