"""The workload schema: tasks, their action types and duration distributions
(:mod:`metasched.sim.dists`), GPU services, validated.

A profile arrives as a plain dict (from Hydra/OmegaConf or YAML); ``parse_workload`` turns
it into a frozen :class:`WorkloadConfig` or raises :class:`ConfigError` with a one-line
message naming the field. The simulator samples instances from it
(:mod:`metasched.sim.sampling`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator

from metasched.core.actions import KINDS, SandboxSpec
from metasched.core.cluster_config import ClusterConfig
from metasched.core.pools import ServiceSpec
from metasched.core.schema import Count, Demand, Flag, Fraction, Number, Strict, parse
from metasched.errors import ConfigError, short
from metasched.sim.dists import AnyDist, Dist, PositiveDist
from metasched.sim.generation import GenerationConfig
from metasched.sim.groups import GroupConfig, parse_groups

_Kind = Literal[KINDS]  # type: ignore[valid-type]
_Cores = Count(1, 2**53)  # a profile's core counts: any a float holds exactly


class ActionType(Demand):
    """One kind of action a task issues, with the distribution of its durations; its
    resource fields are the shared :class:`~metasched.core.schema.Demand`'s.

    In a profile its cores are ``cores: [min, max]`` (or one number); the fields that
    another kind has (a gpu action's ``cores``, a cpu action's ``service``) are ignored.
    """

    name: str
    kind: Literal[KINDS]  # type: ignore[valid-type]  # cpu, gpu, api
    prob: Fraction
    duration_s: PositiveDist
    timeout_s: Number(gt=0.0)
    tokens: AnyDist | None = None

    def __copy__(self) -> ActionType:  # frozen: copies (a simulator's fork) share it
        return self

    def __deepcopy__(self, memo: dict) -> ActionType:
        return self

    @model_validator(mode="before")
    @classmethod
    def _profile_form(cls, data: Any) -> Any:
        """A profile's form: ``cores: [min, max]``; only the kind's own fields kept."""
        if not isinstance(data, Mapping):
            return data
        kind = data.get("kind")
        other = _NOT_OF_KIND.get(kind, ()) if isinstance(kind, str) else ()
        d = {k: v for k, v in data.items() if k not in other}
        for key in ("min_cores", "max_cores"):
            if key in d:
                raise ConfigError(key, "unknown field (a profile gives cores: [min, max])")
        if "kind" not in d or d["kind"] is None:
            raise ConfigError("kind", "is required")
        kind = parse(_Kind, d["kind"], "kind")
        if kind == "cpu":
            cores = d.pop("cores", [1, 1])
            if isinstance(cores, int) and not isinstance(cores, bool):
                cores = [cores, cores]
            d["min_cores"], d["max_cores"] = parse(tuple[_Cores, _Cores], cores, "cores")
            if d["max_cores"] < d["min_cores"]:
                raise ConfigError("cores[1]", f"must be >= {d['min_cores']} (the minimum; "
                                  f"got {short(cores[1])})")
        elif kind == "gpu":
            d.setdefault("service", None)
            if d["service"] is None:
                raise ConfigError("service", "is required")
        elif kind == "api":
            if d.get("tokens") is None:  # absent or null: none
                d["tokens"] = 0
            if d.get("endpoint") is None:
                raise ConfigError("endpoint", "is required")
        return d


# The fields a profile's action may give that another kind's use (ignored for it).
_NOT_OF_KIND = {"cpu": ("service", "endpoint", "tokens"),
                "gpu": ("cores", "parallel_fraction", "endpoint", "tokens"),
                "api": ("cores", "parallel_fraction", "service")}


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
    # Asynchronous rollouts (``metasched.sim.async_rollout``) with this staleness bound
    # (AReaL's ``max_head_offpolicyness``); None (default): synchronous RL steps.
    max_offpolicyness: int | None = None
    # The LLM's generation as a pool of inference replicas (``metasched.sim.generation``);
    # None (default): each turn's generation is a fixed gap, uncontended.
    generation: GenerationConfig | None = None


class _Service(Strict):
    """A GPU service (:class:`~metasched.core.pools.ServiceSpec`)."""

    mem_gb: Number(gt=0.0)
    restore_s: Number(ge=0.0)
    max_batch: Count(1) = 1
    batch_marginal: Number(ge=0.0) = 0.0

    def spec(self) -> ServiceSpec:
        return ServiceSpec(**self.model_dump())


def parse_service(d: Any, path: str) -> ServiceSpec:
    """A GPU service: ``{mem_gb, restore_s, max_batch, batch_marginal}``."""
    return parse(_Service, d, path).spec()


class _Sandbox(Strict):
    mem_gb: Number(ge=0.0)
    startup_s: Number(ge=0.0)


class _TurnGroup(Strict):
    """``{prob, actions: [stage, ...]}``: a stage is an action name or a list, submitted
    together, of names and chains (a chain: a list of names, each submitted when the
    one before it finishes)."""

    prob: Fraction
    actions: Annotated[list[Any], Field(min_length=1)]

    def stages(self, names: set[str]) -> tuple[tuple[tuple[str, ...], ...], ...]:
        """The stages as chains of names, each name one of ``names``."""
        stages = []
        for stage in self.actions:
            stage = [stage] if isinstance(stage, str) else stage
            if not isinstance(stage, (list, tuple)) or not stage:
                raise ConfigError("actions", f"a stage must be an action name or a "
                                  f"non-empty list of names and chains (got {short(stage)})")
            chains = []
            for chain in stage:
                chain = [chain] if isinstance(chain, str) else chain
                if not isinstance(chain, (list, tuple)) or not chain or not all(
                        isinstance(a, str) for a in chain):
                    raise ConfigError("actions", f"a chain must be a non-empty list of "
                                      f"action names (got {short(chain)})")
                for a in chain:
                    if a not in names:
                        raise ConfigError("actions", f"unknown action {a!r} (the task's: "
                                          f"{', '.join(sorted(names)) or 'none'})")
                chains.append(tuple(chain))
            stages.append(tuple(chains))
        return tuple(stages)


def _named(actions: Any) -> Any:
    """A mapping of action name to action, each given its name."""
    if not isinstance(actions, Mapping):
        return actions
    out = {}
    for name, a in actions.items():
        if isinstance(a, Mapping):
            if "name" in a:
                raise ConfigError(f"{name}.name", "unknown field (an action's name is its key)")
            a = {**a, "name": str(name)}
        out[name] = a
    return out


def _default_if_null(*keys: str) -> Any:
    """A before-validator: the given keys, when null, take their defaults."""
    def drop(data: Any) -> Any:
        if isinstance(data, Mapping) and any(k in data and data[k] is None for k in keys):
            return {k: v for k, v in data.items() if not (k in keys and v is None)}
        return data
    return model_validator(mode="before")(classmethod(lambda cls, data: drop(data)))


class _Task(Strict):
    """A task as a profile gives it (:class:`TaskConfig`)."""

    share: Number(gt=0.0) = 1.0
    turns: AnyDist
    generation_s: AnyDist
    sandbox: _Sandbox | None = None
    actions: Annotated[dict[str, ActionType], BeforeValidator(_named)]
    reward: ActionType
    turn_groups: Annotated[list[_TurnGroup], Field(min_length=1)] | None = None

    _nulls = _default_if_null("share")

    @model_validator(mode="before")
    @classmethod
    def _reward_named(cls, data: Any) -> Any:
        """The reward action is named ``reward`` and always happens (prob 1)."""
        if isinstance(data, Mapping) and isinstance(data.get("reward"), Mapping):
            if "name" in data["reward"]:
                raise ConfigError("reward.name", "unknown field")
            data = {**data, "reward": {**data["reward"], "name": "reward", "prob": 1.0}}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> _Task:
        if self.actions and abs(sum(a.prob for a in self.actions.values()) - 1.0) > 1e-6:
            raise ConfigError("actions", "probabilities (prob) must sum to 1 (got "
                              f"{sum(a.prob for a in self.actions.values()):g})")
        if not self.actions and self.turns.hi > 0:
            raise ConfigError("actions", "a task with tool turns (turns > 0) needs actions")
        if self.turn_groups and abs(sum(g.prob for g in self.turn_groups) - 1.0) > 1e-6:
            raise ConfigError("turn_groups", "probabilities (prob) must sum to 1 (got "
                              f"{sum(g.prob for g in self.turn_groups):g})")
        for i, g in enumerate(self.turn_groups or ()):
            try:
                g.stages(set(self.actions))
            except ConfigError as e:
                raise ConfigError(f"turn_groups[{i}].{e.field}", e.problem) from None
        return self

    def config(self, name: str) -> TaskConfig:
        names = set(self.actions)
        return TaskConfig(
            name=name, share=self.share, turns=self.turns, generation_s=self.generation_s,
            sandbox=None if self.sandbox is None else SandboxSpec(self.sandbox.mem_gb,
                                                                  self.sandbox.startup_s),
            actions=tuple(self.actions[a] for a in sorted(self.actions, key=str)),
            reward=self.reward,
            turn_groups=tuple(TurnGroup(g.prob, g.stages(names))
                              for g in self.turn_groups or ()))


class _Workload(Strict):
    """A workload profile as ``configs/workload/*.yaml`` gives it (:class:`WorkloadConfig`)."""

    name: Annotated[str, BeforeValidator(lambda v: v if v is None else str(v))]
    steps: Count(1) = 1
    trajectories_per_step: Count(1) = 1
    estimate_error: Number(ge=0.0, le=5.0) = 0.0
    services: dict[str, _Service] | None = None
    tasks: dict[str, _Task] | None = None
    trace: Any = None
    step_gap_s: Number(ge=0.0) = 0.0
    step_fresh_quotas: Flag = False
    groups: Any = None  # checked by metasched.sim.groups.parse_groups
    max_offpolicyness: Count(0) | None = None
    generation: GenerationConfig | None = None

    _nulls = _default_if_null("steps", "trajectories_per_step", "estimate_error")

    @model_validator(mode="after")
    def _consistent(self) -> _Workload:
        if not self.tasks and self.trace is None:
            raise ConfigError("tasks", "at least one task is required (or give a trace)")
        services = self.services or {}
        for tname, t in (self.tasks or {}).items():
            for where, a in (*((f"actions.{n}", a) for n, a in t.actions.items()),
                             ("reward", t.reward)):
                if a.kind == "gpu" and a.service not in services:
                    raise ConfigError(f"tasks.{tname}.{where}.service", f"unknown service "
                                      f"{a.service!r} (defined: "
                                      f"{', '.join(sorted(services)) or 'none'})")
        return self

    def config(self, groups: GroupConfig) -> WorkloadConfig:
        tasks = self.tasks or {}
        return WorkloadConfig(
            self.name, self.steps, self.trajectories_per_step, self.estimate_error,
            tuple(tasks[t].config(str(t)) for t in sorted(tasks, key=str)),
            {str(k): s.spec() for k, s in (self.services or {}).items()},
            None if self.trace is None else str(self.trace), self.step_gap_s,
            self.step_fresh_quotas, groups, self.max_offpolicyness, self.generation)


def parse_workload(d: Mapping, path: str = "workload") -> WorkloadConfig:
    """Validate a workload profile dict (see ``configs/workload/*.yaml``)."""
    w = parse(_Workload, d, path)
    return w.config(parse_groups(w.groups, f"{path}.groups",
                                 {a for t in (w.tasks or {}).values() for a in t.actions}))


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
