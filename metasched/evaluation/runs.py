"""Evaluating schedulers on evaluation seeds: parallel runs, aggregation, reports.

Seeds: evaluation uses ``seed_offset .. seed_offset + n_seeds - 1`` with
``EVAL_SEED_OFFSET`` = 1,000,000 by default; training uses seeds below it, so the
two ranges are disjoint (:mod:`metasched.sim.seeds`).
"""

from __future__ import annotations

import math
import multiprocessing as mp
import pickle
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any

import numpy as np

from metasched.core.cluster_config import ClusterConfig
from metasched.core.metrics import API_REQ, CPU_BUSY, CPU_HELD, GPU_BUSY, GPU_HELD, RunResult
from metasched.evaluation.statistics import ci95, paired_comparison
from metasched.sim.sampling import WorkloadInstance, sample_workload, workload_rng
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
    estimates: str = "given"  # see metasched.sim.simulator.ESTIMATES
    group: str | None = None  # which of several evaluations run together it belongs to
    fit_on: str = "auto"  # what the predictor is fitted on (metasched.evaluation.predictors)
    design: str = "boost"  # the predictor's design (metasched.core.predictor.DESIGNS)


# The workload instances sampled last in this process, by (pickled workload, seed): the
# jobs of one seed run back to back (see ``eval_jobs``), so every scheduler after the first
# reuses the instance instead of sampling it again (instances are never mutated).
_INSTANCES: OrderedDict[tuple[bytes, int], WorkloadInstance] = OrderedDict()
_INSTANCES_KEPT = 4


def _instance(workload: WorkloadConfig, seed: int) -> WorkloadInstance | None:
    """The instance ``Simulator(workload, ..., seed)`` samples, from the cache when it is
    there (None for a trace: the simulator reads it)."""
    if workload.trace is not None:
        return None
    key = (pickle.dumps(workload), seed)
    inst = _INSTANCES.get(key)
    if inst is None:
        inst = sample_workload(workload, workload_rng(seed))
        _INSTANCES[key] = inst
        while len(_INSTANCES) > _INSTANCES_KEPT:
            _INSTANCES.popitem(last=False)
    return inst


def run_job(job: Job) -> dict[str, Any]:
    """Run one job and return its compact measurements (picklable)."""
    from metasched.agents import make_scheduler
    from metasched.errors import ConfigError
    from metasched.sim.simulator import SimulationError, Simulator, cost_model_for

    sched = make_scheduler(job.scheduler, **job.params)
    predictor = None
    if getattr(sched, "estimates", None) == "predictor":  # it reads state.predictor
        from metasched.evaluation.predictors import fitted_predictor

        predictor = fitted_predictor(job.workload, fit_on=job.fit_on, design=job.design)
        if getattr(sched, "ranker", False) is None:  # a learned priority, not yet fitted
            from metasched.evaluation.predictors import fitted_ranker

            sched.ranker = fitted_ranker(job.workload)
    sim = Simulator(job.workload, job.cluster, job.seed, timeline_dt=job.timeline_dt,
                    max_wait_s=job.max_wait_s, instance=_instance(job.workload, job.seed),
                    cost_model=cost_model_for(job.estimates), predictor=predictor)
    name = job.label or job.scheduler
    try:
        r = sim.run(sched)
    except SimulationError as e:  # a run that cannot finish is reported, not a traceback
        why = (f"{e} (set max_wait_s: the starvation guard serves what a waiting scheduler "
               "leaves)") if job.max_wait_s is None else str(e)
        raise ConfigError("max_wait_s" if job.max_wait_s is None else "cluster",
                          f"{name} on seed {job.seed}: {why}") from None
    out = summarise_run(r, name, job.seed)
    out["group"] = job.group
    return out


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
    out = {
        "scheduler": label, "seed": seed,
        "act": act.astype(np.float32), "kind": r.kind, "ok": r.ok,
        "mean_act_s": float(act.mean()) if act.size else math.nan,
        "mean_lower_bound_s": float(r.lower_bound.mean()) if act.size else math.nan,
        "step_s": r.step_s.tolist(), "utilisation": r.utilisation(),
        "idle_held_resource_s": r.idle_held(), "failed": int(r.counters["failed"]),
        "failure_reasons": r.failure_reasons, "counters": r.counters,
        "makespan_s": r.makespan, "timeline": timeline,
    }
    ro = r.rollout
    if ro is not None:  # asynchronous rollouts
        out["rollout"] = {
            "trajectories_per_hour": ro.per_hour(),
            "mean_traj_latency_s": float(ro.latency.mean()) if ro.end.size else math.nan,
            "max_staleness": int(ro.staleness.max()) if ro.staleness.size else 0,
            "max_offpolicyness": ro.max_offpolicyness}
    return out


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
                try:
                    for f in as_completed(futures):
                        results.append(f.result())
                        bar.advance(task)
                except BaseException:  # Ctrl-C, SIGTERM: stop now, not after every run
                    _stop(pool)
                    raise
    results.sort(key=lambda r: (r["scheduler"], r["seed"]))
    return results


