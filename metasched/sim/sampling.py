"""Sampling a concrete workload instance from a profile (or loading it from a trace).

A whole instance is drawn up front from one ``numpy.random.Generator``, so every
scheduler evaluated on a seed sees exactly the same trajectories, durations and
estimates (common random numbers): differences between schedulers are theirs alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from metasched.core.actions import ActionSpec, Immutable, SandboxSpec, Turn
from metasched.sim.workload_config import ActionType, TaskConfig, WorkloadConfig


@dataclass(frozen=True, slots=True)
class TrajectorySpec(Immutable):
    """A trajectory to run: its task, its turns (generation gap + action), its sandbox."""

    task: str
    turns: tuple[Turn, ...]
    sandbox: SandboxSpec | None


@dataclass(frozen=True, slots=True)
class IndependentAction(Immutable):
    """An action with an explicit arrival time and no trajectory (trace replay)."""

    arrival_s: float
    task: str
    spec: ActionSpec


@dataclass(slots=True)
class WorkloadInstance:
    """What a simulation runs: RL steps of trajectories, and/or independent actions."""

    steps: list[list[TrajectorySpec]] = field(default_factory=list)
    independent: list[IndependentAction] = field(default_factory=list)

    def demand_by_task(self) -> dict[str, dict[str, float]]:
        """Per pool, each task's total estimated work (est_s x min cores for cpu).

        Pools are ``"cpu"``, ``"gpu"``, ``"api"`` (all endpoints) and ``"api/<endpoint>"``.
        """
        out: dict[str, dict[str, float]] = {"cpu": {}, "gpu": {}, "api": {}}
        specs = [(t.task, turn.action) for s in self.steps for t in s for turn in t.turns]
        specs += [(ia.task, ia.spec) for ia in self.independent]
        for task, spec in specs:
            work = spec.est_s * (spec.min_cores if spec.kind == "cpu" else 1)
            pools = [spec.kind] + ([f"api/{spec.endpoint}"] if spec.kind == "api" else [])
            for pool in pools:
                d = out.setdefault(pool, {})
                d[task] = d.get(task, 0.0) + work
        return out

    @property
    def n_actions(self) -> int:
        return (sum(len(t.turns) for s in self.steps for t in s) + len(self.independent))


def run_seed_sequences(seed: int) -> list[np.random.SeedSequence]:
    """A run's two independent streams, derived from its seed: the workload instance's and
    the scheduler's."""
    return np.random.SeedSequence(seed).spawn(2)


def workload_rng(seed: int) -> np.random.Generator:
    """The generator a run of ``seed`` samples its workload instance from."""
    return np.random.default_rng(run_seed_sequences(seed)[0])


def split_counts(shares: list[float], n: int) -> list[int]:
    """Split ``n`` items by ``shares`` (largest remainder, ties to the first)."""
    total = sum(shares)
    exact = [s / total * n for s in shares]
    counts = [int(x) for x in exact]
    order = sorted(range(len(shares)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: n - sum(counts)]:
        counts[i] += 1
    return counts


def _spec(a: ActionType, rng: np.random.Generator, est_error: float, reward: bool) -> ActionSpec:
    true_s = float(a.duration_s.sample(rng))
    est_s = true_s * float(np.exp(est_error * rng.standard_normal())) if est_error else true_s
    tokens = int(round(a.tokens.sample(rng))) if a.tokens is not None else 0
    return ActionSpec(a.kind, a.name, true_s, est_s, a.timeout_s, a.min_cores, a.max_cores,
                      a.parallel_fraction, a.service, a.endpoint, tokens, reward)


def sample_trajectory(task: TaskConfig, rng: np.random.Generator,
                      est_error: float) -> TrajectorySpec:
    """Draw one trajectory of ``task``."""
    n = int(round(task.turns.sample(rng)))
    if task.turn_groups:
        return _sample_grouped(task, n, rng, est_error)
    probs = np.array([a.prob for a in task.actions]) if task.actions else None
    kinds = rng.choice(len(task.actions), size=n, p=probs) if n else []
    gens = task.generation_s.sample(rng, n + 1)
    turns = [Turn(float(gens[i]), _spec(task.actions[k], rng, est_error, False))
             for i, k in enumerate(kinds)]
    turns.append(Turn(float(gens[n]), _spec(task.reward, rng, est_error, True)))
    return TrajectorySpec(task.name, tuple(turns), task.sandbox)


def _sample_grouped(task: TaskConfig, n: int, rng: np.random.Generator,
                    est_error: float) -> TrajectorySpec:
    """A trajectory of ``n`` agent turns, each a turn group drawn by its probability:
    its stages in order, a stage's chains submitted together (one turn after another,
    a chain's later actions ``chained``), generation before the first stage only; all
    but the group's first action are ``same_turn`` (one agent turn, as live)."""
    groups = task.turn_groups
    picks = rng.choice(len(groups), size=n, p=[g.prob for g in groups]) if n else []
    gens = task.generation_s.sample(rng, n + 1)
    by_name = {a.name: a for a in task.actions}
    turns = []
    for i, k in enumerate(picks):
        for j, stage in enumerate(groups[k].actions):
            flat = [(name, m > 0) for chain in stage for m, name in enumerate(chain)]
            turns += [Turn(float(gens[i]) if j == 0 and m == 0 else 0.0,
                           _spec(by_name[name], rng, est_error, False),
                           together=m < len(flat) - 1, chained=chained,
                           same_turn=j > 0 or m > 0)
                      for m, (name, chained) in enumerate(flat)]
    turns.append(Turn(float(gens[n]), _spec(task.reward, rng, est_error, True)))
    return TrajectorySpec(task.name, tuple(turns), task.sandbox)


def sample_workload(w: WorkloadConfig, rng: np.random.Generator) -> WorkloadInstance:
    """Draw ``w.steps`` RL steps of ``w.trajectories_per_step`` trajectories each."""
    counts = split_counts([t.share for t in w.tasks], w.trajectories_per_step)
    steps = []
    for _ in range(w.steps):
        step = []
        for task, c in zip(w.tasks, counts, strict=True):
            step.extend(sample_trajectory(task, rng, w.estimate_error) for _ in range(c))
        steps.append(step)
    return WorkloadInstance(steps=steps)
