"""Trace replay: a JSONL file that stands in for the workload generator.

A trace holds a :class:`~metasched.sim.sampling.WorkloadInstance` one JSON object per line:
``{"type": "trajectory", ...}`` lines (grouped into RL steps by their ``step``) and
``{"type": "action", ...}`` lines (independent actions with explicit arrival times);
``{"type": "generation", ...}`` lines (LLM turns a generation pool served:
:class:`~metasched.core.engine.GenerationLine`) are read for calibration, not replayed.
Blank lines and lines starting with ``#`` are ignored. The format is described for users
in ``docs/concepts/traces.md``.

Reading is strict: any malformed line raises :class:`~metasched.errors.ConfigError` with a
one-line message naming the file, the line number and the field, e.g.
``trace.jsonl:12: action.duration_s: must be > 0 (got -1)``. Floats are written with
``repr`` precision, so ``read_trace(write_trace(x))`` equals ``x`` field by field.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from metasched.core.actions import KINDS, ActionSpec, SandboxSpec, Turn
from metasched.core.cluster_config import ClusterConfig, parse_cluster
from metasched.core.engine import GenerationLine
from metasched.core.pools import ServiceSpec
from metasched.core.schema import parse
from metasched.core.validate import Field, json_object, number, required, short, string
from metasched.errors import ConfigError, one_of
from metasched.sim.sampling import (
    IndependentAction,
    TrajectorySpec,
    WorkloadInstance,
    sample_workload,
    workload_rng,
)
from metasched.sim.workload_config import WorkloadConfig, parse_service

PathLike = str | os.PathLike

# Optional action fields that only one kind may carry.
_KIND_FIELDS = {"cpu": ("min_cores", "max_cores", "parallel_fraction"),
                "gpu": ("service",), "api": ("endpoint", "tokens")}
_OWNER = {f: kind for kind, fs in _KIND_FIELDS.items() for f in fs}
_ACTION_KEYS = {"kind", "name", "duration_s", "est_s", "timeout_s", "reward", *_OWNER}
_TRAJECTORY_KEYS = {"type", "task", "step", "sandbox", "turns", "prompt"}
_INDEPENDENT_KEYS = {"type", "arrival_s", "task", "action", "measured"}
_MEASURED_KEYS = {"queue_s", "run_s", "status", "reason", "exit_code", "cores", "core_ids",
                  "device", "batch", "setup_s", "trajectory", "turn", "step", "gap_s", "prompt"}
_CLUSTER_KEYS = {"type", "name", "scale", "cpu", "gpu", "api", "services", "started_at"}
STATUSES = ("done", "failed", "timeout", "cancelled")


@dataclass(frozen=True, slots=True)
class Measured:
    """What a clock measured about a finished action (an ``action`` line's ``measured``,
    written by :class:`metasched.core.trace_writer.TraceWriter`). Replay ignores it;
    ``metasched-calibrate`` fits profiles to it."""

    queue_s: float
    run_s: float
    status: str
    reason: str = ""
    exit_code: int | None = None
    cores: int | None = None
    core_ids: tuple[int, ...] | None = None
    device: int | None = None
    batch: int = 1
    setup_s: float = 0.0
    trajectory: str | None = None
    turn: int = 0
    step: int | None = None
    gap_s: float | None = None
    prompt: str | None = None  # the prompt its trajectory answers (GRPO siblings share it)


@dataclass(frozen=True, slots=True)
class TraceHeader:
    """A ``cluster`` line: the resources a recorded trace ran on."""

    cluster: ClusterConfig
    doc: dict[str, Any]  # the cluster in the configs/cluster form, as written
    services: dict[str, ServiceSpec]
    started_at: float | None


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One line of a trace as :func:`scan_trace` yields it: its line number and exactly
    one of a trajectory (with its step), an independent action (with what was measured,
    if anything) or a header."""

    lineno: int
    step: int = -1
    trajectory: TrajectorySpec | None = None
    action: IndependentAction | None = None
    measured: Measured | None = None
    header: TraceHeader | None = None
    generation: GenerationLine | None = None


