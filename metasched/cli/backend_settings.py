"""``backend`` and ``ray:``, the settings of ``metasched-dispatch`` and ``metasched-serve``
that put their dispatcher on this machine or on a Ray cluster (docs/deployment/ray.md):
read and checked here, with one-line errors, before anything starts."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from metasched.core.schema import parse
from metasched.errors import ConfigError, one_of

if TYPE_CHECKING:
    from metasched.runtime.ray_backend.remote import RaySettings

BACKENDS = ("local", "ray")
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
    if isinstance(r, Mapping):  # null: the default
        r = {k: v for k, v in r.items() if v is not None}
    return parse(_settings_class(), r, "ray")


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
    return dcfg.replace(journal=absolute(dcfg.journal), trace=absolute(dcfg.trace),
                        workdir=absolute(dcfg.workdir))


def shard_count(cfg: dict[str, Any], on_ray: RaySettings | None) -> int:
    """The ``shards`` setting: how many dispatcher shards (1: one dispatcher).

    Raises:
        ConfigError: not a whole number >= 1, more than one without ``backend=ray``, or
            with GPU ``services`` (the shards do not split the cluster's GPUs).
    """
    n = cfg.get("shards", 1)
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError("shards", f"must be a whole number >= 1 (got {n!r})")
    if n > 1 and on_ray is None:
        raise ConfigError("shards", f"{n} shards need backend=ray (they are Ray actors)")
    if n > 1 and cfg.get("services"):
        raise ConfigError("shards", "GPU services are not served by shards yet (the "
                          "cluster's GPUs are not split among them): shards=1")
    return n


def open_shards(n: int, settings: RaySettings, dcfg, out_dir: Path):
    """``n`` dispatcher shards started on this node (journals under ``out_dir``), each
    endpoint's quota shared among them through the lease service; a dispatcher over
    them (:class:`~metasched.runtime.shards.ShardedDispatcher`) and their names."""
    from metasched.cli.app import install_stop_handlers
    from metasched.runtime.leases import PoolLimit
    from metasched.runtime.ray_backend.remote import init_ray
    from metasched.runtime.shards import ShardedDispatcher, start_shards

    init_ray(settings.address, settings.namespace)
    install_stop_handlers()
    out = Path(out_dir).resolve()
    pools = {name: PoolLimit.endpoint(spec) for name, spec in dcfg.endpoints.items()}
    router = start_shards(n, on_this_node(dcfg), journal_dir=str(out / "shards"),
                          pools=pools, lease_file=str(out / "leases.jsonl"),
                          prefix=f"{settings.name}-shard")
    return ShardedDispatcher(router.names), router.names


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


__all__ = ["BACKENDS", "NOT_ON_RAY", "on_this_node", "open_on_ray", "open_shards",
           "ray_overrides", "ray_settings", "shard_count"]
