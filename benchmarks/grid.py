"""The scheduler-quality grid: every profile on its default cluster and in the contended
regimes where scheduling matters, every scheduler on the same evaluation seeds.

For each point and scheduler: mean ACT, mean step time, and the ratio of each to the
point's reference (default: its best heuristic by mean ACT), paired by seed, with 95%
intervals (the statistics of ``metasched-eval``). Every point is a ``metasched-eval``
run: ``metasched-eval workload=<profile> <overrides>`` reproduces it.

The step table: per scheduler, step ÷ the best heuristic by mean step, ACT ÷ the best
heuristic by mean ACT, step ÷ the best step heuristic fed the learned predictor (by mean
step, among ``PREDICTED`` when they run: ``critical_path_predicted`` and the like,
:mod:`metasched.evaluation.predictors`), step ÷ the oracle (when it runs) and step ÷ the
step's lower bound (:mod:`metasched.evaluation.step_bound`), each paired by seed with a
95% interval. "The best heuristic" is always among the heuristics on static estimates.

The async table (points ending ``-async``: asynchronous rollouts under a staleness
bound, ``+workload.max_offpolicyness=N``): per scheduler, trajectories per hour ÷ the
best heuristic by it, mean trajectory latency ÷ the best heuristic by it and ACT ÷ the
best heuristic by ACT, paired by seed with 95% intervals.

    python benchmarks/grid.py [--seeds 8] [--points coding-c12,rm_math-gpu1]
        [--schedulers static,...,checkpoints/default] [--reference elastic_greedy]
        [--versus elastic_greedy] [--workers 2] [--out outputs/grid]

Prints the table (markdown) and writes ``grid.md`` and ``grid.json`` under ``--out``.
``--versus NAME`` adds a second table from the same runs: every scheduler paired against
``NAME`` at every point. A scheduler fed the predictor named ``NAME@DESIGN`` runs with the
predictor of that design (:data:`metasched.core.predictor.DESIGNS`; the evaluation's
``predictor.design``), beside ``NAME`` with the default: ``slack_first_predicted@reward_static``
is the rule fed the reward-aware static baseline.
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from metasched.agents import BASELINES, ORACLES, PREDICTED
from metasched.cli.eval_app import eval_settings
from metasched.cli.output import json_safe
from metasched.compose import compose, load_profile
from metasched.core.predictor import DESIGNS
from metasched.errors import ConfigError
from metasched.evaluation.formatting import fmt_ci
from metasched.evaluation.runs import compare_paired, eval_jobs, results_document, run_jobs
from metasched.evaluation.step_bound import mean_step_lower_bound
from metasched.evaluation.step_story import ratio_entry, step_ratios
from metasched.sim.sampling import sample_workload, workload_rng

# point id -> (profile, metasched-eval overrides). The default cluster of every profile,
# then the contended regimes.
POINTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "coding": ("coding", ()),
    "coding-c12": ("coding", ("cluster.cpu.cores_per_node=12",)),
    "coding-c6": ("coding", ("cluster.cpu.cores_per_node=6",)),
    "search": ("search", ()),
    "search-q0.5": ("search", ("cluster.scale=0.5",)),
    "search-q0.25": ("search", ("cluster.scale=0.25",)),
    "rm_math": ("rm_math", ()),
    "rm_math-gpu1": ("rm_math", ("cluster.gpu.devices=1",)),
    "rm_math-t512": ("rm_math", ("workload.trajectories_per_step=512",)),
    "mixed": ("mixed", ()),
    "mixed-x0.25": ("mixed", ("cluster.scale=0.25",)),
    "mixed-x0.125": ("mixed", ("cluster.scale=0.125",)),
    "retool": ("retool", ()),
    "retool-c10": ("retool", ("cluster.cpu.cores_per_node=10",)),
    "retool_grouped": ("retool_grouped", ()),
    "retool_grouped_c10": ("retool_grouped_c10", ()),
    "swe_grouped": ("swe_grouped", ()),
    # Asynchronous rollouts, one batch ahead at most (AReaL's max_head_offpolicyness 1).
    "retool_grouped-async": ("retool_grouped", ("+workload.max_offpolicyness=1",)),
    "retool_grouped_c10-async": ("retool_grouped_c10", ("+workload.max_offpolicyness=1",)),
    "swe_grouped-async": ("swe_grouped", ("+workload.max_offpolicyness=1",)),
}
DEFAULT_SCHEDULERS = (*BASELINES, *PREDICTED, *ORACLES, "checkpoints/default")


def point_settings(point: str, schedulers: list[str], n_seeds: int,
                   seed_offset: int) -> tuple[Any, Any, dict[str, Any]]:
    """(workload, cluster, evaluation settings) of one grid point, as metasched-eval
    composes them."""
    prof, overrides = POINTS[point]
    cfg = compose("eval", [f"workload={prof}", *overrides, f"n_seeds={n_seeds}",
                           f"seed_offset={seed_offset}", f"schedulers=[{','.join(schedulers)}]"])
    workload, cluster = load_profile(cfg)
    return workload, cluster, eval_settings(cfg)


def _cpu_s() -> float:
    """CPU seconds of this process and its finished children (the worker processes)."""
    me, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def run_grid(points: list[str], schedulers: list[str], n_seeds: int, seed_offset: int,
             workers: int, reference: str | None, progress: bool = True) -> dict[str, Any]:
    """Run every point's evaluation (all runs in one pool) and return the grid document."""
    jobs, settings = [], {}
    base = list(dict.fromkeys(n.split("@")[0] for n in schedulers))
    for p in points:
        workload, cluster, s = point_settings(p, base, n_seeds, seed_offset)
        for name in schedulers:
            sched, _, design = name.partition("@")
            one = eval_jobs(workload, cluster, [sched], s["seeds"], params=s["params"],
                            timeline_dt=s["timeline_dt"], max_wait_s=s["max_wait_s"],
                            paths=s["paths"], group=p, design=design or "boost")
            jobs += [replace(j, label=name) for j in one]
        s = {**s, "schedulers": list(schedulers)}
        settings[p] = (workload, s)
    t0 = time.perf_counter()
    cpu0 = _cpu_s()
    runs = run_jobs(jobs, workers=workers, progress=progress)
    wall = time.perf_counter() - t0
    cpu = _cpu_s() - cpu0
    out: dict[str, Any] = {"seeds": settings[points[0]][1]["seeds"], "schedulers": schedulers,
                           "reference": reference, "wall_s": wall, "cpu_s": cpu,
                           "workers": workers,
                           "points": {}}
    for p in points:
        workload, s = settings[p]
        doc = results_document(workload.name, s["schedulers"], s["seeds"],
                               [r for r in runs if r["group"] == p], paths=s["paths"],
                               reference=reference)
        prof, overrides = POINTS[p]
        out["points"][p] = {"profile": prof, "overrides": list(overrides), "results": doc,
                            "step_lower_bound": step_lower_bounds(p, s["seeds"])}
    return out