def _parse_action(value: Any, at: Field) -> ActionSpec:
    """An ``ACTION`` object as an :class:`ActionSpec` (``duration_s`` -> ``true_s``)."""
    d = json_object(value, at, _ACTION_KEYS)
    kind = required(d, "kind", at)
    one_of(kind, KINDS, at["kind"])
    for key in d:
        owner = _OWNER.get(key)
        if owner is not None and owner != kind:
            raise ConfigError(str(at[key]), f"only {owner} actions have it (this is {kind})")
    name = string(required(d, "name", at), at["name"])
    true_s = number(required(d, "duration_s", at), at["duration_s"], lo=0.0, lo_open=True)
    est_s = number(d.get("est_s", true_s), at["est_s"], lo=0.0, lo_open=True)
    timeout_s = number(required(d, "timeout_s", at), at["timeout_s"], lo=0.0, lo_open=True)
    reward = d.get("reward", False)
    if not isinstance(reward, bool):
        raise ConfigError(str(at["reward"]), f"must be true or false (got {short(reward)})")
    min_c = number(d.get("min_cores", 1), at["min_cores"], lo=1, integer=True)
    max_c = number(d.get("max_cores", min_c), at["max_cores"], lo=min_c, integer=True)
    pf = number(d.get("parallel_fraction", 0.0), at["parallel_fraction"], lo=0.0, hi=1.0)
    service = string(required(d, "service", at), at["service"]) if kind == "gpu" else None
    endpoint = string(required(d, "endpoint", at), at["endpoint"]) if kind == "api" else None
    tokens = number(d.get("tokens", 0), at["tokens"], lo=0, integer=True)
    return ActionSpec(kind, name, true_s, est_s, timeout_s, min_c, max_c, pf, service,
                      endpoint, tokens, reward)


def _parse_sandbox(value: Any, at: Field) -> SandboxSpec | None:
    if value is None:
        return None
    d = json_object(value, at, {"mem_gb", "startup_s"})
    return SandboxSpec(number(required(d, "mem_gb", at), at["mem_gb"], lo=0.0),
                       number(required(d, "startup_s", at), at["startup_s"], lo=0.0))


def _parse_trajectory(d: dict[str, Any], at: Field) -> tuple[int, TrajectorySpec]:
    """A ``trajectory`` line: its step number and the trajectory."""
    json_object(d, at, _TRAJECTORY_KEYS)
    task = string(required(d, "task", at), at["task"])
    step = number(required(d, "step", at), at["step"], lo=0, integer=True)
    sandbox = _parse_sandbox(d.get("sandbox"), at["sandbox"])
    turns_v = required(d, "turns", at)
    if not isinstance(turns_v, list) or not turns_v:
        raise ConfigError(str(at["turns"]),
                          f"must be a non-empty list of turns (got {short(turns_v)})")
    turns = []
    for i, value in enumerate(turns_v):
        t_at = at["turns"][f"[{i}]"]
        t = json_object(value, t_at, {"gen_s", "action", "together", "chained", "same_turn"})
        gen_s = number(required(t, "gen_s", t_at), t_at["gen_s"], lo=0.0)
        together = t.get("together", False)
        if not isinstance(together, bool) or (together and i == len(turns_v) - 1):
            raise ConfigError(str(t_at["together"]), "must be true or false, and only on a "
                              f"turn before the last (got {short(together)})")
        chained = t.get("chained", False)
        if not isinstance(chained, bool) or (chained and not (turns and turns[-1].together)):
            raise ConfigError(str(t_at["chained"]), "must be true or false, and only on a "
                              f"turn after one with \"together\" (got {short(chained)})")
        same_turn = t.get("same_turn", False)
        if not isinstance(same_turn, bool) or (same_turn and i == 0):
            raise ConfigError(str(t_at["same_turn"]), "must be true or false, and not on the "
                              f"first turn (got {short(same_turn)})")
        action = _parse_action(required(t, "action", t_at), t_at["action"])
        last = i == len(turns_v) - 1
        if action.reward != last:
            raise ConfigError(str(t_at["action"]["reward"]),
                              'the last turn\'s action must have "reward": true' if last
                              else "only the last turn's action may be the reward")
        turns.append(Turn(gen_s, action, together, chained, same_turn))
    prompt = d.get("prompt")
    if prompt is not None:
        prompt = string(prompt, at["prompt"])
    return step, TrajectorySpec(task, tuple(turns), sandbox, prompt)


def _parse_independent(d: dict[str, Any], at: Field
                       ) -> tuple[IndependentAction, Measured | None]:
    """An ``action`` line: an independent action with its arrival time (and what was
    measured about it, in a recorded trace)."""
    json_object(d, at, _INDEPENDENT_KEYS)
    arrival = number(required(d, "arrival_s", at), at["arrival_s"], lo=0.0)
    task = string(required(d, "task", at), at["task"])
    spec = _parse_action(required(d, "action", at), at["action"])
    measured = _parse_measured(d["measured"], at["measured"]) if "measured" in d else None
    return IndependentAction(arrival, task, spec), measured


