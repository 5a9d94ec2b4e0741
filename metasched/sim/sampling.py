"""Sampling a concrete workload instance from a profile (or loading it from a trace).

A whole instance is drawn up front from one ``numpy.random.Generator``, so every
scheduler evaluated on a seed sees exactly the same trajectories, durations and
estimates (common random numbers): differences between schedulers are theirs alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from metasched.core.actions import ActionSpec, Immutable, SandboxSpec, Turn
from metasched.sim.dists import Dist
from metasched.sim.groups import TaskLoadings
from metasched.sim.workload_config import ActionType, TaskConfig, WorkloadConfig


@dataclass(frozen=True, slots=True)
class TrajectorySpec(Immutable):
    """A trajectory to run: its task, its turns (generation gap + action), its sandbox,
    and the prompt it answers (None: unknown; siblings share one)."""

    task: str
    turns: tuple[Turn, ...]
    sandbox: SandboxSpec | None
    prompt: str | None = None


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
    # Per prompt id: its task and latent difficulties (that of its draws, that of its
    # turn counts), where prompt groups were drawn: more siblings can be drawn later.
    prompt_latents: dict[str, tuple[str, float, float]] = field(default_factory=dict)

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


def _normals_only(d: Dist) -> bool:
    """Whether a draw of ``d`` takes at most one standard normal and nothing else."""
    return d.zero == 0.0


def _draws(d: Dist) -> int:
    """Standard normals one draw of ``d`` takes (a constant takes none)."""
    return 0 if d.sigma == 0.0 and d.tail_sigma is None else 1


def _specs(types: list[ActionType], rng: np.random.Generator,
           est_error: float) -> list[ActionSpec]:
    """Draw one action of each of ``types`` in order, the last the reward: the same draws,
    in the same order, as one :func:`_spec` call each, made in one batch.

    Each action takes, in order, a normal for its duration (unless constant), one for its
    estimate's error (when ``est_error``) and one for its tokens (unless constant or
    none); the stream is that of successive single draws, so one ``standard_normal(k)``
    call yields the same numbers. A distribution with a point mass at 0 also takes a
    uniform: then each action is drawn on its own, by :func:`_spec`.
    """
    n = len(types)
    # By identity: hashing a type hashes every field of it and of its distributions.
    kinds = {id(a): a for a in types}
    if not all(_normals_only(a.duration_s) and (a.tokens is None or _normals_only(a.tokens))
               for a in kinds.values()):
        return [_spec(a, rng, est_error, i == n - 1) for i, a in enumerate(types)]
    e = 1 if est_error else 0
    per_kind = {k: (_draws(a.duration_s), 0 if a.tokens is None else _draws(a.tokens))
                for k, a in kinds.items()}
    draws = [per_kind[id(a)] for a in types]
    n_dur = np.array([d for d, _ in draws], dtype=np.intp)
    counts = n_dur + e + np.array([t for _, t in draws], dtype=np.intp)
    offsets = np.cumsum(counts) - counts  # each action's first normal
    z = rng.standard_normal(int(counts.sum()))
    true_s = np.empty(n)
    tok_l = [0] * n
    positions: dict[int, list[int]] = {}
    for i, a in enumerate(types):
        positions.setdefault(id(a), []).append(i)
    for k, where in positions.items():
        a = kinds[k]
        idx = np.array(where, dtype=np.intp)
        nd, nt = per_kind[k]
        true_s[idx] = _values(a.duration_s, z[offsets[idx]] if nd else None, len(idx))
        if a.tokens is not None:  # Python ints by round(), as one draw at a time: any size
            tok = _values(a.tokens, z[offsets[idx] + nd + e] if nt else None, len(idx))
            for i, v in zip(where, tok.tolist(), strict=True):
                tok_l[i] = int(round(v))
    true_l = true_s.tolist()
    est_l = (true_s * np.exp(est_error * z[offsets + n_dur])).tolist() if e else true_l
    return [ActionSpec(a.kind, a.name, true_l[i], est_l[i], a.timeout_s, a.min_cores,
                       a.max_cores, a.parallel_fraction, a.service, a.endpoint, tok_l[i],
                       i == n - 1)
            for i, a in enumerate(types)]


def _values(d: Dist, z: np.ndarray | None, n: int) -> np.ndarray:
    """``n`` draws of ``d`` from their standard normals ``z`` (None: ``d`` is constant),
    clipped, as :meth:`Dist.sample` computes one."""
    if z is None:
        return np.full(n, min(max(d.median, d.lo), d.hi))
    return np.clip(d._unclipped(z), d.lo, d.hi)


def sample_trajectory(task: TaskConfig, rng: np.random.Generator,
                      est_error: float) -> TrajectorySpec:
    """Draw one trajectory of ``task``."""
    n = int(round(task.turns.sample(rng)))
    if task.turn_groups:
        return _sample_grouped(task, n, rng, est_error)
    probs = np.array([a.prob for a in task.actions]) if task.actions else None
    kinds = rng.choice(len(task.actions), size=n, p=probs).tolist() if n else []
    gens = task.generation_s.sample(rng, n + 1).tolist()
    specs = _specs([task.actions[k] for k in kinds] + [task.reward], rng, est_error)
    turns = tuple(map(Turn, gens, specs))
    return TrajectorySpec(task.name, turns, task.sandbox)


def _sample_grouped(task: TaskConfig, n: int, rng: np.random.Generator,
                    est_error: float, draw: _Draws | None = None) -> TrajectorySpec:
    """A trajectory of ``n`` agent turns, each a turn group drawn by its probability:
    its stages in order, a stage's chains submitted together (one turn after another,
    a chain's later actions ``chained``), generation before the first stage only; all
    but the group's first action are ``same_turn`` (one agent turn, as live). ``draw``:
    a prompt's sibling's draws (:func:`_sample_sibling`)."""
    groups = task.turn_groups
    picks = rng.choice(len(groups), size=n, p=[g.prob for g in groups]).tolist() if n else []
    gens = (task.generation_s.sample(rng, n + 1) if draw is None else draw.gens(n + 1)).tolist()
    by_name = {a.name: a for a in task.actions}
    # (generation before it, its type, submitted together with the next, chained to the
    # one before it, same agent turn as the one before it) per action
    plan = [(gens[i] if j == 0 and m == 0 else 0.0, by_name[name], m < len(flat) - 1,
             chained, j > 0 or m > 0)
            for i, k in enumerate(picks) for j, stage in enumerate(groups[k].actions)
            for flat in [[(name, c > 0) for chain in stage for c, name in enumerate(chain)]]
            for m, (name, chained) in enumerate(flat)]
    types = [p[1] for p in plan] + [task.reward]
    specs = _specs(types, rng, est_error) if draw is None else draw.specs(types)
    turns = [Turn(g, spec, together=tog, chained=ch, same_turn=same)
             for (g, _, tog, ch, same), spec in zip(plan, specs[:-1], strict=True)]
    turns.append(Turn(gens[n], specs[-1]))
    return TrajectorySpec(task.name, tuple(turns), task.sandbox,
                          None if draw is None else draw.prompt)


def sample_workload(w: WorkloadConfig, rng: np.random.Generator) -> WorkloadInstance:
    """Draw ``w.steps`` RL steps of ``w.trajectories_per_step`` trajectories each (in
    prompt groups where the profile has them: :func:`sample_prompts`)."""
    if w.groups.on:
        return sample_prompts(w, rng)
    counts = split_counts([t.share for t in w.tasks], w.trajectories_per_step)
    steps = []
    for _ in range(w.steps):
        step = []
        for task, c in zip(w.tasks, counts, strict=True):
            step.extend(sample_trajectory(task, rng, w.estimate_error) for _ in range(c))
        steps.append(step)
    return WorkloadInstance(steps=steps)


# ---------------------------------------------------------------- prompt groups


def sample_prompts(w: WorkloadConfig, rng: np.random.Generator) -> WorkloadInstance:
    """Draw ``w.steps`` RL steps in prompt groups (``w.groups``; ``metasched.sim.groups``):
    each task's trajectories of a step split into prompts of ``groups.size`` responses
    (the last one smaller where they do not divide), siblings one after another. Per
    prompt, its latent difficulty (and the one its turn counts see); per trajectory, its
    persistence latents; then the trajectory, every draw at its combined normal score.
    Prompt ids count the instance's prompts, ``"0"``, ``"1"``, ...: every step's prompts
    are new ones."""
    counts = split_counts([t.share for t in w.tasks], w.trajectories_per_step)
    g = w.groups
    loads = {t.name: TaskLoadings.of(t, g) for t in w.tasks}
    steps, prompts, latents = [], 0, {}
    for _ in range(w.steps):
        step: list[TrajectorySpec] = []
        for task, c in zip(w.tasks, counts, strict=True):
            for first in range(0, c, g.size):
                d, d2 = rng.standard_normal(2).tolist()
                dt = g.turns_coupling * d + math.sqrt(1.0 - g.turns_coupling ** 2) * d2
                latents[str(prompts)] = (task.name, d, dt)
                step.extend(_sample_sibling(task, rng, w.estimate_error, loads[task.name], d,
                                            dt, str(prompts))
                            for _ in range(min(g.size, c - first)))
                prompts += 1
        steps.append(step)
    return WorkloadInstance(steps=steps, prompt_latents=latents)


def sample_siblings(w: WorkloadConfig, instance: WorkloadInstance, prompt: str, n: int,
                    rng: np.random.Generator) -> list[TrajectorySpec]:
    """``n`` more responses to ``prompt`` of ``instance`` (drawn by
    :func:`sample_prompts`), at its latent difficulties, from ``rng``."""
    name, d, dt = instance.prompt_latents[prompt]
    task = next(t for t in w.tasks if t.name == name)
    loads = TaskLoadings.of(task, w.groups)
    return [_sample_sibling(task, rng, w.estimate_error, loads, d, dt, prompt)
            for _ in range(n)]


def _scored(d: Dist, z: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Draws of ``d`` at normal scores ``z`` (its point mass at 0 drawn apart), clipped."""
    x = _values(d, None if d.sigma == 0.0 and d.tail_sigma is None else z, len(z))
    if d.zero > 0.0:
        x = np.where(rng.random(len(z)) < d.zero, 0.0, x)
    return x