def step_lower_bounds(point: str, seeds: list[int]) -> list[float] | None:
    """Per seed, the mean over the run's steps of the step's lower bound at ``point``
    (None for a trace workload)."""
    workload, cluster, _ = point_settings(point, ["fifo"], 1, 0)
    if workload.trace is not None or workload.max_offpolicyness is not None:
        return None  # a trace, or no step barrier
    return [mean_step_lower_bound(sample_workload(workload, workload_rng(seed)), cluster)
            for seed in seeds]


def step_table(grid: dict[str, Any]) -> str:
    """The step table (markdown): per synchronous point, every scheduler against the best
    heuristic by step and by ACT, the best heuristic fed the predictor, the oracle and the
    step's lower bound (empty without synchronous points)."""
    def cell(r: dict[str, Any] | None) -> str:
        return fmt_ci(r["ratio"], r["ratio_ci95"]) if r else "—"

    lines = ["| point | scheduler | mean step s | mean ACT s | step ÷ best by step (95% CI) "
             "| ACT ÷ best by ACT (95% CI) | step ÷ best predicted (95% CI) "
             "| step ÷ oracle (95% CI) | step ÷ lower bound (95% CI) |",
             "|---|---|---|---|---|---|---|---|---|"]
    n_rows = len(lines)
    for p, entry in grid["points"].items():
        if is_async(entry):
            continue
        st = step_ratios(entry["results"], list(BASELINES), entry.get("step_lower_bound"),
                         ORACLES[0], PREDICTED)
        lb = st["lower_bound_s"]
        pred = f", best predicted: {st['best_predicted']}" if st["best_predicted"] else ""
        label = (f"{p} (best step: {st['best_by_step']}, best ACT: {st['best_by_act']}{pred}, "
                 f"bound {lb:.4g} s)" if lb else p)
        for i, (name, r) in enumerate(st["schedulers"].items()):
            lines.append(f"| {label if i == 0 else ''} | {name} | {r['mean_step_s']:.4g} "
                         f"| {r['mean_act_s']:.3g} | {cell(r['step_vs_best'])} "
                         f"| {cell(r['act_vs_best'])} | {cell(r['step_vs_predicted'])} "
                         f"| {cell(r['step_vs_oracle'])} "
                         f"| {cell(r['step_vs_bound'])} |")
    return "\n".join(lines) + "\n" if len(lines) > n_rows else ""