def _opt_int(d: dict[str, Any], key: str, at: Field, lo: int = 0) -> int | None:
    return None if key not in d else number(d[key], at[key], lo=lo, integer=True)


def _parse_measured(value: Any, at: Field) -> Measured:
    d = json_object(value, at, _MEASURED_KEYS)
    status = required(d, "status", at)
    one_of(status, STATUSES, at["status"])
    reason = d.get("reason", "")
    if not isinstance(reason, str):
        raise ConfigError(str(at["reason"]), f"must be a string (got {short(reason)})")
    ids = d.get("core_ids")
    if ids is not None:
        if not isinstance(ids, list):
            raise ConfigError(str(at["core_ids"]), f"must be a list of core ids (got "
                              f"{short(ids)})")
        ids = tuple(number(c, at["core_ids"][f"[{i}]"], lo=0, integer=True)
                    for i, c in enumerate(ids))
    traj = d.get("trajectory")
    if traj is not None:
        traj = string(traj, at["trajectory"])
    exit_code = d.get("exit_code")
    if exit_code is not None:
        exit_code = number(exit_code, at["exit_code"], lo=-(2 ** 31), integer=True)
    gap = d.get("gap_s")
    prompt = d.get("prompt")
    if prompt is not None:
        prompt = string(prompt, at["prompt"])
    return Measured(
        queue_s=number(required(d, "queue_s", at), at["queue_s"], lo=0.0),
        run_s=number(required(d, "run_s", at), at["run_s"], lo=0.0),
        status=status, reason=reason, exit_code=exit_code,
        cores=_opt_int(d, "cores", at, lo=0), core_ids=ids,
        device=_opt_int(d, "device", at, lo=-1),
        batch=number(d.get("batch", 1), at["batch"], lo=1, integer=True),
        setup_s=number(d.get("setup_s", 0.0), at["setup_s"], lo=0.0),
        trajectory=traj, turn=number(d.get("turn", 0), at["turn"], lo=0, integer=True),
        step=_opt_int(d, "step", at), gap_s=None if gap is None else number(
            gap, at["gap_s"], lo=0.0), prompt=prompt)


def _parse_header(d: dict[str, Any], at: Field) -> TraceHeader:
    """A ``cluster`` line: the cluster (``configs/cluster`` form) and GPU services."""
    json_object(d, at, _CLUSTER_KEYS)
    doc = {k: v for k, v in d.items() if k not in ("type", "services", "started_at")}
    cluster = parse_cluster(doc, path=f"{at}: cluster")
    services_v = d.get("services") or {}
    if not isinstance(services_v, dict):
        raise ConfigError(str(at["services"]), f"must be a JSON object (got {short(services_v)})")
    services = {str(k): parse_service(v, f"{at}: services.{k}")
                for k, v in services_v.items()}
    started = d.get("started_at")
    return TraceHeader(cluster, doc, services, None if started is None else number(
        started, at["started_at"], lo=0.0))


def _parse_record(text: str, loc: str, lineno: int = 0) -> TraceRecord:
    """One non-blank, non-comment line at ``loc`` (``file:line``)."""
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(loc, f"invalid JSON: {e.msg} (column {e.colno})") from None
    except (ValueError, RecursionError) as e:  # too many digits, nesting too deep
        raise ConfigError(loc, f"invalid JSON ({type(e).__name__})") from None
    at = Field(loc)
    if not isinstance(d, dict):
        raise ConfigError(loc, f"must be a JSON object (got {short(d)})")
    kind = required(d, "type", at)
    if kind == "trajectory":
        step, traj = _parse_trajectory(d, at)
        return TraceRecord(lineno, step=step, trajectory=traj)
    if kind == "action":
        action, measured = _parse_independent(d, at)
        return TraceRecord(lineno, action=action, measured=measured)
    if kind == "cluster":
        return TraceRecord(lineno, header=_parse_header(d, at))
    if kind == "generation":
        line = parse(GenerationLine, {k: v for k, v in d.items() if k != "type"}, loc)
        return TraceRecord(lineno, generation=line)
    raise ConfigError(str(at["type"]), f'must be "trajectory", "action", "cluster" or '
                      f'"generation" (got {short(kind)})')


# ---------------------------------------------------------------- reading and writing