def _stop(pool: ProcessPoolExecutor) -> None:
    """Drop the runs not started and end the workers' current ones. (A signal sent to
    this process alone, such as a service manager's SIGTERM, does not reach the
    workers, and leaving the pool waits for every submitted run.)"""
    workers = list((getattr(pool, "_processes", None) or {}).values())  # before shutdown
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in workers:
        proc.terminate()


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
            "per_seed": {"seeds": [r["seed"] for r in rs], "mean_act_s": per_seed_act,
                         "mean_step_s": per_seed_step},
        }
        if all("rollout" in r for r in rs):  # asynchronous rollouts
            _rollout_summary(out["schedulers"][name], [r["rollout"] for r in rs])
    return out


ROLLOUT_METRICS = ("trajectories_per_hour", "mean_traj_latency_s")


def _rollout_summary(s: dict[str, Any], ros: list[dict[str, Any]]) -> None:
    """Add an asynchronous evaluation's throughput and latency (means over seeds, CIs, per
    seed) and the largest staleness seen to a scheduler's entry."""
    for m in ROLLOUT_METRICS:
        vals = [ro[m] for ro in ros]
        s[m] = float(np.mean(vals))
        s["ci95"][m] = ci95(vals)
        s["per_seed"][m] = vals
    s["max_staleness"] = max(ro["max_staleness"] for ro in ros)
    s["max_offpolicyness"] = ros[0]["max_offpolicyness"]


PAIRED_METRICS = ("mean_act_s", "mean_step_s")


def best_by_mean_act(doc: dict[str, Any], names: Sequence[str]) -> str | None:
    """The scheduler among ``names`` with the lowest mean ACT (None if there is none)."""
    cands = [n for n in names if n in doc["schedulers"]
             and math.isfinite(doc["schedulers"][n]["mean_act_s"])]
    return min(cands, key=lambda n: doc["schedulers"][n]["mean_act_s"], default=None)


def compare_paired(doc: dict[str, Any], heuristics: Sequence[str],
                   reference: str | None = None) -> dict[str, Any]:
    """Add the paired comparison to a results document: ``best_heuristic`` (lowest mean
    ACT among ``heuristics``), ``reference`` (``reference``, or the best heuristic) and,
    per scheduler, ``paired``: for mean ACT and mean step, the ratio and difference of
    means against the reference over the same seeds, with 95% intervals."""
    doc["best_heuristic"] = best_by_mean_act(doc, heuristics)
    ref = reference if reference is not None else doc["best_heuristic"]
    doc["reference"] = ref
    if ref is None:
        return doc
    base = doc["schedulers"][ref]["per_seed"]
    for s in doc["schedulers"].values():
        mine = s["per_seed"]
        if mine["seeds"] != base["seeds"]:
            raise ValueError(f"cannot pair seeds {mine['seeds']} with {base['seeds']}")
        s["paired"] = {m: paired_comparison(mine[m], base[m]) for m in PAIRED_METRICS}
        for m in ROLLOUT_METRICS:
            if m in mine and m in base:
                s["paired"][m] = paired_comparison(mine[m], base[m])
    return doc