def is_async(entry: dict[str, Any]) -> bool:
    """Whether a grid point's runs are asynchronous rollouts."""
    return any("trajectories_per_hour" in s for s in entry["results"]["schedulers"].values())


def async_ratios(doc: dict[str, Any], heuristics: list[str]) -> dict[str, Any]:
    """The async comparison of one point's results document: the best heuristic by
    trajectories per hour, by mean trajectory latency and by mean ACT (among
    ``heuristics``), and per scheduler each ratio to it, paired by seed with 95%
    intervals."""
    sch = doc["schedulers"]
    cands = [n for n in heuristics if n in sch]
    best = {"trajectories_per_hour": max(cands, key=lambda n: sch[n]["trajectories_per_hour"],
                                         default=None),
            "mean_traj_latency_s": min(cands, key=lambda n: sch[n]["mean_traj_latency_s"],
                                       default=None),
            "mean_act_s": min(cands, key=lambda n: sch[n]["mean_act_s"], default=None)}
    rows = {}
    for n, s in sch.items():
        rows[n] = {m: s[m] for m in (*best, "max_staleness")}
        for m, b in best.items():
            rows[n][f"{m}_vs_best"] = (ratio_entry(s["per_seed"][m], sch[b]["per_seed"][m])
                                       if b else None)
    return {"best": best, "schedulers": rows}


def async_table(grid: dict[str, Any]) -> str:
    """The async table (markdown; empty without async points)."""
    def cell(r: dict[str, Any] | None) -> str:
        return fmt_ci(r["ratio"], r["ratio_ci95"]) if r else "—"

    lines = ["| point | scheduler | trajectories/h | mean trajectory latency s | mean ACT s "
             "| trajectories/h ÷ best (95% CI) | latency ÷ best (95% CI) "
             "| ACT ÷ best by ACT (95% CI) | largest staleness |",
             "|---|---|---|---|---|---|---|---|---|"]
    rows = 0
    for p, entry in grid["points"].items():
        if not is_async(entry):
            continue
        a = async_ratios(entry["results"], list(BASELINES))
        b = a["best"]
        label = (f"{p} (best trajectories/h: {b['trajectories_per_hour']}, best latency: "
                 f"{b['mean_traj_latency_s']}, best ACT: {b['mean_act_s']})")
        for i, (name, r) in enumerate(a["schedulers"].items()):
            rows += 1
            lines.append(f"| {label if i == 0 else ''} | {name} "
                         f"| {r['trajectories_per_hour']:.4g} | {r['mean_traj_latency_s']:.4g} "
                         f"| {r['mean_act_s']:.3g} "
                         f"| {cell(r['trajectories_per_hour_vs_best'])} "
                         f"| {cell(r['mean_traj_latency_s_vs_best'])} "
                         f"| {cell(r['mean_act_s_vs_best'])} | {r['max_staleness']} |")
    return "\n".join(lines) + "\n" if rows else ""


def versus(grid: dict[str, Any], name: str) -> dict[str, Any]:
    """The grid with every point's comparison redone against scheduler ``name``."""
    out = copy.deepcopy(grid)
    out["reference"] = name
    for entry in out["points"].values():
        doc = entry["results"]
        compare_paired(doc, [doc["best_heuristic"]] if doc["best_heuristic"] else [], name)
    return out