def scan_trace(path: PathLike) -> Iterator[TraceRecord]:
    """The lines of a trace one at a time, checked as :func:`read_trace` checks them
    (a recorded trace of millions of actions is read without holding it).

    Raises:
        ConfigError: as :func:`read_trace` (except that an empty file yields nothing).
    """
    name = str(path)
    try:  # a name ending in .gz is read through gzip
        f = (gzip.open(path, "rb") if name.endswith(".gz")  # noqa: SIM115 - closed below
             else open(path, "rb"))  # noqa: SIM115
    except OSError as e:
        raise ConfigError(name, f"cannot read trace ({e.strerror or type(e).__name__})") from None
    with f:
        yield from _scan_lines(f, name)


def _scan_lines(f, name: str) -> Iterator[TraceRecord]:
    lineno = 0
    try:
        for lineno, raw in enumerate(f, start=1):
            loc = f"{name}:{lineno}"
            try:
                text = raw.decode("utf-8").strip()
            except UnicodeDecodeError:
                raise ConfigError(loc, "not valid UTF-8") from None
            if not text or text.startswith("#"):
                continue
            yield _parse_record(text, loc, lineno)
    except (OSError, EOFError) as e:  # a damaged gzip stream
        raise ConfigError(f"{name}:{lineno + 1}", f"cannot read trace ({e})") from None


def read_trace(path: PathLike) -> WorkloadInstance:
    """Load a JSONL trace (see ``docs/concepts/traces.md``) as a workload instance.

    Raises:
        ConfigError: the file cannot be read, is empty, or a line is malformed; the
            one-line message names the file, the line number and the field.
    """
    name = str(path)
    by_step: dict[int, list[TrajectorySpec]] = {}
    first_line: dict[int, int] = {}  # step -> line of its first trajectory
    independent: list[IndependentAction] = []
    for item in scan_trace(path):
        if item.action is not None:
            independent.append(item.action)
        elif item.trajectory is not None:
            by_step.setdefault(item.step, []).append(item.trajectory)
            first_line.setdefault(item.step, item.lineno)
    if not by_step and not independent:
        raise ConfigError(name, "trace is empty: it has no trajectory or action lines")
    missing = next((s for s in range(len(by_step)) if s not in by_step), None)
    if missing is not None:
        line = min(first_line[s] for s in by_step if s > missing)
        raise ConfigError(f"{name}:{line}: step", f"steps must be numbered 0..S-1 without "
                          f"gaps; no trajectory has step {missing}")
    return WorkloadInstance(steps=[by_step[s] for s in range(len(by_step))],
                            independent=independent)


def _action_obj(spec: ActionSpec) -> dict[str, Any]:
    """An :class:`ActionSpec` as an ``ACTION`` object, leaving out default values."""
    obj: dict[str, Any] = {"kind": spec.kind, "name": spec.name,
                           "duration_s": float(spec.true_s)}
    if spec.est_s != spec.true_s:
        obj["est_s"] = float(spec.est_s)
    obj["timeout_s"] = float(spec.timeout_s)
    optional = (("min_cores", int(spec.min_cores), 1),
                ("max_cores", int(spec.max_cores), int(spec.min_cores)),
                ("parallel_fraction", float(spec.parallel_fraction), 0.0),
                ("service", spec.service, None), ("endpoint", spec.endpoint, None),
                ("tokens", int(spec.tokens), 0), ("reward", bool(spec.reward), False))
    for key, value, default in optional:
        if value != default:
            obj[key] = value
    return obj


def _trace_lines(instance: WorkloadInstance) -> list[dict[str, Any]]:
    lines: list[dict[str, Any]] = []
    for step, trajs in enumerate(instance.steps):
        for ts in trajs:
            obj: dict[str, Any] = {"type": "trajectory", "task": ts.task, "step": step}
            if ts.prompt is not None:
                obj["prompt"] = ts.prompt
            if ts.sandbox is not None:
                obj["sandbox"] = {"mem_gb": float(ts.sandbox.mem_gb),
                                  "startup_s": float(ts.sandbox.startup_s)}
            obj["turns"] = [{"gen_s": float(t.gen_s), "action": _action_obj(t.action),
                             **({"together": True} if t.together else {}),
                             **({"chained": True} if t.chained else {}),
                             **({"same_turn": True} if t.same_turn else {})}
                            for t in ts.turns]
            lines.append(obj)
    for ia in instance.independent:
        lines.append({"type": "action", "arrival_s": float(ia.arrival_s), "task": ia.task,
                      "action": _action_obj(ia.spec)})
    return lines


