"""Capacity planning: the smallest cluster on which a scheduler meets a target step time.

Bisection over a scale factor applied to the chosen pools (``ClusterConfig.scaled``).
A scale meets the target when its mean step time is at most the target times
``1 + tolerance``: step times that differ by less are the same to the planner, so noise
of a fraction of a percent does not decide the answer. Step time is not strictly
monotone in cluster size for every workload, so the answer is the upper end of the
final bisection bracket (a tested scale that met the target); all trials are reported
so a non-monotone curve is visible.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from metasched.core.cluster_config import ClusterConfig
from metasched.errors import ConfigError
from metasched.evaluation.runs import Job, run_jobs
from metasched.sim.workload_config import WorkloadConfig, check_compatible


@dataclass
class Trial:
    scale: float
    resources: dict[str, float]
    mean_step_s: float
    meets: bool


@dataclass
class Plan:
    """The outcome of :func:`plan_capacity`."""

    scheduler: str
    target_step_s: float
    target_source: str
    scale: float | None
    full: dict[str, float]
    planned: dict[str, float] | None
    trials: list[Trial] = field(default_factory=list)
    tolerance: float = 0.0

    def saved(self) -> dict[str, float] | None:
        """Fraction of each pool's resources saved (pools the cluster has)."""
        if self.planned is None:
            return None
        return {k: 1.0 - self.planned[k] / v for k, v in self.full.items() if v}

    def to_dict(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler, "target_step_s": self.target_step_s,
                "target_source": self.target_source, "tolerance": self.tolerance,
                "scale": self.scale,
                "resources_full": self.full, "resources_planned": self.planned,
                "resources_saved": self.saved(),
                "trials": [t.__dict__ for t in sorted(self.trials, key=lambda t: t.scale)]}


def mean_step(workload: WorkloadConfig, cluster: ClusterConfig, scheduler: str,
              params: dict[str, Any], seeds: Sequence[int], workers: int,
              progress: bool, max_wait_s: float | None = None) -> float:
    jobs = [Job(workload, cluster, scheduler, params, s, max_wait_s=max_wait_s) for s in seeds]
    runs = run_jobs(jobs, workers=workers, progress=progress, transient=True)
    return float(np.mean([np.mean(r["step_s"]) for r in runs]))


def plan_capacity(workload: WorkloadConfig, cluster: ClusterConfig, scheduler: str,
                  seeds: Sequence[int], *, params: dict[str, Any] | None = None,
                  target_step_s: float | None = None, baseline: str = "static",
                  baseline_params: dict[str, Any] | None = None,
                  pools: tuple[str, ...] = ("cpu", "gpu", "api"), tolerance: float = 0.01,
                  resolution: float = 0.02, min_scale: float = 0.01,
                  max_wait_s: float | None = 300.0, label: str | None = None,
                  workers: int = 1, progress: bool = True,
                  on_trial: Callable[[Trial], None] | None = None) -> Plan:
    """Bisect the scale factor of ``pools`` for the smallest cluster on which
    ``scheduler``'s mean step time is at most the target (default: ``baseline``'s mean
    step time on the full cluster) times ``1 + tolerance``.

    Args:
        scheduler, baseline: names or checkpoint paths (``make_scheduler``).
        tolerance: relative slack on the target (0.01: within 1% of it meets it).
        resolution: stop bisecting when the bracket of scales is this narrow.
        max_wait_s: the core's starvation guard for every run (as in evaluation).
        label: the scheduler's name in the plan (default: ``scheduler``).
        on_trial: called with each new trial as soon as it is measured (progress).
    """
    params = params or {}
    source = "given"
    if target_step_s is None:
        target_step_s = mean_step(workload, cluster, baseline, baseline_params or {}, seeds,
                                  workers, progress, max_wait_s)
        source = f"{baseline} on the full cluster"
    plan = Plan(label or scheduler, target_step_s, source, None, cluster.resources(), None,
                tolerance=tolerance)
    bound = target_step_s * (1.0 + tolerance)
    seen: dict[tuple, Trial] = {}

    def trial(scale: float) -> Trial:
        c = cluster.scaled(scale, pools)
        key = tuple(sorted(c.resources().items())) + (c.cores_per_node,)
        if key in seen:  # rounding mapped this scale onto a cluster already tried
            return seen[key]
        try:
            check_compatible(workload, c)
        except ConfigError:  # the scaled cluster cannot run some action at all
            step = float("inf")
        else:
            step = mean_step(workload, c, scheduler, params, seeds, workers, progress,
                             max_wait_s)
        t = Trial(scale, c.resources(), step, step <= bound)
        seen[key] = t
        plan.trials.append(t)
        if on_trial is not None:
            on_trial(t)
        return t

    if not trial(1.0).meets:
        return plan
    lo, hi = min_scale, 1.0
    if trial(lo).meets:
        hi = lo
    else:
        while hi - lo > resolution:
            mid = (lo + hi) / 2
            if trial(mid).meets:
                hi = mid
            else:
                lo = mid
    best = next(t for t in sorted(plan.trials, key=lambda t: t.scale) if t.scale >= hi)
    plan.scale = best.scale
    plan.planned = best.resources
    return plan


def limiting_pools(plan: Plan, alone: dict[str, Plan] | None = None) -> list[str]:
    """The pools that stop a plan of several pools scaled together from going lower.

    Below the planned scale the largest tried scale missed the target; of the pools that
    had fewer resources there, those that need more than that on their own (``alone``:
    each pool's plan with the others full) are the limit. A pool counted in whole units
    rounds (2 GPUs become 1 below scale 0.75), so one such pool can hold every other
    pool at that scale although each alone could shrink much further. Without ``alone``
    (or when none of them needs more), every pool that had fewer resources is named.
    Empty when the plan has no answer or met the target at the smallest scale tried.
    """
    if plan.scale is None or plan.planned is None:
        return []
    below = [t for t in plan.trials if t.scale < plan.scale and not t.meets]
    if not below:
        return []
    fail = max(below, key=lambda t: t.scale)
    fewer = [p for p, v in plan.planned.items() if plan.full.get(p)
             and fail.resources[p] < v]
    alone = alone or {}
    needs = [p for p in fewer if p in alone and (alone[p].planned is None
                                                 or alone[p].planned[p] > fail.resources[p])]
    return needs or fewer