def _sum_dicts(ds) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in ds:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def eval_jobs(workload: WorkloadConfig, cluster: ClusterConfig, schedulers: Sequence[str],
              seeds: Sequence[int], *, params: dict[str, dict[str, Any]] | None = None,
              timeline_dt: float = 10.0, max_wait_s: float | None = None,
              paths: dict[str, str] | None = None, group: str | None = None,
              estimates: str = "given", fit_on: str = "auto",
              design: str = "boost") -> list[Job]:
    """The jobs of one evaluation: every scheduler on every seed. ``paths`` maps a
    scheduler name to what loads it (a checkpoint directory); ``estimates``, ``fit_on``
    and ``design``: see :func:`evaluate`."""
    params, paths = params or {}, paths or {}
    # Seed by seed: a worker then samples each instance once for all schedulers.
    return [Job(workload, cluster, paths.get(s, s), dict(params.get(s, {})), seed, timeline_dt,
                max_wait_s, label=s, group=group, estimates=estimates, fit_on=fit_on,
                design=design)
            for seed in seeds for s in schedulers]


def results_document(workload: str, schedulers: Sequence[str], seeds: Sequence[int],
                     runs: list[dict[str, Any]], *, paths: dict[str, str] | None = None,
                     reference: str | None = None) -> dict[str, Any]:
    """The results document of one evaluation's runs: schedulers in the given order,
    each compared, paired by seed, with ``reference`` (default: the best heuristic of the
    run by mean ACT; see :func:`compare_paired`)."""
    from metasched.agents import BASELINES, ORACLES

    paths = paths or {}
    order = {s: i for i, s in enumerate(schedulers)}
    doc = aggregate(workload, list(seeds), runs)
    doc["schedulers"] = dict(sorted(doc["schedulers"].items(), key=lambda kv: order[kv[0]]))
    heuristics = [s for s in schedulers if paths.get(s, s) in BASELINES]
    # What the step story judges against the heuristics: neither a heuristic nor an
    # oracle (learned checkpoints, the rules fed the learned predictor).
    doc["heuristics"] = heuristics
    doc["learned"] = [s for s in schedulers
                      if s not in heuristics and paths.get(s, s) not in ORACLES]
    return compare_paired(doc, heuristics, reference)


def evaluate(workload: WorkloadConfig, cluster: ClusterConfig, schedulers: Sequence[str],
             seeds: Sequence[int], *, params: dict[str, dict[str, Any]] | None = None,
             workers: int = 1, timeline_dt: float = 10.0, max_wait_s: float | None = None,
             paths: dict[str, str] | None = None, estimates: str = "given",
             reference: str | None = None, fit_on: str = "auto", design: str = "boost",
             progress: bool = True) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run every scheduler on every seed; returns (results document, per-run data).
    ``paths`` maps a scheduler name to what loads it (a checkpoint directory);
    ``estimates`` is ``"given"`` (each action's own estimate) or ``"online"`` (the
    live dispatcher's cost model, learned from the run's measured durations);
    ``fit_on``: what a predictor-fed scheduler's predictor is fitted on, ``design`` its
    design (:func:`metasched.evaluation.predictors.fitted_predictor`). The
    document compares every scheduler, paired by seed, with ``reference`` (default: the
    best heuristic of the run by mean ACT; see :func:`compare_paired`)."""
    jobs = eval_jobs(workload, cluster, schedulers, seeds, params=params,
                     timeline_dt=timeline_dt, max_wait_s=max_wait_s, paths=paths,
                     estimates=estimates, fit_on=fit_on, design=design)
    runs = run_jobs(jobs, workers=workers, progress=progress)
    doc = results_document(workload.name, schedulers, seeds, runs, paths=paths,
                           reference=reference)
    return doc, runs