def write_trace(instance: WorkloadInstance, path: PathLike) -> None:
    """Write ``instance`` as a JSONL trace that :func:`read_trace` reads back exactly.

    Trajectories come first, step by step, then the independent actions. Every line is
    checked as :func:`read_trace` would check it before anything is written.

    Raises:
        ConfigError: the instance cannot be represented (e.g. an infinite timeout, a
            trajectory whose reward flags are misplaced, an empty step or instance); a
            field is named by the line it would have had.
        OSError: the file cannot be written.
    """
    name = str(path)
    empty = next((s for s, trajs in enumerate(instance.steps) if not trajs), None)
    if empty is not None:
        raise ConfigError(name, f"step {empty} has no trajectories (a trace cannot record "
                          "an empty step)")
    lines = _trace_lines(instance)
    if not lines:
        raise ConfigError(name, "trace would be empty: the instance has no trajectories "
                          "or independent actions")
    text = []
    for lineno, obj in enumerate(lines, start=1):
        line = json.dumps(obj, separators=(",", ":"))
        _parse_record(line, f"{name}:{lineno}", lineno)
        text.append(line + "\n")
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(text)


# ---------------------------------------------------------------- helpers


def validate_against(instance: WorkloadInstance, workload_services: dict[str, ServiceSpec],
                     cluster: ClusterConfig, path: str = "trace") -> None:
    """Fail when ``instance`` needs something ``cluster`` can never provide.

    Checks: gpu actions name a service in ``workload_services`` that fits a device (and
    the cluster has a device); api actions name an endpoint of the cluster and need no
    more tokens than its quota window admits; cpu actions fit on one node (``min_cores`` at most
    ``cores_per_node``, and some CPU node exists); sandboxes fit a node's memory.

    Raises:
        ConfigError: naming the action as ``trace.steps[s][i].turns[j].action.<field>``
            or ``trace.independent[k].action.<field>``.
    """
    items: list[tuple[str, ActionSpec]] = []
    for s, trajs in enumerate(instance.steps):
        for i, ts in enumerate(trajs):
            where = f"{path}.steps[{s}][{i}]"
            if ts.sandbox is not None and ts.sandbox.mem_gb > cluster.mem_gb_per_node:
                raise ConfigError(f"{where}.sandbox.mem_gb", f"{ts.sandbox.mem_gb:g} GB "
                                  f"exceeds a node's {cluster.mem_gb_per_node:g} GB")
            items += [(f"{where}.turns[{j}].action", t.action) for j, t in enumerate(ts.turns)]
    items += [(f"{path}.independent[{k}].action", ia.spec)
              for k, ia in enumerate(instance.independent)]
    for where, a in items:
        if a.kind == "cpu":
            if cluster.cpu_nodes == 0 or a.min_cores > cluster.cores_per_node:
                raise ConfigError(f"{where}.min_cores", f"needs {a.min_cores} cores on one "
                                  f"node; cluster.cpu has {cluster.cpu_nodes} x "
                                  f"{cluster.cores_per_node}")
        elif a.kind == "gpu":
            if a.service not in workload_services:
                raise ConfigError(f"{where}.service", f"unknown service {a.service!r} "
                                  f"(defined: {', '.join(sorted(workload_services)) or 'none'})")
            if cluster.gpu_devices == 0:
                raise ConfigError(f"{where}.service", "needs a GPU; cluster.gpu.devices is 0")
            mem = workload_services[a.service].mem_gb
            if mem > cluster.gpu_mem_gb:
                raise ConfigError(f"{where}.service", f"service {a.service!r} needs {mem:g} "
                                  f"GB; a device has {cluster.gpu_mem_gb:g} GB")
        elif a.endpoint not in cluster.endpoints:
            raise ConfigError(f"{where}.endpoint", f"unknown endpoint {a.endpoint!r} (cluster "
                              f"defines: {', '.join(sorted(cluster.endpoints)) or 'none'})")
        elif a.tokens > cluster.endpoints[a.endpoint].tok_capacity:
            raise ConfigError(f"{where}.tokens", f"{a.tokens} exceeds what one quota window of "
                              f"endpoint {a.endpoint!r} admits")


def trace_from_workload(workload: WorkloadConfig, seed: int) -> WorkloadInstance:
    """The instance :class:`~metasched.sim.simulator.Simulator` samples for ``seed``.

    Uses the simulator's derivation (``workload_rng(seed)``), so
    ``write_trace(trace_from_workload(w, seed), p)`` records exactly what
    ``Simulator(w, cluster, seed)`` would run.
    """
    return sample_workload(workload, workload_rng(seed))
