"""What rollout workers submit to the dispatcher (``Request``) and what they get back
(``Result``), with strict parsing of the JSON form (job files, the journal).

A request is one action. Fields every kind has:

- ``kind``: ``"cpu"``, ``"gpu"`` or ``"api"``; ``timeout_s`` (> 0, at most 30 days): the
  action is killed (cpu), reported failed (gpu) or abandoned (api) this long after it
  starts.
- ``id``: idempotency key (default: a fresh one). Submitting a key again with the same
  request returns the first submission's result instead of running it twice; with a
  different request it is rejected.
- ``task``, ``name``: the task and the action type within it (``name`` defaults to the
  command's basename, the service or the endpoint); ``kind:task:name`` is the action's
  signature in the online cost model.
- ``trajectory``, ``turn`` (at most 1,000,000), ``reward``: the trajectory the action
  belongs to, its turn, and whether it is the trajectory's last (reward) action; the
  scheduler sees trajectories as in simulation.
- ``est_s``: the caller's estimate of the run time (one core, or one request alone; at
  most 30 days), used until the cost model has measured the signature.

Per kind:

- cpu: ``argv`` (list of strings, run without a shell), ``env`` (mapping: the
  command's environment, on top of the few variables the dispatcher passes from its own,
  ``sandbox.env_allow``), ``min_cores`` / ``max_cores``, ``parallel_fraction``
  (Amdahl p, what the scheduler assumes about extra cores), ``mem_limit_mb`` (MiB of
  memory the command may add to its sandbox: its processes and the files it writes;
  the dispatcher rejects more than the machine's memory), ``cpu_time_s`` (at most 30
  days), ``pids_max`` (processes and threads at once), ``network`` (may it reach the
  network), and for a trajectory's workspace (its first request decides):
  ``workspace_template`` (a directory or tar archive it starts from) and
  ``workspace_mb`` (its size: the sandbox memory the scheduler accounts for it).
- gpu: ``service`` and ``payload`` (a registered service scores the payload), or
  ``argv`` (+ ``env`` and the command fields above): a command that needs a device (it
  sees only its device through ``CUDA_VISIBLE_DEVICES``) and ``min_cores`` cores (1 by
  default), counted in the CPU pool while it runs.
- api: ``endpoint``, ``tokens``, and ``http`` (``{"url", "method", "headers", "json",
  "body"}``); from Python, ``call`` (an async callable) instead.
"""

from __future__ import annotations

import json
import math
import os
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from metasched.core.actions import KINDS
from metasched.core.cost_model import signature
from metasched.core.validate import Field, json_object, number, required, short, string
from metasched.errors import ConfigError

_COMMON = {"id", "kind", "task", "name", "trajectory", "turn", "reward", "timeout_s", "est_s"}
# What a command (a cpu request, or a gpu request with an argv) may ask of its sandbox.
_SANDBOX = {"pids_max", "network", "workspace_template", "workspace_mb"}
_BY_KIND = {
    "cpu": {"argv", "env", "min_cores", "max_cores", "parallel_fraction", "mem_limit_mb",
            "cpu_time_s", *_SANDBOX},
    "gpu": {"service", "payload", "argv", "env", "min_cores", *_SANDBOX},
    "api": {"endpoint", "tokens", "http"},
}
_ALL = _COMMON.union(*_BY_KIND.values())

# Upper bounds: a value past them is a mistake, not a plan (``mem_limit_mb`` is bounded
# by the machine's memory, where the dispatcher knows it).
MAX_SECONDS = 30 * 24 * 3600.0  # timeout_s, est_s, cpu_time_s: 30 days
MAX_TURN = 1_000_000


