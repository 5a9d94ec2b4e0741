"""What rollout workers submit to the dispatcher (``Request``, a pydantic model) and
what they get back (``Result``).

``Request`` is the one schema of an action request: the Python API
(``Dispatcher.submit``), job files (``metasched-dispatch``), ``POST /v1/actions``, the
journal and the steps of ``/run_code`` all validate with it, and a failed check is one
line naming the field (:func:`metasched.errors.validation_error`), e.g.
``jobs.jsonl:3: timeout_s: must be > 0 (got -1)``. Numbers, strings and booleans are
strict: ``"2"`` is not 2 and ``1`` is not ``true`` (a whole float, ``2.0``, is a whole
number); ``null`` stands for "not given" in the fields whose default is none.

A request is one action. Fields every kind has:

- ``kind``: ``"cpu"``, ``"gpu"`` or ``"api"``; ``timeout_s`` (> 0, at most 30 days): the
  action is killed (cpu), reported failed (gpu) or abandoned (api) this long after it
  starts; when not given, the dispatcher's default (``limits.timeout_s``, see
  :mod:`metasched.runtime.limits`, which also caps what a request may ask).
- ``id``, ``task``, ``name``, ``trajectory``, ``prompt``: each at most 256 characters.
- ``id``: idempotency key (default: a fresh one). Submitting a key again with the same
  request returns the first submission's result instead of running it twice; with a
  different request it is rejected.
- ``task``, ``name``: the task and the action type within it (``name`` defaults to the
  command's basename, the service or the endpoint); ``kind:task:name`` is the action's
  signature in the online cost model.
- ``trajectory``, ``turn`` (at most 1,000,000), ``reward``: the trajectory the action
  belongs to, its turn, and whether it is the trajectory's last (reward) action; the
  scheduler sees trajectories as in simulation.
- ``prompt``: the prompt the trajectory answers (text, as ``trajectory``; a number is its
  decimal text); GRPO's n responses to one prompt share it, and the remaining-work
  predictor reads the trajectory's siblings through it. Only a request with a
  ``trajectory`` may give it; the trajectory's first request decides it (as its task).
- ``est_s``: the caller's estimate of the run time (one core, or one request alone; at
  most 30 days), used until the cost model has measured the signature.
- ``deadline_s``: seconds from acceptance after which the caller stops waiting (when
  not given: the dispatcher's ``deadlines.default_s``, if any). A cpu command still
  queued when only its ``timeout_s`` is left before then starts time-shared on busy
  cores, or is refused (``deadlines.on_deadline``): see :mod:`metasched.core.deadlines`.
- ``on_restart``: what a dispatcher restarted on the journal does with the request if
  the previous one died before its end: ``"run"`` (the default: queued again, for a
  caller that can come back for its result, as a native client can, with a deadline:
  ``deadlines.recovered_s``) or ``"cancel"`` (finished ``cancelled``, reason
  ``restart: ...``: its caller waited on a connection that died with the dispatcher, as
  ``/run_code``'s, ``/run_jupyter``'s, E2B's and the quota proxy's do; such front doors
  set it).

Per kind:

- cpu: ``argv`` (list of strings, run without a shell), ``env`` (mapping: the
  command's environment, on top of the few variables the dispatcher passes from its own,
  ``sandbox.env_allow``), ``min_cores`` / ``max_cores``, ``parallel_fraction``
  (Amdahl p, what the scheduler assumes about extra cores), ``mem_limit_mb`` (MiB of
  memory the command may add to its sandbox: its processes and the files it writes;
  the dispatcher rejects more than the machine's memory; when not given, the
  dispatcher's default ``limits.mem_mb``), ``cpu_time_s`` (at most 30 days),
  ``pids_max`` (processes and threads at once), ``network`` (may it reach the
  network), and for a trajectory's workspace (its first request decides):
  ``workspace_template`` (the name of a template the operator configured,
  ``sandbox.templates``: a directory or tar archive it starts from; never a host path)
  and ``workspace_mb`` (its size: the sandbox memory the scheduler accounts for it).

No field names a host resource: paths, devices, cgroups, user ids and cores are the
dispatcher's to choose; a request names only what the operator configured (a template,
a service, an endpoint) and asks for amounts, within ``limits``.
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
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema

from metasched.core.actions import KINDS
from metasched.core.cost_model import signature
from metasched.core.schema import MAX_KEY, Checked, Count, Demand, Flag, Key, Text
from metasched.errors import ConfigError, short, validation_error
from metasched.runtime.api_calls import HttpSpec

# Which fields each kind has (besides the common ones), for the messages that say so.
_COMMON = {"id", "kind", "task", "name", "trajectory", "prompt", "turn", "reward", "timeout_s",
           "est_s", "deadline_s", "on_restart"}
# What a command (a cpu request, or a gpu request with an argv) may ask of its sandbox.
_SANDBOX = ("pids_max", "network", "workspace_template", "workspace_mb")
_BY_KIND = {
    "cpu": {"argv", "env", "min_cores", "max_cores", "parallel_fraction", "mem_limit_mb",
            "cpu_time_s", *_SANDBOX},
    "gpu": {"service", "payload", "argv", "env", "min_cores", *_SANDBOX},
    "api": {"endpoint", "tokens", "http", "call"},
}

# Upper bounds: a value past them is a mistake, not a plan (``mem_limit_mb`` is bounded
# by the machine's memory, where the dispatcher knows it).
MAX_SECONDS = 30 * 24 * 3600.0  # timeout_s, est_s, cpu_time_s: 30 days
MAX_TURN = 1_000_000


# ---------------------------------------------------------------- field types
# Shared with the HTTP routes' models (``/run_code``'s timeouts and trajectory fields).


def _no_nul(value: str) -> str:
    if "\0" in value:
        raise ValueError("must not contain NUL characters")
    return value


def _env_name(name: str) -> str:
    if not name or "=" in name or "\0" in name:
        raise ValueError("bad variable name (non-empty, without '=' or NUL)")
    return name


def _trajectory(value: Any) -> Any:
    """A trajectory id given as a number is its decimal text."""
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


def _at_most_30_days(value: float) -> float:
    if value > MAX_SECONDS:
        raise ConfigError("", f"must be <= {MAX_SECONDS:.0f} (30 days; got {short(value)})")
    return value


Seconds = Annotated[float, Field(strict=True, gt=0, allow_inf_nan=False),
                    AfterValidator(_at_most_30_days)]
"""A duration: > 0 and at most 30 days."""
Turn = Count(0, MAX_TURN)
TrajectoryId = Annotated[Key | None, BeforeValidator(_trajectory)]
_Arg = Annotated[str, Field(strict=True), AfterValidator(_no_nul)]
_Env = dict[Annotated[str, Field(strict=True), AfterValidator(_env_name)],
            Annotated[str, Field(strict=True), AfterValidator(_no_nul)]]


# A prompt groups trajectories: one given without its trajectory would make a request
# alone a sibling of its group.
PROMPT_NEEDS_TRAJECTORY = "only a trajectory answers a prompt (give its trajectory too)"


def _positive(hi: float = math.inf, lo: float = 0.0, open_lo: bool = True) -> Any:
    bound = {"gt": lo} if open_lo else {"ge": lo}
    return Annotated[float, Field(strict=True, allow_inf_nan=False,
                                  le=None if hi == math.inf else hi, **bound)]


class Request(Checked, Demand):
    """One action submitted to the dispatcher (see the module docstring).

    Built from its JSON form by :func:`parse_request` (job files, ``POST /v1/actions``,
    the journal, dicts given to ``Dispatcher.submit``), or directly (``Request(kind=
    "cpu", argv=[...], timeout_s=5)``: the same checks, the same one-line
    :class:`~metasched.errors.ConfigError` if one fails). Its resource fields are the
    shared :class:`~metasched.core.schema.Demand`'s.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal[KINDS]  # type: ignore[valid-type]  # the core's kinds: cpu, gpu, api
    timeout_s: Seconds | None = None  # the dispatcher's default (limits.timeout_s)
    id: Key = ""  # a fresh key when not given (the validator makes it)
    task: Key = "default"
    name: Key = ""  # the command's basename, the service or the endpoint when not given
    trajectory: TrajectoryId = None
    prompt: TrajectoryId = None  # GRPO's responses to one prompt share it
    turn: Turn = 0
    reward: Flag = False
    est_s: Seconds | None = None
    deadline_s: Seconds | None = None  # the dispatcher's deadlines.default_s
    on_restart: Literal["run", "cancel"] = "run"  # if the dispatcher died before its end
    argv: Annotated[tuple[_Arg, ...], Field(min_length=1)] = ()
    env: _Env | None = None
    mem_limit_mb: _positive() | None = None
    cpu_time_s: Seconds | None = None
    pids_max: Count(1, 4_194_304) | None = None
    network: Flag | None = None
    workspace_template: Annotated[Text, AfterValidator(_no_nul)] | None = None  # a name
    workspace_mb: _positive(2.0**40, 1.0, open_lo=False) | None = None
    payload: Any = None
    tokens: Count(0) = 0
    http: HttpSpec | None = None
    # From Python only: not in the JSON form, nor in its schema.
    call: SkipJsonSchema[Callable[[], Awaitable[Any]] | None] = Field(None, exclude=True)

    @model_validator(mode="before")
    @classmethod
    def _per_kind(cls, data: Any, info: ValidationInfo) -> Any:
        """The rules across fields that the kind decides, and the defaults that follow
        from other fields (``name``, ``max_cores``, ``id``)."""
        if not isinstance(data, Mapping) or not isinstance(data.get("kind"), str) \
                or data["kind"] not in _BY_KIND:
            return data  # the type's or the kind's own error follows
        kind = data["kind"]
        d = dict(data)
        if info.context is not None:  # parsed from JSON: a callable comes beside it
            if "call" in d:
                raise ConfigError("call", "unknown field (a Python callable is given "
                                  "as call=..., not in the request)")
            if kind == "api" and info.context.get("call") is not None:
                d["call"] = info.context["call"]
        for key in d:
            if key not in _COMMON and key not in _BY_KIND[kind] and key in cls.model_fields:
                owner = next(k for k, keys in _BY_KIND.items() if key in keys)
                raise ConfigError(key, f"only {owner} requests have it (this is {kind})")
        if d.get("id") is None:
            d["id"] = uuid.uuid4().hex
        argv = d.get("argv")
        if kind == "cpu" and "argv" not in d:
            raise ConfigError("argv", "is required")
        if "argv" not in d:
            for key in _SANDBOX:
                if key in d:
                    raise ConfigError(key, "only commands (requests with an argv) have it")
        elif d.get("trajectory") is None:
            for key in ("workspace_template", "workspace_mb"):
                if d.get(key) is not None:
                    raise ConfigError(key, "only a trajectory has a workspace to set up "
                                      "(a request without one gets a fresh, empty one)")
        if d.get("prompt") is not None and d.get("trajectory") is None:
            raise ConfigError("prompt", PROMPT_NEEDS_TRAJECTORY)
        for key in ("timeout_s", "deadline_s", "env", "mem_limit_mb", "cpu_time_s",
                    "pids_max", "network", "workspace_template", "workspace_mb"):
            if key in d and d[key] is None:
                del d[key]  # null: the default
        default_name = None
        if kind == "cpu":
            d.setdefault("max_cores", d.get("min_cores", 1))
        elif kind == "gpu":
            if ("service" in d) == ("argv" in d):
                raise ConfigError("service", "give either a service (with its payload) "
                                  "or an argv (a command that needs a device), not both")
            if "service" in d:
                if "min_cores" in d:
                    raise ConfigError("min_cores", "only commands (requests with an argv) "
                                      "have it")
                default_name = d["service"]
            else:  # cores the command runs on, beside its device
                d["max_cores"] = d.get("min_cores", 1)
        else:
            if d.get("http") is None:
                d.pop("http", None)
            if "endpoint" not in d:
                raise ConfigError("endpoint", "is required")
            if ("http" in d) == (d.get("call") is not None):
                raise ConfigError("http", "an api request needs an http spec (or, from "
                                  "Python, call=...), and not both")
            default_name = d["endpoint"]
        if isinstance(argv, (list, tuple)) and argv and isinstance(argv[0], str):
            default_name = os.path.basename(argv[0])
        if "name" not in d and isinstance(default_name, str) and default_name:
            d["name"] = default_name[:MAX_KEY]  # a name not given is never the error
        return d

    @model_validator(mode="after")
    def _consistent(self) -> Request:
        if self.argv and not self.argv[0]:
            raise ConfigError("argv[0]", "the program must not be empty")
        if self.kind == "gpu" and (self.service is None) == (not self.argv):
            raise ConfigError("service", "give either a service (with its payload) or an "
                              "argv (a command that needs a device), not both")
        if self.kind == "api" and self.endpoint is None:
            raise ConfigError("endpoint", "must not be empty (got None)")
        return self

    def __eq__(self, other: object) -> bool:
        # The same request whatever callable it carries (a resubmission from Python
        # brings a new closure).
        if not isinstance(other, Request):
            return NotImplemented
        a, b = dict(self.__dict__), dict(other.__dict__)
        a.pop("call"), b.pop("call")
        return a == b

    __hash__ = None  # type: ignore[assignment]  # env and payload are mutable

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
        out = self.model_dump(exclude_defaults=True, by_alias=True)
        if "argv" in out:
            out["argv"] = list(out["argv"])
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"), allow_nan=False)


