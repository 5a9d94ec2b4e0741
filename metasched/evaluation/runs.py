"""Evaluating schedulers on evaluation seeds: parallel runs, aggregation, reports.

Seeds: evaluation uses ``seed_offset .. seed_offset + n_seeds - 1`` with
``EVAL_SEED_OFFSET`` = 1,000,000 by default; training uses seeds below it, so the
two ranges are disjoint (:mod:`metasched.sim.seeds`).
"""

from __future__ import annotations

import math
import multiprocessing as mp
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any

import numpy as np

from metasched.core.cluster_config import ClusterConfig
from metasched.core.metrics import API_REQ, CPU_BUSY, CPU_HELD, GPU_BUSY, GPU_HELD, RunResult
from metasched.evaluation.statistics import ci95
from metasched.sim.workload_config import WorkloadConfig


@dataclass(frozen=True)
class Job:
    """One simulation: a scheduler on a seed."""

    workload: WorkloadConfig
    cluster: ClusterConfig
    scheduler: str
    params: dict[str, Any]
    seed: int
    timeline_dt: float = 10.0
    max_wait_s: float | None = None
    label: str | None = None  # the name in results (default: ``scheduler``)
    estimates: str = "profile"  # see metasched.sim.simulator.ESTIMATES


def run_job(job: Job) -> dict[str, Any]:
    """Run one job and return its compact measurements (picklable)."""
    from metasched.agents import make_scheduler
    from metasched.errors import ConfigError
    from metasched.sim.simulator import SimulationError, Simulator, cost_model_for

    sim = Simulator(job.workload, job.cluster, job.seed, timeline_dt=job.timeline_dt,
                    max_wait_s=job.max_wait_s, cost_model=cost_model_for(job.estimates))
    name = job.label or job.scheduler
    try:
        r = sim.run(make_scheduler(job.scheduler, **job.params))
    except SimulationError as e:  # a run that cannot finish is reported, not a traceback
        why = (f"{e} (set max_wait_s: the starvation guard serves what a waiting scheduler "
               "leaves)") if job.max_wait_s is None else str(e)
        raise ConfigError("max_wait_s" if job.max_wait_s is None else "cluster",
                          f"{name} on seed {job.seed}: {why}") from None
    return summarise_run(r, name, job.seed)


def summarise_run(r: RunResult, label: str, seed: int) -> dict[str, Any]:
    """One run's compact measurements (picklable), as ``aggregate`` reads them; used for
    simulated runs and for what the live dispatcher measured."""
    tl = r.timeline
    span = r.timeline_dt
    timeline: dict[str, list[float]] = {"t": (np.arange(len(tl)) * span).tolist()}
    for pool, busy, held in (("cpu", CPU_BUSY, CPU_HELD), ("gpu", GPU_BUSY, GPU_HELD)):
        cap = span * r.capacity[pool]
        timeline[pool] = (tl[:, busy] / cap).tolist() if cap else []
        # Busy or held-but-idle: what the scheduler keeps from everyone else.
        timeline[f"{pool}_held"] = ((tl[:, busy] + tl[:, held]) / cap).tolist() if cap else []
    timeline["api"] = (tl[:, API_REQ] / (span * r.api_rps)).tolist() if r.api_rps else []
    act = r.act
    return {
        "scheduler": label, "seed": seed,
        "act": act.astype(np.float32), "kind": r.kind, "ok": r.ok,
        "mean_act_s": float(act.mean()) if act.size else math.nan,
        "mean_lower_bound_s": float(r.lower_bound.mean()) if act.size else math.nan,
        "step_s": r.step_s.tolist(), "utilisation": r.utilisation(),
        "idle_held_resource_s": r.idle_held(), "failed": int(r.counters["failed"]),
        "failure_reasons": r.failure_reasons, "counters": r.counters,
        "makespan_s": r.makespan, "timeline": timeline,
    }