def summary_table(grid: dict[str, Any]) -> str:
    """Per point: the best heuristic, and every other (learned) scheduler against it."""
    lines = ["| point | best heuristic | its mean ACT s | its ACT ÷ lower bound | its mean step s "
             "| scheduler | ACT ÷ best (95% CI) | step ÷ best (95% CI) |",
             "|---|---|---|---|---|---|---|---|"]
    for p, entry in grid["points"].items():
        doc = entry["results"]
        best = doc["best_heuristic"]
        if best is None:
            continue
        b = doc["schedulers"][best]
        others = [n for n in doc["schedulers"] if n not in BASELINES and n not in ORACLES] or ["—"]
        for n in others:
            pa = doc["schedulers"][n]["paired"] if n in doc["schedulers"] else None
            act = fmt_ci(pa["mean_act_s"]["ratio"], pa["mean_act_s"]["ratio_ci95"]) if pa else "—"
            step = (fmt_ci(pa["mean_step_s"]["ratio"], pa["mean_step_s"]["ratio_ci95"])
                    if pa else "—")
            lines.append(f"| {p} | {best} | {b['mean_act_s']:.3g} "
                         f"| {b['act_over_lower_bound']:.2f} | {b['mean_step_s']:.4g} "
                         f"| {n} | {act} | {step} |")
    return "\n".join(lines) + "\n"


def grid_table(grid: dict[str, Any]) -> str:
    """The grid as one markdown table: a block of rows per point."""
    seeds = grid["seeds"]
    ref = grid["reference"] or "the point's best heuristic (by mean ACT; marked *)"
    lines = [f"{len(seeds)} evaluation seeds ({seeds[0]}..{seeds[-1]}); ratios are paired "
             f"by seed against {ref}, with 95% CIs; {grid['wall_s']:.0f} s of wall time on "
             f"{grid['workers']} worker processes ({grid['cpu_s']:.0f} CPU s).", "",
             "| point | scheduler | mean ACT s | mean step s | ACT ÷ ref (95% CI) "
             "| step ÷ ref (95% CI) |", "|---|---|---|---|---|---|"]
    for p, entry in grid["points"].items():
        doc = entry["results"]
        label = f"{p} (`{' '.join(entry['overrides'])}`)" if entry["overrides"] else p
        for i, (name, s) in enumerate(doc["schedulers"].items()):
            mark = "*" if name == doc["best_heuristic"] else ""
            pa = s.get("paired")
            act = fmt_ci(pa["mean_act_s"]["ratio"], pa["mean_act_s"]["ratio_ci95"]) if pa else "—"
            step = (fmt_ci(pa["mean_step_s"]["ratio"], pa["mean_step_s"]["ratio_ci95"])
                    if pa else "—")
            lines.append(f"| {label if i == 0 else ''} | {name}{mark} | {s['mean_act_s']:.3g} "
                         f"| {s['mean_step_s']:.4g} | {act} | {step} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=8, help="evaluation seeds per point")
    ap.add_argument("--seed-offset", type=int, default=1_000_000)
    ap.add_argument("--points", default=",".join(POINTS),
                    help=f"comma-separated point ids (all: {','.join(POINTS)})")
    ap.add_argument("--schedulers", default=",".join(DEFAULT_SCHEDULERS))
    ap.add_argument("--reference", default=None,
                    help="scheduler every ratio is against (default: each point's best "
                         "heuristic by mean ACT)")
    ap.add_argument("--versus", default=None,
                    help="also tabulate every scheduler paired against this one")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default="outputs/grid")
    args = ap.parse_args(argv)
    points = [p for p in args.points.split(",") if p]
    schedulers = [s for s in args.schedulers.split(",") if s]
    try:
        unknown = [p for p in points if p not in POINTS]
        if unknown or not points:
            raise ConfigError("points", f"unknown point(s) {unknown} (known: {', '.join(POINTS)})")
        if args.seeds < 1:
            raise ConfigError("seeds", f"must be >= 1 (got {args.seeds})")
        for name in schedulers:
            sched, at, design = name.partition("@")
            if at and (sched not in PREDICTED or design not in DESIGNS):
                raise ConfigError("schedulers", f"{name}: NAME@DESIGN is for a scheduler fed "
                                  f"the predictor and one of {', '.join(DESIGNS)}")
        for opt in ("reference", "versus"):
            v = getattr(args, opt)
            if v is not None and v not in schedulers:
                raise ConfigError(opt, f"must be one of --schedulers (got {v!r})")
        grid = run_grid(points, schedulers, args.seeds, args.seed_offset, max(1, args.workers),
                        args.reference)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    table = grid_table(grid)
    if grid["reference"] is None:
        table += "\n" + summary_table(grid)
    for extra in (step_table(grid), async_table(grid)):
        if extra:
            table += "\n" + extra
    if args.versus is not None:
        table += "\n" + grid_table(versus(grid, args.versus))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "grid.md").write_text(table)
    (out / "grid.json").write_text(json.dumps(json_safe(grid), indent=1) + "\n")
    print(table)
    print(f"written to {out}/grid.md and grid.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
