"""What a meta-policy learns from: every option run on randomised training workloads.

A *training instance* is a workload profile and its cluster (one of the configured
points, its trajectories per step and its pools each scaled by a random factor) on a
training seed (below the evaluation seeds, :mod:`metasched.sim.seeds`). Every option
runs on every instance (the same sampled workload for each: the same arrival
sequence, Decima's input for its input-dependent baseline); the table keeps the
instance's workload features (as the meta-policy sees them at its first decision) and
per option the mean step, mean ACT and the seconds per trajectory (makespan ÷
trajectories, the synchronous throughput's inverse).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from metasched.agents.meta_options import Option, workload_features
from metasched.compose import compose, load_profile
from metasched.core.cluster_config import ClusterConfig
from metasched.evaluation.runs import Job, _instance, run_jobs
from metasched.sim.workload_config import WorkloadConfig

# Objective -> the column of the table it reads (lower is better for every one).
FIGURES = {"step": "step", "act": "act", "throughput": "s_per_traj"}
TRAIN_SEED_HIGH = 999_000  # training seeds are drawn below this (validation uses 999000..)


@dataclass
class MetaTable:
    """Features (instances × features) and figures (name -> instances × options)."""

    features: np.ndarray
    figures: dict[str, np.ndarray]
    points: list[str]
    seeds: list[int]
    options: list[str]

    def figure(self, objective: str) -> np.ndarray:
        """The figure ``objective`` reads (instances × options)."""
        return self.figures[FIGURES[objective]]

    def to_dict(self) -> dict[str, Any]:
        return {"features": self.features.tolist(), "points": self.points, "seeds": self.seeds,
                "options": self.options,
                "figures": {k: v.tolist() for k, v in self.figures.items()}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MetaTable:
        return cls(np.asarray(d["features"]), {k: np.asarray(v) for k, v in d["figures"].items()},
                   d["points"], d["seeds"], d["options"])


def first_features(workload: WorkloadConfig, cluster: ClusterConfig, seed: int,
                   max_wait_s: float | None) -> np.ndarray:
    """The workload features at the run's first decision (the same under every
    scheduler: no grant has been made before it)."""
    from metasched.sim.simulator import Simulator

    sim = Simulator(workload, cluster, seed, max_wait_s=max_wait_s,
                    instance=_instance(workload, seed))
    sim.next_decision()
    return workload_features(sim.state)


def training_instance(profile: str, overrides: list[str], rng: np.random.Generator,
                      jitter: dict[str, list[float]], steps: int | None = None
                      ) -> tuple[WorkloadConfig, ClusterConfig]:
    """One randomised workload and cluster around a point: trajectories per step and
    every pool scaled by log-uniform factors from ``jitter`` (``trajectories``,
    ``cluster``), the step kept a whole number of prompt groups; ``steps`` RL steps
    (None: the profile's)."""
    w, c = load_profile(compose("eval", [f"workload={profile}", *overrides]))

    def factor(key: str) -> float:
        lo, hi = jitter.get(key, (1.0, 1.0))
        return float(math.exp(rng.uniform(math.log(lo), math.log(hi))))

    size = max(1, w.groups.size)
    n = max(size, round(w.trajectories_per_step * factor("trajectories") / size) * size)
    w = replace(w, trajectories_per_step=n, steps=steps or w.steps)
    return w, c.scaled(factor("cluster"),
                                                         pools=("cpu", "gpu", "api"))


def build_table(points: dict[str, tuple[str, list[str]]], options: list[Option],
                per_point: int, seed: int, jitter: dict[str, list[float]],
                max_wait_s: float | None = 300.0, workers: int = 1, steps: int | None = None,
                progress: bool = True) -> MetaTable:
    """Run every option on ``per_point`` randomised instances of every point (training
    seeds drawn from ``seed``; ``steps`` RL steps each, None: the profile's)."""
    rng = np.random.default_rng(seed)
    jobs, feats, names, seeds, n_traj = [], [], [], [], []
    for point, (profile, overrides) in points.items():
        for _ in range(per_point):
            w, c = training_instance(profile, list(overrides), rng, jitter, steps)
            s = int(rng.integers(0, TRAIN_SEED_HIGH))
            feats.append(first_features(w, c, s, max_wait_s))
            group = f"{point}#{len(names)}"
            names.append(point)
            seeds.append(s)
            n_traj.append(w.steps * w.trajectories_per_step)
            jobs += [Job(w, c, o.rule, dict(o.params), s, max_wait_s=max_wait_s, label=o.name,
                         group=group) for o in options]
    runs = run_jobs(jobs, workers=workers, progress=progress)
    index = {o.name: k for k, o in enumerate(options)}
    figs = {k: np.full((len(names), len(options)), np.nan) for k in ("step", "act", "s_per_traj")}
    for r in runs:
        i, k = int(r["group"].rsplit("#", 1)[1]), index[r["scheduler"]]
        steps = r["step_s"]
        figs["step"][i, k] = float(np.mean(steps)) if steps else math.nan
        figs["act"][i, k] = r["mean_act_s"]
        figs["s_per_traj"][i, k] = r["makespan_s"] / n_traj[i]
    return MetaTable(np.asarray(feats), figs, names, seeds, [o.name for o in options])


__all__ = ["FIGURES", "MetaTable", "build_table", "first_features", "training_instance"]
