"""``backend`` and ``ray:``, the settings of ``metasched-dispatch`` and ``metasched-serve``
that put their dispatcher on this machine or on a Ray cluster (docs/deployment/ray.md):
read and checked here, with one-line errors, before anything starts."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from metasched.errors import ConfigError, one_of

if TYPE_CHECKING:
    from metasched.runtime.ray_backend.remote import RaySettings

BACKENDS = ("local", "ray")
# ray_backend.cluster's SUBMIT_MODES and DEFAULT_SUBMIT, without importing ray
SUBMIT, DEFAULT_SUBMIT = ("task", "agent", "stream"), "stream"
# Settings of the local dispatcher that a dispatcher on Ray does not take, with why;
# each is refused when given (not its default) with backend=ray.
NOT_ON_RAY = {
    "cores": "the cluster's nodes give the cores; ray.cores_per_node grants fewer",
    "gpu_standin": "the cluster's GPUs are used; a logical one (ray start --num-gpus=1) "
                   "is served by a CPU stand-in",
    "compact": "compact the journal with the dispatcher stopped, from a local run on it",
}
_DEFAULTS = {"cores": None, "gpu_standin": 0, "compact": None}


def ray_settings(cfg: dict[str, Any]) -> RaySettings | None:
    """The ``ray:`` settings when ``backend`` is ``ray`` (None for ``local``).

    Raises:
        ConfigError: an unknown backend, Ray not installed, a setting that does not
            apply on Ray, or a bad ``ray.*`` value.
    """
    backend = one_of(cfg.get("backend") or "local", BACKENDS, "backend")
    if backend == "local":
        return None
    try:
        import ray  # noqa: F401 - only whether it imports
    except ImportError:
        raise ConfigError("backend", "ray is not installed here: pip install "
                          "'metasched[ray]'") from None
    for key, why in NOT_ON_RAY.items():
        if key in cfg and cfg[key] != _DEFAULTS[key]:
            raise ConfigError(key, f"does not apply with backend=ray ({why})")
    r = cfg.get("ray") or {}
    if not isinstance(r, dict):
        raise ConfigError("ray", f"must be a mapping (got {r!r})")
    known = {f.name for f in dataclasses.fields(_settings_class())}
    for key in r:
        if key not in known:
            raise ConfigError(f"ray.{key}", f"unknown setting (known: {', '.join(sorted(known))})")
    for key in ("address", "name", "namespace"):
        v = r.get(key)
        if v is not None and (not isinstance(v, str) or not v.strip()):
            raise ConfigError(f"ray.{key}", f"must be a non-empty string (got {v!r})")
    one_of(r.get("submit", DEFAULT_SUBMIT), SUBMIT, "ray.submit")
    cpn = r.get("cores_per_node")
    if cpn is not None and (isinstance(cpn, bool) or not isinstance(cpn, int) or cpn < 1):
        raise ConfigError("ray.cores_per_node", f"must be a whole number >= 1 or null "
                          f"(got {cpn!r})")
    ahead = r.get("ahead_per_core")
    if ahead is not None and (isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 0):
        raise ConfigError("ray.ahead_per_core", f"must be a whole number >= 0 or null "
                          f"(got {ahead!r})")
    keep = r.get("keep", False)
    if not isinstance(keep, bool):
        raise ConfigError("ray.keep", f"must be true or false (got {keep!r})")
    return _settings_class()(**{k: v for k, v in r.items() if v is not None})


def ray_overrides(settings: RaySettings) -> str:
    """The ``ray.*`` overrides that name the same dispatcher again (" ray.name=x ...")."""
    default = _settings_class()()
    return "".join(f" ray.{k}={getattr(settings, k)}" for k in ("address", "name", "namespace")
                   if getattr(settings, k) != getattr(default, k))


def _settings_class():
    from metasched.runtime.ray_backend.remote import RaySettings

    return RaySettings


def on_this_node(dcfg):
    """``dcfg`` with its paths absolute: the dispatcher actor does not run in this
    process's directory (it is pinned to this node, so the paths mean the same there)."""
    def absolute(p: Any) -> Any:
        return None if p is None else str(Path(p).resolve())
    return dataclasses.replace(dcfg, journal=absolute(dcfg.journal), trace=absolute(dcfg.trace),
                               workdir=absolute(dcfg.workdir))


def open_on_ray(settings: RaySettings, dcfg, services: dict[str, Any], cfg: dict[str, Any],
                endpoints: list[str] | None = None):
    """The dispatcher actor the settings name (attached, or started with ``dcfg``)."""
    from metasched.cli.app import install_stop_handlers
    from metasched.runtime.ray_backend.remote import init_ray, open_dispatcher

    init_ray(settings.address, settings.namespace)
    # Ray's own handler of SIGTERM ends the process at once: a stop signal must reach
    # the app's clean-up (a dispatcher started here is stopped, not left running).
    install_stop_handlers()
    return open_dispatcher(settings, on_this_node(dcfg), services,
                           journal_given=cfg.get("journal") is not None, endpoints=endpoints)


__all__ = ["BACKENDS", "NOT_ON_RAY", "on_this_node", "open_on_ray", "ray_overrides",
           "ray_settings"]