def run_jobs(jobs: list[Job], workers: int = 1, progress: bool = True,
             on_done: Callable[[dict[str, Any]], None] | None = None, *,
             transient: bool = False) -> list[dict[str, Any]]:
    """Run jobs in ``workers`` processes (in-process when 1) with a progress bar
    (``transient``: cleared when done, for callers that run many small batches)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    results: list[dict[str, Any]] = []
    columns = ("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    from rich.console import Console

    console = Console()
    # A transient bar off a terminal would leave only an empty line behind.
    shown = progress and (console.is_terminal or not transient)
    with Progress(*columns, console=console, disable=not shown, transient=transient) as bar:
        task = bar.add_task("simulating", total=len(jobs))
        if workers <= 1:
            for job in jobs:
                results.append(run_job(job))
                bar.advance(task)
        else:
            ctx = mp.get_context("spawn")
            with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
                futures = [pool.submit(run_job, j) for j in jobs]
                for f in as_completed(futures):
                    results.append(f.result())
                    bar.advance(task)
    results.sort(key=lambda r: (r["scheduler"], r["seed"]))
    return results


def aggregate(workload: str, seeds: list[int], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``results.json`` document from per-run measurements."""
    by_sched: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by_sched.setdefault(r["scheduler"], []).append(r)
    lb = [r["mean_lower_bound_s"] for r in next(iter(by_sched.values()))] if by_sched else []
    out: dict[str, Any] = {"workload": workload, "seeds": seeds,
                           "lower_bound": {"mean_act_s": float(np.mean(lb)) if lb else math.nan},
                           "schedulers": {}}
    for name, rs in by_sched.items():
        act = np.concatenate([r["act"] for r in rs]).astype(float)
        per_seed_act = [r["mean_act_s"] for r in rs]
        per_seed_step = [float(np.mean(r["step_s"])) if r["step_s"] else math.nan for r in rs]
        steps = [s for r in rs for s in r["step_s"]]
        mean_act = float(np.mean(per_seed_act))
        out["schedulers"][name] = {
            "mean_act_s": mean_act,
            "p50_act_s": float(np.percentile(act, 50)) if act.size else math.nan,
            "p95_act_s": float(np.percentile(act, 95)) if act.size else math.nan,
            "p99_act_s": float(np.percentile(act, 99)) if act.size else math.nan,
            "mean_step_s": float(np.mean(per_seed_step)),
            "max_step_s": float(max(steps)) if steps else math.nan,
            "utilisation": {k: float(np.mean([r["utilisation"][k] for r in rs]))
                            for k in ("cpu", "gpu", "api")},
            "idle_held_resource_s": {k: float(np.mean([r["idle_held_resource_s"][k] for r in rs]))
                                     for k in ("cpu", "gpu", "api")},
            "failed": int(sum(r["failed"] for r in rs)),
            "ci95": {"mean_act_s": ci95(per_seed_act), "mean_step_s": ci95(per_seed_step)},
            "act_over_lower_bound": mean_act / out["lower_bound"]["mean_act_s"],
            "actions": int(act.size),
            "failure_reasons": _sum_dicts(r["failure_reasons"] for r in rs),
            "decisions": int(sum(r["counters"]["decisions"] for r in rs)),
            "guard_fired": int(sum(r["counters"]["guard_fired"] for r in rs)),
            "mean_makespan_s": float(np.mean([r["makespan_s"] for r in rs])),
        }
    return out


def _sum_dicts(ds) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in ds:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def evaluate(workload: WorkloadConfig, cluster: ClusterConfig, schedulers: Sequence[str],
             seeds: Sequence[int], *, params: dict[str, dict[str, Any]] | None = None,
             workers: int = 1, timeline_dt: float = 10.0, max_wait_s: float | None = None,
             paths: dict[str, str] | None = None, estimates: str = "profile",
             progress: bool = True) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run every scheduler on every seed; returns (results document, per-run data).
    ``paths`` maps a scheduler name to what loads it (a checkpoint directory);
    ``estimates`` is ``"profile"`` (each action's own estimate) or ``"online"`` (the
    live dispatcher's cost model, learned from the run's measured durations)."""
    params, paths = params or {}, paths or {}
    jobs = [Job(workload, cluster, paths.get(s, s), dict(params.get(s, {})), seed, timeline_dt,
                max_wait_s, label=s, estimates=estimates)
            for s in schedulers for seed in seeds]
    runs = run_jobs(jobs, workers=workers, progress=progress)
    order = {s: i for i, s in enumerate(schedulers)}
    doc = aggregate(workload.name, list(seeds), runs)
    doc["schedulers"] = dict(sorted(doc["schedulers"].items(), key=lambda kv: order[kv[0]]))
    return doc, runs
