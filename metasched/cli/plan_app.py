"""``metasched-plan``: how small a cluster each scheduler needs to match a target step time.

Examples::

    metasched-plan                                   # coding: every scheduler vs static
    metasched-plan workload=rm_math target_step_s=300
    metasched-plan scheduler=checkpoints/default     # one scheduler
    metasched-plan 'schedulers=[elastic_greedy,checkpoints/default]' tolerance=0.02
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any

from metasched.cli.app import make_main
from metasched.cli.output import json_safe, write_atomic
from metasched.cli.settings import (
    int_setting,
    max_wait_setting,
    schedulers_setting,
    seeds_setting,
)
from metasched.compose import load_profile
from metasched.core.actions import KINDS
from metasched.errors import ConfigError


def _float(cfg: dict[str, Any], key: str, lo: float, hi: float = float("inf"), *,
           lo_closed: bool = False) -> float:
    v = cfg.get(key)
    ok = (not isinstance(v, bool) and isinstance(v, (int, float))
          and (lo <= v if lo_closed else lo < v) and v <= hi)
    if not ok:
        raise ConfigError(key, f"must be a number in {'[' if lo_closed else '('}{lo:g}, "
                          f"{hi:g}] (got {v!r})")
    return float(v)


def plan_settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """Validated planning settings from a composed config (one-line errors)."""
    pools = cfg.get("scale_pools")
    if not isinstance(pools, list) or not pools or any(p not in KINDS for p in pools):
        raise ConfigError("scale_pools", f"must be a non-empty list from {list(KINDS)} "
                          f"(got {pools!r})")
    key = "scheduler" if cfg.get("scheduler") is not None else "schedulers"
    scheds, paths, params = schedulers_setting(cfg, key)
    (base,), base_paths, base_params = schedulers_setting(cfg, "baseline")
    target = cfg.get("target_step_s")
    return {"schedulers": scheds, "paths": paths, "params": params, "pools": tuple(pools),
            "baseline": base, "baseline_path": base_paths[base],
            "baseline_params": base_params[base],
            "target_step_s": None if target is None else _float(cfg, "target_step_s", 0.0),
            "seeds": seeds_setting(cfg), "workers": int_setting(cfg, "workers", 1),
            "tolerance": _float(cfg, "tolerance", 0.0, 1.0, lo_closed=True),
            "resolution": _float(cfg, "resolution", 0.0, 1.0),
            "min_scale": _float(cfg, "min_scale", 0.0, 1.0),
            "max_wait_s": max_wait_setting(cfg), "per_pool": bool(cfg.get("per_pool", True))}


def run_plan(cfg: dict[str, Any], out_dir, progress: bool = True) -> dict[str, Any]:
    """Plan every scheduler as configured, printing each plan's trials; plan.json and
    plan.md in ``out_dir`` are rewritten whole as each plan finishes (``complete`` false
    until the last), so a run stopped early keeps every plan it finished; then the table
    is printed."""
    from metasched.evaluation.planning import limiting_pools, mean_step, plan_capacity

    workload, cluster = load_profile(cfg)
    s = plan_settings(cfg)
    common = dict(seeds=s["seeds"], tolerance=s["tolerance"], resolution=s["resolution"],
                  min_scale=s["min_scale"], max_wait_s=s["max_wait_s"],
                  workers=s["workers"], progress=progress)
    present = [p for p in s["pools"] if cluster.resources()[p]]
    if not present:
        raise ConfigError("scale_pools", f"the cluster has none of {list(s['pools'])}")
    target, source = s["target_step_s"], "given"
    if target is None:  # one target for every scheduler
        print(f"target: {s['baseline']}'s mean step time on the full cluster "
              f"({len(s['seeds'])} seeds)", flush=True)
        target = mean_step(workload, cluster, s["baseline_path"], s["baseline_params"],
                           s["seeds"], s["workers"], progress, s["max_wait_s"])
        source = f"{s['baseline']} on the full cluster"
    doc: dict[str, Any] = {"workload": workload.name, "target_step_s": target,
                           "target_source": source, "tolerance": s["tolerance"],
                           "scale_pools": list(s["pools"]), "complete": False,
                           "schedulers": {}}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plans: dict[str, Any] = {}
    probe = functools.partial(_probe, cluster=cluster)
    alone_pools = present if s["per_pool"] and len(present) > 1 else []
    total, done = len(s["schedulers"]) * (1 + len(alone_pools)), 0

    def finished(name: str, plan, alone: dict[str, Any]) -> None:
        """Keep a finished plan: plan.json and plan.md rewritten whole with it."""
        nonlocal done
        done += 1
        plans[name] = (plan, alone)
        doc["schedulers"][name] = {**plan.to_dict(),
                                   "limited_by": limiting_pools(plan, alone),
                                   "per_pool": {p: one.to_dict() for p, one in alone.items()}}
        doc["complete"] = done == total
        _write(out, doc, plan_table(plans, cluster, target, source, s["tolerance"]))

    try:
        for name in s["schedulers"]:
            run = dict(common, params=s["params"][name], target_step_s=target, label=name,
                       on_trial=probe)
            _start(f"[{done + 1}/{total}] {name}, all of {', '.join(s['pools'])} scaled "
                   "together", target, source, s["tolerance"])
            plan = plan_capacity(workload, cluster, s["paths"][name], pools=s["pools"], **run)
            plan.target_source = source
            _conclude(plan)
            alone: dict[str, Any] = {}
            finished(name, plan, alone)
            for pool in alone_pools:
                _start(f"[{done + 1}/{total}] {name}, {pool} alone scaled, the rest full",
                       target, source, s["tolerance"])
                one = plan_capacity(workload, cluster, s["paths"][name], pools=(pool,), **run)
                one.target_source = source
                alone[pool] = one
                _conclude(one)
                finished(name, plan, alone)
    except KeyboardInterrupt:
        if done:
            print(f"\n{done} of {total} plans finished, kept in {out / 'plan.json'}",
                  file=sys.stderr, flush=True)
        raise
    print(plan_table(plans, cluster, target, source, s["tolerance"]))
    print(f"plan written to {out / 'plan.json'}")
    return doc


def _write(out: Path, doc: dict[str, Any], table: str) -> None:
    write_atomic(out / "plan.json", json.dumps(json_safe(doc), indent=2) + "\n")
    write_atomic(out / "plan.md", table)


# Printed under the table: what the joint columns mean, and why they can be far from
# the per-pool ones.
TABLE_NOTE = (
    "scale, the pools' columns and saved: every scaled pool shrunk by the one factor "
    "together. limited by: the pool that, one step below that scale, had fewer resources "
    "than it needs even alone; a pool counted in whole units (GPUs, cores per node, API "
    "slots) rounds, so one small pool (2 GPUs become 1 below scale 0.75) can hold every "
    "other pool at its scale. <pool> alone: saved: that pool shrunk alone, the others "
    "full; these savings do not add up (each assumes the others full).")


def plan_table(plans: dict[str, Any], cluster, target: float, source: str,
               tolerance: float) -> str:
    """One markdown table: per scheduler, the smallest cluster meeting the target, the
    pool that limits the joint scale, and what each pool alone saves; a note under it
    says how to read the joint and the per-pool savings side by side."""
    from metasched.evaluation.planning import limiting_pools

    full = cluster.resources()
    present = [p for p in full if full[p]]
    pools_alone = sorted({p for _, alone in plans.values() for p in alone},
                         key=present.index)
    head = ["scheduler", "scale", *(f"{p} (of {full[p]:g})" for p in present),
            "saved", "limited by", "mean step s", *(f"{p} alone: saved" for p in pools_alone)]
    lines = [f"Target: mean step time {target:,.1f} s ({source}), met within "
             f"{tolerance:.1%}.", "", "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]
    for name, (plan, alone) in plans.items():
        if plan.scale is None:
            cells = ["misses at full size", *("–" for _ in present), "–", "–",
                     f"{plan.trials[0].mean_step_s:,.1f}"]
        else:
            met = next(t for t in plan.trials if t.scale == plan.scale)
            saved = plan.saved()
            cells = [f"{plan.scale:.3f}", *(f"{plan.planned[p]:g}" for p in present),
                     ", ".join(f"{p} {saved[p]:.0%}" for p in present),
                     _limit_cell(plan, limiting_pools(plan, alone)),
                     f"{met.mean_step_s:,.1f}"]
        for p in pools_alone:
            one = alone.get(p)
            cells.append("–" if one is None or one.scale is None
                         else f"{one.saved()[p]:.0%}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join([*lines, "", TABLE_NOTE]) + "\n"


def _limit_cell(plan, pools: list[str]) -> str:
    """``gpu (2 → 1 misses)``: each limiting pool, planned and one step below."""
    if not pools:
        return "–"
    fail = max((t for t in plan.trials if t.scale < plan.scale and not t.meets),
               key=lambda t: t.scale)
    return ", ".join(f"{p} ({plan.planned[p]:g} → {fail.resources[p]:g} misses)"
                     for p in pools)


def _start(title: str, target: float, source: str, tolerance: float) -> None:
    print(f"{title}: target mean step time {target:,.1f} s ({source}), met within "
          f"{tolerance:.1%}; bisecting", flush=True)


def _probe(t, cluster) -> None:
    """One line per tried scale, as soon as it is measured (a plan takes minutes)."""
    res = ", ".join(f"{k} {v:g}" for k, v in t.resources.items() if cluster.resources()[k])
    print(f"  scale {t.scale:6.3f}  [{res}]  mean step {t.mean_step_s:,.1f} s  "
          f"{'meets' if t.meets else 'misses'}", flush=True)


def _conclude(plan) -> None:
    if plan.scale is None:
        print(f"  {plan.scheduler} does not meet the target even on the full cluster")
    else:
        saved = ", ".join(f"{k} {v:.0%}" for k, v in plan.saved().items())
        print(f"  {plan.scheduler} meets it at scale {plan.scale:.3f}: resources saved: {saved}",
              flush=True)


main = make_main("plan", run_plan)


if __name__ == "__main__":
    main()
