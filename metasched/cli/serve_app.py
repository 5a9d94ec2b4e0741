"""``metasched-serve``: the HTTP service in front of one live dispatcher, on this machine
or (``backend=ray``) the dispatcher actor on a Ray cluster.

Examples::

    metasched-serve                                        # 127.0.0.1:8080
    metasched-serve port=9090 scheduler=elastic_greedy 'languages=[python,cpp]'
    metasched-serve '+endpoints={search: {rpm: 600, max_concurrency: 64, url: "http://..."}}'
    METASCHED_SERVE_TOKEN=... metasched-serve host=0.0.0.0  # any other address needs a token
    metasched-serve backend=ray ray.name=metasched         # in front of the actor on Ray
    metasched-serve backend=ray shards=4                   # in front of 4 dispatcher shards

Point SandboxFusion clients at it (verl: ``sandbox_fusion_url=http://127.0.0.1:8080/
run_code``; SkyRL: ``SANDBOX_FUSION_URL=http://127.0.0.1:8080``), native clients at
``/v1/actions`` (``metasched.client``), search and judge clients at
``/v1/endpoints/<name>/``. SIGINT, SIGTERM and SIGHUP stop it: requests in flight get
``graceful_s`` to finish, then running commands are killed and what did not finish
stays in the journal (a restart on the same journal runs it). On Ray, a dispatcher the
service started is stopped so too (unless ``ray.keep``); one it attached to goes on.
With ``shards`` > 1 (``backend=ray``), the service starts that many dispatcher shards
on this node (docs/deployment/kuberay.md), each endpoint's quota shared among them by
the lease service, routes each request to the shard of its trajectory, and stops them
when it stops; the cluster's nodes are split among them at their start (a node that
joins later is given to none until the service starts again).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from metasched.cli.app import Interrupted, make_main
from metasched.cli.backend_settings import open_on_ray, open_shards, ray_settings, shard_count
from metasched.cli.dispatch_app import dispatcher_config, load_services
from metasched.errors import ConfigError, one_of

log = logging.getLogger("metasched.serve")

_LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def serve_config(cfg: dict[str, Any], upstreams: dict[str, Any],
                 templates: dict[str, Any] | None = None):
    """The service's settings from the composed config."""
    from metasched.serve.config import ServeConfig

    keys = ("host", "port", "token", "tokens", "max_body_mb", "max_file_mb", "header_timeout_s",
            "body_timeout_s", "max_connections", "client_commands", "languages", "task",
            "keep_results", "generation", "e2b_sdk1_ports", "e2b_sdk1_replace")
    return ServeConfig(upstreams=upstreams, e2b_templates=templates or {},
                       e2b_cache=cfg.get("e2b_cache"),
                       **{k: cfg[k] for k in keys if cfg.get(k) is not None})


def with_e2b_layers(cfg: dict[str, Any], templates: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` with the E2B templates' layers (built here where not cached) among the
    dispatcher's ``sandbox.system_paths``, their files among its ``sandbox.templates``."""
    from metasched.serve.e2b.templates import build_layers

    if not templates:
        return cfg
    sandbox = dict(cfg.get("sandbox") or {})
    known = dict(sandbox.get("templates") or {})
    for name in templates:
        if name in known:
            raise ConfigError("e2b_templates", f"{name!r}: also a sandbox.templates entry "
                              f"(name one of them otherwise)")
    built = build_layers(templates, cfg.get("e2b_cache"))
    sandbox["templates"] = {**known, **built["templates"]}
    sandbox["system_paths"] = [*(sandbox.get("system_paths") or []),
                               *built["system_paths"]]
    return {**cfg, "sandbox": sandbox}


def run_serve(cfg: dict[str, Any], out_dir: Path) -> None:
    """Serve until stopped (see the module docstring)."""
    from metasched.runtime.dispatch import Dispatcher
    from metasched.serve import create_app, serve
    from metasched.serve.config import parse_upstreams
    from metasched.serve.e2b.templates import load_templates

    on_ray = ray_settings(cfg)
    n_shards = shard_count(cfg, on_ray)
    endpoints, upstreams = parse_upstreams(cfg.get("endpoints"), "endpoints")
    out = Path(out_dir)
    templates = load_templates(cfg.get("e2b_templates"))
    cfg = with_e2b_layers(cfg, templates)
    dcfg = dispatcher_config(cfg, out, endpoints=endpoints)
    scfg = serve_config(cfg, upstreams, templates)
    graceful = cfg.get("graceful_s", 30)
    if isinstance(graceful, bool) or not isinstance(graceful, (int, float)) or graceful < 0:
        raise ConfigError("graceful_s", f"must be a number of seconds >= 0 (got {graceful!r})")
    level = cfg.get("log_level", "info")
    one_of(level, _LOG_LEVELS, "log_level")
    services = load_services(cfg.get("services"))
    out.mkdir(parents=True, exist_ok=True)
    from metasched.serve.connections import raise_descriptor_limit

    before, now = raise_descriptor_limit()  # before the caps derived from it
    log.info("descriptors: limit %d%s", now, f" (raised from {before})" if now > before
             else " (the hard limit: ulimit -n raises it)")
    shards: list[str] = []
    if on_ray is None:
        dispatcher = Dispatcher(dcfg, services=services)  # a bad setting fails here
        log.info("journal: %s", dcfg.journal)
    elif n_shards > 1:  # started here, stopped below
        dispatcher, shards = open_shards(n_shards, on_ray, dcfg, out)
        log.info("%s; journals in %s; nodes joining later are given to no shard until "
                 "the service starts again", dispatcher.describe(), out / "shards")
    else:  # attached or started here; a bad setting fails here too
        dispatcher = open_on_ray(on_ray, dcfg, services, cfg, endpoints=sorted(upstreams))
        log.info("%s", dispatcher.describe())
    try:
        app = create_app(dispatcher, scfg)
        stopped_by = serve(app, scfg.host, scfg.port, graceful_s=float(graceful),
                           log_level=level)
    finally:
        if shards:
            from metasched.runtime.shards import stop_shards

            stop_shards(shards, drain=True)
        elif on_ray is not None:
            dispatcher.discard()  # started here and not closed (the server did not start)
    if stopped_by is not None:
        raise Interrupted(stopped_by)


main = make_main("serve", run_serve)


if __name__ == "__main__":
    main()
