"""``metasched-plan``: how small a cluster a scheduler needs to match a target step time.

Examples::

    metasched-plan                                   # coding: elastic_greedy vs static
    metasched-plan workload=rm_math target_step_s=300
"""

from __future__ import annotations

import json
from typing import Any

from metasched.cli.app import make_main
from metasched.cli.output import json_safe
from metasched.cli.settings import int_setting, seeds_setting
from metasched.compose import load_profile
from metasched.core.actions import KINDS
from metasched.errors import ConfigError


def _float(cfg: dict[str, Any], key: str, lo: float, hi: float = float("inf")) -> float:
    v = cfg.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo < v <= hi:
        raise ConfigError(key, f"must be a number in ({lo:g}, {hi:g}] (got {v!r})")
    return float(v)


def run_plan(cfg: dict[str, Any], out_dir, progress: bool = True) -> dict[str, Any]:
    """Plan as configured; write plan.json into ``out_dir`` and print a summary."""
    from pathlib import Path

    from metasched.agents import make_scheduler
    from metasched.evaluation.planning import plan_capacity

    workload, cluster = load_profile(cfg)
    pools = cfg.get("scale_pools")
    if not isinstance(pools, list) or not pools or any(p not in KINDS for p in pools):
        raise ConfigError("scale_pools", f"must be a non-empty list from {list(KINDS)} "
                          f"(got {pools!r})")
    params = cfg.get("scheduler_params") or {}
    sched, base = str(cfg.get("scheduler")), str(cfg.get("baseline"))
    make_scheduler(sched, **(params.get(sched) or {}))
    make_scheduler(base, **(params.get(base) or {}))
    target = cfg.get("target_step_s")
    common = dict(seeds=seeds_setting(cfg), params=params.get(sched) or {},
                  tolerance=_float(cfg, "tolerance", 0.0, 1.0),
                  min_scale=_float(cfg, "min_scale", 0.0, 1.0),
                  workers=int_setting(cfg, "workers", 1), progress=progress)
    plan = plan_capacity(
        workload, cluster, sched, pools=tuple(pools), baseline=base,
        baseline_params=params.get(base) or {},
        target_step_s=None if target is None else _float(cfg, "target_step_s", 0.0), **common)
    doc = {"workload": workload.name, **plan.to_dict(), "per_pool": {}}
    _report(f"all of {', '.join(pools)} scaled together", plan, cluster, sched)
    present = [p for p in pools if cluster.resources()[p]]
    if cfg.get("per_pool", True) and len(present) > 1:
        for pool in present:
            one = plan_capacity(workload, cluster, sched, pools=(pool,),
                                target_step_s=plan.target_step_s, **common)
            one.target_source = plan.target_source
            doc["per_pool"][pool] = one.to_dict()
            _report(f"{pool} alone scaled, the rest full", one, cluster, sched)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps(json_safe(doc), indent=2) + "\n")
    print(f"plan written to {out / 'plan.json'}")
    return doc


def _report(title: str, plan, cluster, sched: str) -> None:
    print(f"{title}: target mean step time {plan.target_step_s:,.1f} s ({plan.target_source})")
    for t in sorted(plan.trials, key=lambda t: t.scale):
        res = ", ".join(f"{k} {v:g}" for k, v in t.resources.items() if cluster.resources()[k])
        print(f"  scale {t.scale:6.3f}  [{res}]  mean step {t.mean_step_s:,.1f} s  "
              f"{'meets' if t.meets else 'misses'}")
    if plan.scale is None:
        print(f"  {sched} does not meet the target even on the full cluster")
    else:
        saved = ", ".join(f"{k} {v:.0%}" for k, v in plan.saved().items())
        print(f"  {sched} meets it at scale {plan.scale:.3f}: resources saved: {saved}")


main = make_main("plan", run_plan)


if __name__ == "__main__":
    main()