def parse_request(value: Any, loc: str = "request", *,
                  call: Callable[[], Awaitable[Any]] | None = None) -> Request:
    """A request from its JSON form (a dict), checked field by field.

    Args:
        value: the JSON form.
        loc: where it came from, for the message (``jobs.jsonl:3``).
        call: an api request's async callable (from Python; it has no JSON form).

    Raises:
        ConfigError: one line naming ``loc`` and the field, e.g.
            ``jobs.jsonl:3: timeout_s: must be > 0 (got -1)``.
    """
    try:
        return Request.model_validate(value, context={"call": call})
    except ValidationError as e:
        raise validation_error(e.errors(), loc, model=Request) from None


# Result statuses: done, failed (ran and failed, or could not run), rejected (bad input:
# never accepted, never journaled), cancelled (dropped from the queue, or killed while it
# ran, at its caller's word: see ``metasched.runtime.dispatch.cancellation``).
DONE, FAILED, REJECTED, CANCELLED = "done", "failed", "rejected", "cancelled"


@dataclass
class Result:
    """How a request ended.

    Attributes:
        id: the request's idempotency key.
        status: ``"done"``, ``"failed"``, ``"rejected"`` (bad input; never run) or
            ``"cancelled"`` (its caller cancelled it: dropped while queued, or killed).
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

__all__ = ["CANCELLED", "DONE", "FAILED", "MAX_SECONDS", "MAX_TURN", "PROMPT_NEEDS_TRAJECTORY",
           "REJECTED", "Request", "Result", "parse_request"]