@dataclass(frozen=True)
class Request:
    """One action submitted to the dispatcher (see the module docstring)."""

    kind: str
    timeout_s: float
    id: str = ""
    task: str = "default"
    name: str = ""
    trajectory: str | None = None
    turn: int = 0
    reward: bool = False
    est_s: float | None = None
    argv: tuple[str, ...] = ()
    env: Mapping[str, str] | None = None
    min_cores: int = 1
    max_cores: int = 1
    parallel_fraction: float = 0.0
    mem_limit_mb: float | None = None
    cpu_time_s: float | None = None
    pids_max: int | None = None
    network: bool | None = None
    workspace_template: str | None = None
    workspace_mb: float | None = None
    service: str | None = None
    payload: Any = None
    endpoint: str | None = None
    tokens: int = 0
    http: Any = None  # a metasched.runtime.api_calls.HttpSpec
    call: Callable[[], Awaitable[Any]] | None = field(default=None, compare=False)

    @property
    def signature(self) -> str:
        """``kind:task:name``: what the cost model learns durations of."""
        return signature(self.kind, self.task, self.name)

    @property
    def replayable(self) -> bool:
        """Whether the JSON form holds everything needed to run it again (after a
        restart); an API request with a Python callable does not."""
        return self.call is None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``parse_request`` reads it back); defaults are left out."""
        out: dict[str, Any] = {}
        for name, default in _REQUEST_DEFAULTS:
            v = getattr(self, name)
            if v is default or v == default:
                continue
            if name == "http":
                v = {k: getattr(v, k) for k in ("url", "method", "headers", "json", "body")}
                v = {k: dict(x) if k == "headers" else x for k, x in v.items()
                     if x is not None and not (k == "headers" and not x)}
            elif name == "argv":
                v = list(v)
            elif name == "env":
                v = dict(v)
            out[name] = v
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"), allow_nan=False)


_ALWAYS = object()  # equal to nothing: the field is written even at its default
# (name, default) of each field of the JSON form, in order ("call" has none).
_REQUEST_DEFAULTS = tuple(
    (f.name, _ALWAYS if f.name in ("kind", "timeout_s", "id") else f.default)
    for f in fields(Request) if f.name != "call")


def parse_request(value: Any, loc: str = "request", *,
                  call: Callable[[], Awaitable[Any]] | None = None) -> Request:
    """A request from its JSON form (a dict), checked field by field.

    Raises:
        ConfigError: one line naming ``loc`` and the field, e.g.
            ``jobs.jsonl:3: timeout_s: must be > 0 (got -1)``.
    """
    at = Field(loc)
    d = json_object(value, at, _ALL)
    kind = required(d, "kind", at)
    if kind not in KINDS:
        raise ConfigError(str(at["kind"]), f"must be one of {', '.join(KINDS)} (got {short(kind)})")
    for key in d:
        if key not in _COMMON and key not in _BY_KIND[kind]:
            owner = next(k for k, keys in _BY_KIND.items() if key in keys)
            raise ConfigError(str(at[key]), f"only {owner} requests have it (this is {kind})")
    rid = d.get("id")
    rid = uuid.uuid4().hex if rid is None else string(rid, at["id"])
    timeout_s = _seconds(required(d, "timeout_s", at), at["timeout_s"])
    # Absent optional fields take their defaults unchecked (one dict lookup each: this
    # runs for every request a dispatcher accepts).
    task = string(d["task"], at["task"]) if "task" in d else "default"
    trajectory = d.get("trajectory")
    if trajectory is not None:
        if isinstance(trajectory, int) and not isinstance(trajectory, bool):
            trajectory = str(trajectory)
        trajectory = string(trajectory, at["trajectory"])
    turn = 0
    if "turn" in d:
        turn = number(d["turn"], at["turn"], lo=0, integer=True)
        if turn > MAX_TURN:
            raise ConfigError(str(at["turn"]), f"must be <= {MAX_TURN} (got {short(d['turn'])})")
    reward = d.get("reward", False)
    if not isinstance(reward, bool):
        raise ConfigError(str(at["reward"]), f"must be true or false (got {short(reward)})")
    est_s = d.get("est_s")
    if est_s is not None:
        est_s = _seconds(est_s, at["est_s"])
    kw: dict[str, Any] = {}
    if "argv" in d or kind == "cpu":
        kw["argv"] = _argv(required(d, "argv", at), at["argv"])
        if d.get("env") is not None:
            kw["env"] = _env(d["env"], at["env"])
        _sandbox_fields(d, at, kw, trajectory)
    else:
        for key in _SANDBOX:
            if key in d:
                raise ConfigError(str(at[key]), "only commands (requests with an argv) "
                                  "have it")
    if kind == "cpu":
        if "min_cores" in d:
            kw["min_cores"] = number(d["min_cores"], at["min_cores"], lo=1, integer=True)
        if "max_cores" in d:
            kw["max_cores"] = number(d["max_cores"], at["max_cores"],
                                     lo=kw.get("min_cores", 1), integer=True)
        else:
            kw["max_cores"] = kw.get("min_cores", 1)
        if "parallel_fraction" in d:
            kw["parallel_fraction"] = number(d["parallel_fraction"], at["parallel_fraction"],
                                             lo=0.0, hi=1.0)
        if d.get("mem_limit_mb") is not None:
            kw["mem_limit_mb"] = number(d["mem_limit_mb"], at["mem_limit_mb"], lo=0.0,
                                        lo_open=True)
        if d.get("cpu_time_s") is not None:
            kw["cpu_time_s"] = _seconds(d["cpu_time_s"], at["cpu_time_s"])
        default_name = os.path.basename(kw["argv"][0])
    elif kind == "gpu":
        if ("service" in d) == ("argv" in d):
            raise ConfigError(str(at["service"]), "give either a service (with its payload) "
                              "or an argv (a command that needs a device), not both")
        if "service" in d:
            if "min_cores" in d:
                raise ConfigError(str(at["min_cores"]), "only commands (requests with an "
                                  "argv) have it")
            kw["service"] = string(d["service"], at["service"])
            kw["payload"] = d.get("payload")
            default_name = kw["service"]
        else:
            if "min_cores" in d:  # cores the command runs on, beside its device
                kw["min_cores"] = kw["max_cores"] = number(d["min_cores"], at["min_cores"],
                                                           lo=1, integer=True)
            default_name = os.path.basename(kw["argv"][0])
    else:
        kw["endpoint"] = string(required(d, "endpoint", at), at["endpoint"])
        if "tokens" in d:
            kw["tokens"] = number(d["tokens"], at["tokens"], lo=0, integer=True)
        if ("http" in d) == (call is not None):
            raise ConfigError(str(at["http"]), "an api request needs an http spec "
                              "(or, from Python, call=...), and not both")
        if "http" in d:
            from metasched.runtime.api_calls import HttpSpec

            if not isinstance(d["http"], Mapping):
                raise ConfigError(str(at["http"]),
                                  f"must be a JSON object (got {short(d['http'])})")
            try:
                kw["http"] = HttpSpec.from_dict(d["http"])
            except ValueError as e:
                raise ConfigError(loc, str(e)) from None
        kw["call"] = call
        default_name = kw["endpoint"]
    name = string(d["name"], at["name"]) if "name" in d else default_name
    return Request(kind=kind, timeout_s=timeout_s, id=rid, task=task, name=name,
                   trajectory=trajectory, turn=turn, reward=reward, est_s=est_s, **kw)


def _sandbox_fields(d: Mapping[str, Any], at: Field, kw: dict[str, Any],
                    trajectory: str | None) -> None:
    """The fields a command asks of its sandbox (into ``kw``)."""
    if d.get("pids_max") is not None:
        kw["pids_max"] = number(d["pids_max"], at["pids_max"], lo=1, hi=4_194_304,
                                integer=True)
    if d.get("network") is not None:
        if not isinstance(d["network"], bool):
            raise ConfigError(str(at["network"]), f"must be true or false (got "
                              f"{short(d['network'])})")
        kw["network"] = d["network"]
    for key in ("workspace_template", "workspace_mb"):
        if d.get(key) is None:
            continue
        if trajectory is None:
            raise ConfigError(str(at[key]), "only a trajectory has a workspace to set up "
                              "(a request without one gets a fresh, empty one)")
        if key == "workspace_mb":
            kw[key] = number(d[key], at[key], lo=1.0, hi=2.0**40)
        else:
            kw[key] = string(d[key], at[key])
            if "\0" in kw[key]:
                raise ConfigError(str(at[key]), "must not contain NUL characters")


def _seconds(value: Any, at: Field) -> float:
    """A duration: > 0 and at most :data:`MAX_SECONDS`."""
    v = number(value, at, lo=0.0, lo_open=True)
    if v > MAX_SECONDS:
        raise ConfigError(str(at), f"must be <= {MAX_SECONDS:.0f} (30 days; got {short(value)})")
    return v


def _argv(value: Any, at: Field) -> tuple[str, ...]:
    if (not isinstance(value, (list, tuple)) or not value
            or not all(isinstance(x, str) for x in value)):
        raise ConfigError(str(at), f"must be a non-empty list of strings (got {short(value)})")
    if not value[0]:
        raise ConfigError(str(at), "the program (first element) must not be empty")
    if any("\0" in x for x in value):
        raise ConfigError(str(at), "must not contain NUL characters")
    return tuple(value)


def _env(value: Any, at: Field) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise ConfigError(str(at), f"must be a JSON object of strings (got {short(value)})")
    for k, v in value.items():
        if not isinstance(k, str) or not k or "=" in k or "\0" in k:
            raise ConfigError(str(at), f"bad variable name {short(k)}")
        if not isinstance(v, str) or "\0" in v:
            raise ConfigError(str(at[k]), f"must be a string (got {short(v)})")
    return dict(value)


# Result statuses: done, failed (ran and failed, or could not run), rejected (bad input:
# never accepted, never journaled).
DONE, FAILED, REJECTED = "done", "failed", "rejected"


@dataclass
class Result:
    """How a request ended.

    Attributes:
        id: the request's idempotency key.
        status: ``"done"``, ``"failed"`` or ``"rejected"`` (bad input; never run).
        reason: why it failed or was rejected (one line); empty when done.
        exit_code: a command's exit status (negative: the signal that killed it).
        value: a gpu service's result or an api call's response.
        stdout, stderr: the tail of what a command wrote.
        queued_at, started_at, finished_at: wall-clock times (Unix seconds); started_at
            is None when it never started.
        allocation: what it was granted (``cores`` ids, ``device``, ``batch`` size ...).
        attempts: runs (a request re-queued after a restart may run again) or api calls.
    """

    id: str
    status: str
    reason: str = ""
    exit_code: int | None = None
    value: Any = None
    stdout: str = ""
    stderr: str = ""
    queued_at: float | None = None
    started_at: float | None = None
    finished_at: float | None = None
    allocation: dict[str, Any] = field(default_factory=dict)
    attempts: int = 0

    @property
    def ok(self) -> bool:
        return self.status == DONE

    @property
    def act_s(self) -> float:
        """Action completion time: finished - queued (nan if unknown)."""
        if self.queued_at is None or self.finished_at is None:
            return math.nan
        return self.finished_at - self.queued_at

    def to_dict(self) -> dict[str, Any]:
        # Shallow (asdict deep-copies every value: measurable at thousands of results/s).
        return {f: getattr(self, f) for f in _RESULT_FIELDS}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"), default=repr)

    @classmethod
    def from_json(cls, text: str) -> Result:
        return cls(**json.loads(text))


_RESULT_FIELDS = tuple(f.name for f in fields(Result))

__all__ = ["DONE", "FAILED", "MAX_SECONDS", "MAX_TURN", "REJECTED", "Request", "Result",
           "parse_request"]
