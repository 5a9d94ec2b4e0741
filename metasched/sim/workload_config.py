"""The workload schema: tasks, their action types and duration distributions, GPU
services, validated.

A profile arrives as a plain dict (from Hydra/OmegaConf or YAML); ``parse_workload`` turns
it into a frozen :class:`WorkloadConfig` or raises :class:`ConfigError` with a one-line
message naming the field. The simulator samples instances from it
(:mod:`metasched.sim.sampling`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from metasched.core.actions import KINDS, SandboxSpec
from metasched.core.cluster_config import ClusterConfig
from metasched.core.pools import ServiceSpec
from metasched.core.validate import bounded, check_keys, get_key, mapping_or_empty
from metasched.errors import ConfigError, one_of
from metasched.sim.groups import GroupConfig, parse_groups

Z90, Z99 = 1.2815515655446004, 2.3263478740408408  # standard normal quantiles


@dataclass(frozen=True, slots=True)
class Dist:
    """A log-normal distribution given by its median and one upper quantile, clipped
    to [lo, hi]. With no quantile it is the constant ``median``.

    Given both a p90 and a p99, the tail above the p90 gets its own log-scale slope
    (``tail_sigma``): the quantile function is log-linear in the standard normal score
    with a kink at the p90, so the median, p90 and p99 all hold exactly. Measured action
    times have tails far heavier than one log-normal through the median and p90 allows
    (test runs: p90 2.6x the median, p99 155x).

    ``zero`` is a point mass at 0 (before clipping): the fraction of draws that are 0,
    the rest from the log-normal, whose median and quantiles are then those of the
    non-zero draws. Generation gaps have one: an agent's calls made together (a test
    run's programs at once, parallel tool calls) follow each other with no gap.
    """

    median: float
    sigma: float = 0.0
    lo: float = 0.0
    hi: float = math.inf
    tail_sigma: float | None = None  # log-scale slope above the p90 (None: ``sigma``)
    zero: float = 0.0  # the fraction of draws that are 0

    def sample(self, rng, size: int | None = None):
        """Draw from the distribution with ``rng`` (a numpy Generator)."""
        import numpy as np

        if self.sigma == 0.0 and self.tail_sigma is None:
            x = np.full(size, self.median) if size is not None else self.median
        else:
            x = self._unclipped(rng.standard_normal(size))
        if self.zero > 0.0:  # drawn only then: profiles without one keep their streams
            x = np.where(rng.random(size) < self.zero, 0.0, x)
            x = x if size is not None else float(x)
        return np.clip(x, self.lo, self.hi) if size is not None else min(max(x, self.lo), self.hi)

    def _unclipped(self, z):
        """The value at standard normal score ``z``, before clipping."""
        import numpy as np

        logx = self.sigma * z
        if self.tail_sigma is not None:
            logx = logx + (self.tail_sigma - self.sigma) * np.maximum(z - Z90, 0.0)
        return self.median * np.exp(logx)

    def quantile(self, p):
        """The ``p`` quantile(s) (``p`` a number or an array in (0, 1))."""
        import numpy as np
        from scipy.stats import norm

        p = np.asarray(p, float)
        if self.zero > 0.0:  # the mass at 0 takes the lowest quantiles
            body = (p - self.zero) / (1.0 - self.zero)
            x = np.where(p <= self.zero, 0.0,
                         self._unclipped(norm.ppf(np.clip(body, 1e-12, 1.0 - 1e-12))))
            return np.clip(x, self.lo, self.hi)
        return np.clip(self._unclipped(norm.ppf(p)), self.lo, self.hi)


@dataclass(frozen=True, slots=True)
class ActionType:
    """One kind of action a task issues, with the distribution of its durations."""

    name: str
    kind: str
    prob: float
    duration_s: Dist
    timeout_s: float
    min_cores: int = 1
    max_cores: int = 1
    parallel_fraction: float = 0.0
    service: str | None = None
    endpoint: str | None = None
    tokens: Dist | None = None


@dataclass(frozen=True, slots=True)
class TurnGroup:
    """What one agent turn submits: stages of actions of the task's types, in order. The
    first stage comes after the turn's LLM generation, each later one as soon as every
    action of the one before has finished (the steps of one request, such as
    ``/run_code``'s write and run); a stage's chains are submitted together (calls made
    at once, such as a test run's programs), each chain's actions one after another (a
    program's run when its own write has finished); the next stage waits for every
    chain. A stage of single-action chains is a stage of actions submitted together."""

    prob: float
    actions: tuple[tuple[tuple[str, ...], ...], ...]  # stages of chains of names


@dataclass(frozen=True, slots=True)
class TaskConfig:
    """An agentic task: how its trajectories are shaped.

    A trajectory has ``turns`` tool actions (drawn from ``actions`` by ``prob``) and then
    its ``reward`` action; LLM generation of ``generation_s`` precedes each of them.
    With ``turn_groups``, ``turns`` counts agent turns instead, each a group drawn by its
    ``prob``, whose actions follow each other without generation between them.
    """

    name: str
    share: float
    turns: Dist
    generation_s: Dist
    sandbox: SandboxSpec | None
    actions: tuple[ActionType, ...]
    reward: ActionType
    turn_groups: tuple[TurnGroup, ...] = ()


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """A workload profile: tasks, step shape, estimate error, GPU services, or a trace."""

    name: str
    steps: int
    trajectories_per_step: int
    estimate_error: float
    tasks: tuple[TaskConfig, ...]
    services: dict[str, ServiceSpec] = field(default_factory=dict)
    trace: str | None = None
    # Between one RL step's end and the next one's start: the trainer's update, while
    # the rollout's resources idle (quotas refill).
    step_gap_s: float = 0.0
    # Each RL step's rollout runs on a service started for it (a recorded trace of
    # runs appended one after another): every API quota starts the step full.
    step_fresh_quotas: bool = False
    # Prompt groups (GRPO's n responses per prompt) and their latent difficulty
    # (``metasched.sim.groups``); the default, off, draws independent trajectories.
    groups: GroupConfig = GroupConfig()


def parse_dist(d: Any, path: str, *, positive: bool = True) -> Dist:
    """``{median: m, p90: q, p99: q, min: lo, max: hi}`` (p90, p99 or both) or a plain
    number (a constant); where values may be 0 (``positive`` false), also ``zero: f``,
    the fraction of draws that are 0 (the quantiles are then those of the others)."""
    if isinstance(d, (int, float)) and not isinstance(d, bool):
        v = bounded(d, path, lo=0.0, lo_open=positive)
        return Dist(v, 0.0, v, v)
    if not isinstance(d, Mapping):
        raise ConfigError(path, f"must be a number or a mapping with median/p90/p99 (got {d!r})")
    check_keys(d, {"median", "p90", "p99", "min", "max"} | (set() if positive else {"zero"}),
               path)
    median = bounded(get_key(d, "median", path), f"{path}.median", lo=0.0, lo_open=positive)
    zero = bounded(d.get("zero", 0.0), f"{path}.zero", lo=0.0, hi=1.0)
    if zero == 1.0:
        raise ConfigError(f"{path}.zero", "must be < 1 (a distribution of zeros: give 0)")
    sigma = 0.0
    tail_sigma = None
    if "p90" in d and "p99" in d:  # a body through the p90, its own tail to the p99
        p90 = bounded(d["p90"], f"{path}.p90", lo=median)
        p99 = bounded(d["p99"], f"{path}.p99", lo=p90)
        if median > 0:
            sigma = math.log(p90 / median) / Z90
            tail_sigma = math.log(p99 / p90) / (Z99 - Z90)
    else:
        for q, z in (("p90", Z90), ("p99", Z99)):
            if q in d:
                v = bounded(d[q], f"{path}.{q}", lo=median)
                sigma = math.log(v / median) / z if median > 0 else 0.0
    lo = bounded(d.get("min", 0.0), f"{path}.min", lo=0.0)
    hi = bounded(d["max"], f"{path}.max", lo=max(lo, 0.0)) if "max" in d else math.inf
    if not lo <= median <= hi:
        raise ConfigError(path, f"median {median:g} must lie within [min, max] = [{lo:g}, {hi:g}]")
    return Dist(median, sigma, lo, hi, tail_sigma, zero)


def parse_action_type(name: str, d: Any, path: str, services: Mapping, *,
                      reward: bool = False) -> ActionType:
    if not isinstance(d, Mapping):
        raise ConfigError(path, f"must be a mapping (got {d!r})")
    check_keys(d, {"kind", "prob", "duration_s", "timeout_s", "cores", "parallel_fraction",
                    "service", "endpoint", "tokens"}, path)
    kind = get_key(d, "kind", path)
    one_of(kind, KINDS, f"{path}.kind")
    prob = 1.0 if reward else bounded(get_key(d, "prob", path), f"{path}.prob", lo=0.0, hi=1.0)
    duration = parse_dist(get_key(d, "duration_s", path), f"{path}.duration_s")
    timeout = bounded(get_key(d, "timeout_s", path), f"{path}.timeout_s", lo=0.0, lo_open=True)
    min_c = max_c = 1
    pf = 0.0
    service = endpoint = None
    tokens = None
    if kind == "cpu":
        cores = d.get("cores", [1, 1])
        if isinstance(cores, int) and not isinstance(cores, bool):
            cores = [cores, cores]
        if not isinstance(cores, (list, tuple)) or len(cores) != 2:
            raise ConfigError(f"{path}.cores", f"must be [min, max] (got {cores!r})")
        min_c = bounded(cores[0], f"{path}.cores[0]", lo=1, integer=True)
        max_c = bounded(cores[1], f"{path}.cores[1]", lo=min_c, integer=True)
        pf = bounded(d.get("parallel_fraction", 0.0), f"{path}.parallel_fraction", lo=0.0, hi=1.0)
    elif kind == "gpu":
        service = get_key(d, "service", path)
        if not isinstance(service, str) or service not in services:
            raise ConfigError(f"{path}.service", f"unknown service {service!r} (defined: "
                              f"{', '.join(sorted(services)) or 'none'})")
    else:
        endpoint = get_key(d, "endpoint", path)
        if not isinstance(endpoint, str) or not endpoint:
            raise ConfigError(f"{path}.endpoint", f"must be an endpoint name (got {endpoint!r})")
        tokens = parse_dist(d.get("tokens", 0), f"{path}.tokens", positive=False)
    return ActionType(name, kind, prob, duration, timeout, min_c, max_c, pf, service,
                      endpoint, tokens)


def parse_turn_groups(d: Any, path: str, names: set[str]) -> tuple[TurnGroup, ...]:
    """``[{prob: p, actions: [stage, ...]}, ...]`` (absent or null: none): what one turn
    submits, a stage being an action name or a list submitted together of names and
    chains (a chain: a list of names, each submitted when the one before it finishes);
    the groups' probabilities summing to 1, every name one of the task's action types."""
    if d is None:
        return ()
    if not isinstance(d, (list, tuple)) or not d:
        raise ConfigError(path, f"must be a non-empty list of {{prob, actions}} (got {d!r})")
    out = []
    for i, g in enumerate(d):
        gp = f"{path}[{i}]"
        if not isinstance(g, Mapping):
            raise ConfigError(gp, f"must be a mapping {{prob, actions}} (got {g!r})")
        check_keys(g, {"prob", "actions"}, gp)
        prob = bounded(get_key(g, "prob", gp), f"{gp}.prob", lo=0.0, hi=1.0)
        acts = get_key(g, "actions", gp)
        if not isinstance(acts, (list, tuple)) or not acts:
            raise ConfigError(f"{gp}.actions", f"must be a non-empty list of action names "
                              f"(got {acts!r})")
        stages = []
        for stage in acts:
            stage = [stage] if isinstance(stage, str) else stage
            if not isinstance(stage, (list, tuple)) or not stage:
                raise ConfigError(f"{gp}.actions", f"a stage must be an action name or a "
                                  f"non-empty list of names and chains (got {stage!r})")
            chains = []
            for chain in stage:
                chain = [chain] if isinstance(chain, str) else chain
                if not isinstance(chain, (list, tuple)) or not chain or not all(
                        isinstance(a, str) for a in chain):
                    raise ConfigError(f"{gp}.actions", f"a chain must be a non-empty list of "
                                      f"action names (got {chain!r})")
                for a in chain:
                    if a not in names:
                        raise ConfigError(f"{gp}.actions", f"unknown action {a!r} (the "
                                          f"task's: {', '.join(sorted(names)) or 'none'})")
                chains.append(tuple(chain))
            stages.append(tuple(chains))
        out.append(TurnGroup(prob, tuple(stages)))
    if abs(sum(g.prob for g in out) - 1.0) > 1e-6:
        raise ConfigError(path, f"probabilities (prob) must sum to 1 (got "
                          f"{sum(g.prob for g in out):g})")
    return tuple(out)


def parse_service(d: Any, path: str) -> ServiceSpec:
    """A GPU service: ``{mem_gb, restore_s, max_batch, batch_marginal}``."""
    if not isinstance(d, Mapping):
        raise ConfigError(path, f"must be a mapping (got {d!r})")
    check_keys(d, {"mem_gb", "restore_s", "max_batch", "batch_marginal"}, path)
    return ServiceSpec(
        mem_gb=bounded(get_key(d, "mem_gb", path), f"{path}.mem_gb", lo=0.0, lo_open=True),
        restore_s=bounded(get_key(d, "restore_s", path), f"{path}.restore_s", lo=0.0),
        max_batch=bounded(d.get("max_batch", 1), f"{path}.max_batch", lo=1, integer=True),
        batch_marginal=bounded(d.get("batch_marginal", 0.0), f"{path}.batch_marginal", lo=0.0))


def parse_workload(d: Mapping, path: str = "workload") -> WorkloadConfig:
    """Validate a workload profile dict (see ``configs/workload/*.yaml``)."""
    if not isinstance(d, Mapping):
        raise ConfigError(path, f"must be a mapping (got {type(d).__name__})")
    check_keys(d, {"name", "steps", "trajectories_per_step", "estimate_error", "services",
                    "tasks", "trace", "step_gap_s", "step_fresh_quotas", "groups"}, path)
    name = str(get_key(d, "name", path))
    services = {str(k): parse_service(v, f"{path}.services.{k}")
                for k, v in mapping_or_empty(d.get("services"), f"{path}.services").items()}
    trace = d.get("trace")
    steps = bounded(get_key(d, "steps", path, 1), f"{path}.steps", lo=1, integer=True)
    n_traj = bounded(get_key(d, "trajectories_per_step", path, 1), f"{path}.trajectories_per_step",
                     lo=1, integer=True)
    est_err = bounded(get_key(d, "estimate_error", path, 0.0), f"{path}.estimate_error",
                      lo=0.0, hi=5.0)
    tasks_d = d.get("tasks") or {}
    if not isinstance(tasks_d, Mapping):
        raise ConfigError(f"{path}.tasks", "must be a mapping of task name to task")
    if not tasks_d and trace is None:
        raise ConfigError(f"{path}.tasks", "at least one task is required (or give a trace)")
    tasks = []
    for tname in sorted(tasks_d, key=str):
        t, tp = tasks_d[tname], f"{path}.tasks.{tname}"
        if not isinstance(t, Mapping):
            raise ConfigError(tp, f"must be a mapping (got {t!r})")
        check_keys(t, {"share", "turns", "generation_s", "sandbox", "actions", "reward",
                        "turn_groups"}, tp)
        sb = t.get("sandbox")
        sandbox = None
        if sb is not None:
            if not isinstance(sb, Mapping):
                raise ConfigError(f"{tp}.sandbox", f"must be a mapping or null (got {sb!r})")
            check_keys(sb, {"mem_gb", "startup_s"}, f"{tp}.sandbox")
            sandbox = SandboxSpec(
                bounded(get_key(sb, "mem_gb", f"{tp}.sandbox"), f"{tp}.sandbox.mem_gb", lo=0.0),
                bounded(get_key(sb, "startup_s", f"{tp}.sandbox"), f"{tp}.sandbox.startup_s",
                        lo=0.0))
        acts_d = get_key(t, "actions", tp)
        if not isinstance(acts_d, Mapping):
            raise ConfigError(f"{tp}.actions", "must be a mapping of action name to action")
        actions = tuple(parse_action_type(str(a), acts_d[a], f"{tp}.actions.{a}", services)
                        for a in sorted(acts_d, key=str))
        if actions and abs(sum(a.prob for a in actions) - 1.0) > 1e-6:
            raise ConfigError(f"{tp}.actions", "probabilities (prob) must sum to 1 "
                              f"(got {sum(a.prob for a in actions):g})")
        turns = parse_dist(get_key(t, "turns", tp), f"{tp}.turns", positive=False)
        groups = parse_turn_groups(t.get("turn_groups"), f"{tp}.turn_groups",
                                   {a.name for a in actions})
        if not actions and turns.hi > 0:
            raise ConfigError(f"{tp}.actions", "a task with tool turns (turns > 0) needs actions")
        tasks.append(TaskConfig(
            name=str(tname),
            share=bounded(get_key(t, "share", tp, 1.0), f"{tp}.share", lo=0.0, lo_open=True),
            turns=turns,
            generation_s=parse_dist(get_key(t, "generation_s", tp), f"{tp}.generation_s",
                                    positive=False),
            sandbox=sandbox, actions=actions,
            reward=parse_action_type("reward", get_key(t, "reward", tp), f"{tp}.reward",
                                     services, reward=True),
            turn_groups=groups))
    gap = bounded(d.get("step_gap_s", 0.0), f"{path}.step_gap_s", lo=0.0)
    fresh = d.get("step_fresh_quotas", False)
    if not isinstance(fresh, bool):
        raise ConfigError(f"{path}.step_fresh_quotas", f"must be true or false (got {fresh!r})")
    groups = parse_groups(d.get("groups"), f"{path}.groups",
                          {a.name for t in tasks for a in t.actions})
    return WorkloadConfig(name, steps, n_traj, est_err, tuple(tasks), services,
                          None if trace is None else str(trace), gap, fresh, groups)


def check_compatible(w: WorkloadConfig, c: ClusterConfig, path: str = "workload") -> None:
    """Fail when the workload needs something the cluster cannot ever provide."""
    for t in w.tasks:
        for a in (*t.actions, t.reward):
            ap = f"{path}.tasks.{t.name}.{'reward' if a is t.reward else 'actions.' + a.name}"
            if a.prob == 0.0:
                continue
            if a.kind == "cpu":
                if c.cpu_nodes == 0 or c.cores_per_node < a.min_cores:
                    raise ConfigError(f"{ap}.cores", f"needs {a.min_cores} cores on one node; "
                                      f"cluster.cpu has {c.cpu_nodes} x {c.cores_per_node}")
            elif a.kind == "gpu":
                if c.gpu_devices == 0:
                    raise ConfigError(f"{ap}.service", "needs a GPU; cluster.gpu.devices is 0")
                if w.services[a.service].mem_gb > c.gpu_mem_gb:
                    raise ConfigError(f"{ap}.service", f"service {a.service!r} needs "
                                      f"{w.services[a.service].mem_gb:g} GB; a device has "
                                      f"{c.gpu_mem_gb:g} GB")
            elif a.endpoint not in c.endpoints:
                raise ConfigError(f"{ap}.endpoint", f"unknown endpoint {a.endpoint!r} (cluster "
                                  f"defines: {', '.join(sorted(c.endpoints)) or 'none'})")
            elif a.tokens is not None and a.tokens.hi > c.endpoints[a.endpoint].tok_capacity:
                raise ConfigError(f"{ap}.tokens", f"max {a.tokens.hi:g} exceeds what one quota "
                                  f"window of endpoint {a.endpoint!r} admits")
        if t.sandbox is not None and c.cpu_nodes == 0:
            raise ConfigError(f"{path}.tasks.{t.name}.sandbox",
                              "needs a CPU node to live on; cluster.cpu.nodes is 0")
        if t.sandbox is not None and t.sandbox.mem_gb > c.mem_gb_per_node:
            raise ConfigError(f"{path}.tasks.{t.name}.sandbox.mem_gb",
                              f"{t.sandbox.mem_gb:g} GB exceeds a node's {c.mem_gb_per_node:g} GB")
