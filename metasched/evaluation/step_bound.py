"""A lower bound on an RL step's time, from a workload instance's true durations: no
scheduler, however it orders or sizes grants, ends the step sooner.

A step's bound is the largest of:

- its critical path: the longest trajectory alone on the cluster. Turn after turn, the
  generation seconds, then the actions submitted together, run at once at their most
  cores (a chain inside a group counted as its longest action only); the first turn's
  generation overlaps the sandbox's start-up;
- its CPU work over the cluster's cores: every CPU action's core-seconds at its minimum
  cores (Amdahl: fewer cores never cost more core-seconds);
- its API quota: per endpoint, the windows its requests (and tokens) need, one fewer than
  their count, times the window (a fresh quota: a full window at the step's start).

An action cut by its timeout counts its timeout. GPU batching is left out (a batch serves
many requests at once, so no simple count of device time bounds it).
"""

from __future__ import annotations

import math

import numpy as np

from metasched.core.actions import ActionSpec
from metasched.core.cluster_config import ClusterConfig
from metasched.sim.sampling import TrajectorySpec, WorkloadInstance


def min_run_s(spec: ActionSpec) -> float:
    """The shortest an action can run: at its most cores (cpu), alone on a resident
    service (gpu), its latency (api); at most its timeout."""
    run = spec.true_s / spec.speedup(spec.max_cores) if spec.kind == "cpu" else spec.true_s
    return min(run, spec.timeout_s)


def critical_path_s(traj: TrajectorySpec) -> float:
    """The shortest time a trajectory can take alone (see the module docstring)."""
    total, group = 0.0, 0.0
    for i, turn in enumerate(traj.turns):
        if i == 0 or not traj.turns[i - 1].together:  # a new group: generation first
            total += group
            group = 0.0
            gen = turn.gen_s
            if i == 0 and traj.sandbox is not None:
                gen = max(gen, traj.sandbox.startup_s)
            total += gen
        group = max(group, min_run_s(turn.action))
    return total + group


def cpu_work_s(traj: TrajectorySpec) -> float:
    """A trajectory's least CPU core-seconds."""
    out = 0.0
    for turn in traj.turns:
        s = turn.action
        if s.kind == "cpu":
            p, m = s.parallel_fraction, s.min_cores
            out += min(s.true_s * ((1.0 - p) * m + p), s.timeout_s * m)
    return out


def quota_s(trajs: list[TrajectorySpec], cluster: ClusterConfig) -> float:
    """The least time the step's API calls need under the endpoints' quotas."""
    calls: dict[str, list[int]] = {}
    for traj in trajs:
        for turn in traj.turns:
            s = turn.action
            if s.kind == "api" and s.endpoint is not None:
                calls.setdefault(s.endpoint, []).append(s.tokens)
    out = 0.0
    for name, toks in calls.items():
        ep = cluster.endpoints[name]
        windows = math.ceil(len(toks) / ep.req_capacity) - 1
        if ep.tpm is not None:
            windows = max(windows, math.ceil(sum(toks) / ep.tok_capacity) - 1)
        out = max(out, windows * ep.window_s)
    return out


def step_lower_bounds(instance: WorkloadInstance, cluster: ClusterConfig) -> dict[str, list[float]]:
    """Per step of ``instance``: each term of the bound and the bound (``"bound"``)."""
    cores = cluster.cpu_nodes * cluster.cores_per_node
    out: dict[str, list[float]] = {"critical_path": [], "cpu": [], "quota": [], "bound": []}
    for trajs in instance.steps:
        cp = max((critical_path_s(t) for t in trajs), default=0.0)
        cpu = sum(cpu_work_s(t) for t in trajs) / cores if cores else 0.0
        q = quota_s(trajs, cluster)
        for k, v in (("critical_path", cp), ("cpu", cpu), ("quota", q),
                     ("bound", max(cp, cpu, q))):
            out[k].append(v)
    return out


def mean_step_lower_bound(instance: WorkloadInstance, cluster: ClusterConfig) -> float:
    """The mean of the per-step bounds (what a run's mean step time is compared with)."""
    b = step_lower_bounds(instance, cluster)["bound"]
    return float(np.mean(b)) if b else math.nan


__all__ = ["critical_path_s", "cpu_work_s", "mean_step_lower_bound", "min_run_s", "quota_s",
           "step_lower_bounds"]