@dataclass(frozen=True)
class _Draws:
    """One sibling's draws: its prompt's latent ``d``, its own ``u`` (durations) and
    ``v`` (generation)."""

    rng: np.random.Generator
    loads: TaskLoadings
    task: TaskConfig
    est_error: float
    prompt: str
    d: float
    u: float
    v: float

    def gens(self, m: int) -> np.ndarray:
        g = self.loads.generation
        z = g.a * self.d + g.p * self.v + g.s * self.rng.standard_normal(m)
        return _scored(self.task.generation_s, z, self.rng)

    def specs(self, types: list[ActionType]) -> list[ActionSpec]:
        """Actions of ``types`` in order, the last the reward."""
        rng, m = self.rng, len(types)
        acts = self.loads.actions
        ls = [acts[a.name] for a in types[:-1]] + [acts["reward"]]
        z = (np.array([x.a for x in ls]) * self.d + np.array([x.p for x in ls]) * self.u
             + np.array([x.s for x in ls]) * rng.standard_normal(m))
        err = np.exp(self.est_error * rng.standard_normal(m)) if self.est_error else None
        true_s = np.empty(m)
        positions: dict[int, list[int]] = {}
        for i, a in enumerate(types):
            positions.setdefault(id(a), []).append(i)
        by_id = {id(a): a for a in types}
        for k, where in positions.items():
            idx = np.array(where, dtype=np.intp)
            true_s[idx] = _scored(by_id[k].duration_s, z[idx], rng)
        true_l = true_s.tolist()
        est_l = (true_s * err).tolist() if err is not None else true_l
        return [ActionSpec(a.kind, a.name, true_l[i], est_l[i], a.timeout_s, a.min_cores,
                           a.max_cores, a.parallel_fraction, a.service, a.endpoint,
                           int(round(a.tokens.sample(rng))) if a.tokens is not None else 0,
                           i == m - 1)
                for i, a in enumerate(types)]


def _sample_sibling(task: TaskConfig, rng: np.random.Generator, est_error: float,
                    loads: TaskLoadings, d: float, dt: float, prompt: str) -> TrajectorySpec:
    """One response to a prompt of latent difficulty ``d`` (``dt``: for turn counts)."""
    u, v = rng.standard_normal(2).tolist()
    draw = _Draws(rng, loads, task, est_error, prompt, d, u, v)
    t = loads.turns
    n = int(round(float(_scored(task.turns, np.array([t.a * dt + t.s * rng.standard_normal()]),
                                rng)[0])))
    if task.turn_groups:
        return _sample_grouped(task, n, rng, est_error, draw)
    probs = np.array([a.prob for a in task.actions]) if task.actions else None
    kinds = rng.choice(len(task.actions), size=n, p=probs).tolist() if n else []
    gens = draw.gens(n + 1).tolist()
    specs = draw.specs([task.actions[k] for k in kinds] + [task.reward])
    return TrajectorySpec(task.name, tuple(map(Turn, gens, specs)), task.sandbox, prompt)
