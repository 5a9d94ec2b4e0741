"""Domain objects: action specs, actions, trajectories, grants.

Names follow ARCHITECTURE §3. Schedulers see only *estimates*: an action's true
duration lives in ``ActionSpec.true_s`` and must never be read by a scheduler; the
simulator uses it to decide when the action finishes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from metasched.core.schema import DEMAND_FIELDS, Demand

KINDS = ("cpu", "gpu", "api")

# Action status values. AHEAD: a cpu action handed to its node ahead of free cores (in the
# node's queue there: neither queued in the dispatcher nor running on a core).
PENDING, RUNNING, DONE, FAILED = "pending", "running", "done", "failed"
AHEAD = "ahead"


class Immutable:
    """A frozen value: copies (``copy.copy``, ``copy.deepcopy``) share it. A simulator is
    forked by ``copy.deepcopy`` (look-ahead); its specs need not be copied with it."""

    __slots__ = ()

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


@dataclass(frozen=True, slots=True)
class ActionSpec(Immutable):
    """What an action is, independent of when it runs.

    Its resource fields (``min_cores`` to ``endpoint``) are the values of a
    :class:`~metasched.core.schema.Demand` (``spec.demand``): the action type it was
    drawn from, or the request it stands for. They are slots of the spec itself, not a
    nested model, because schedulers read them at every decision.

    Attributes:
        kind: ``"cpu"``, ``"gpu"`` or ``"api"``.
        name: the action type within its task (``"shell"``, ``"test_run"`` ...).
        true_s: true base duration in seconds: on one core (cpu), for a batch of one
            on a resident service (gpu), or the call latency (api). Hidden from schedulers.
        est_s: the scheduler-visible estimate of ``true_s``.
        timeout_s: the action is killed and recorded failed this long after it starts.
        min_cores, max_cores: cpu core range the action can use.
        parallel_fraction: Amdahl parallel fraction p; speedup(k) = 1 / ((1-p) + p/k).
        service: gpu service (reward model) name.
        endpoint: api endpoint name.
        tokens: api tokens the call consumes (for TPM limits).
        reward: whether this is the trajectory's final reward action.
        start_by_s: seconds after submission by which the action must have started for
            its caller to get its answer (the caller's deadline less the time the action
            may run: see :mod:`metasched.core.deadlines`); None: no deadline.
    """

    kind: str
    name: str
    true_s: float
    est_s: float
    timeout_s: float
    min_cores: int = 1
    max_cores: int = 1
    parallel_fraction: float = 0.0
    service: str | None = None
    endpoint: str | None = None
    tokens: int = 0
    reward: bool = False
    start_by_s: float | None = None

    @property
    def demand(self) -> Demand:
        """Its resource demand, as the shared model."""
        return Demand.model_construct(**{f: getattr(self, f) for f in DEMAND_FIELDS})

    def speedup(self, cores: int) -> float:
        """Amdahl speedup on ``cores`` cores relative to one core."""
        p = self.parallel_fraction
        return 1.0 / ((1.0 - p) + p / cores)

    def est_run_s(self, cores: int = 1) -> float:
        """Estimated run time on ``cores`` cores (cpu) or alone (gpu, api)."""
        if self.kind == "cpu":
            return self.est_s / self.speedup(cores)
        return self.est_s


def amdahl_run_s(base_s: float, parallel_fraction: float, cores: int) -> float:
    """Run time of ``base_s`` seconds of one-core work on ``cores`` cores (Amdahl)."""
    return base_s * ((1.0 - parallel_fraction) + parallel_fraction / cores)


@dataclass(frozen=True, slots=True)
class SandboxSpec(Immutable):
    """A per-trajectory sandbox: memory held on one node for the trajectory's life."""

    mem_gb: float
    startup_s: float


@dataclass(frozen=True, slots=True)
class Turn(Immutable):
    """One turn of a trajectory: LLM generation for ``gen_s`` seconds, then ``action``.

    ``together``: the next turn's action is submitted with this one, without waiting for
    it (calls made together, e.g. a test run's programs); the trajectory goes on once
    every action submitted together has finished. ``chained`` (on a turn after a
    ``together`` one): this action is submitted when the one before it finishes, not
    with the group (a chain inside the group, e.g. a program's run after its own write,
    while the other programs' chains go on). ``same_turn``: the action belongs to the
    agent turn of the turn before it (a later step of one request, an action submitted
    with it), so the trajectory's count of turns, which schedulers read, does not advance
    (as the dispatcher counts a request's turn number)."""

    gen_s: float
    action: ActionSpec
    together: bool = False
    chained: bool = False
    same_turn: bool = False


class Trajectory:
    """A sequence of turns; its last action is the reward action.

    The scheduler may read ``task``, ``step``, ``turn`` (turns submitted so far),
    ``start_t``, ``node``, ``held_cores`` and ``prompt`` (the prompt it answers, shared
    with its siblings in a GRPO group; None where unknown); the number of turns left is
    unknown to it (``n_turns`` is for the simulator and accounting).
    """

    __slots__ = (
        "id", "task", "step", "turns", "sandbox", "node", "start_t", "end_t",
        "turn", "held_cores", "act_s", "prompt",
    )

    def __init__(self, id: int, task: str, step: int, turns: list[Turn],
                 sandbox: SandboxSpec | None, prompt: str | None = None) -> None:
        self.id = id
        self.prompt = prompt
        self.task = task
        self.step = step
        self.turns = turns
        self.sandbox = sandbox
        self.node: int = -1  # sandbox node; -1 until placed (or no sandbox)
        self.start_t = math.nan
        self.end_t = math.nan
        self.turn = 0  # agent turns submitted so far
        self.held_cores = 0  # cores reserved for the trajectory (trajectory-bound practice)
        self.act_s = 0.0  # sum of ACT of its finished actions (critical-path feature)

    @property
    def n_turns(self) -> int:
        return len(self.turns)


class Action:
    """One schedulable unit, submitted at ``submit_t``.

    Schedulers read ``spec`` (except ``spec.true_s``), ``task``, ``traj``,
    ``turn``, ``submit_t`` and ``node`` (the node it must run on, -1 = any).
    ``shared``: a running cpu action started on cores already busy (time-shared, see
    :mod:`metasched.core.deadlines`): it holds no cores of the pool.
    """

    __slots__ = (
        "id", "spec", "task", "traj", "turn", "submit_t", "start_t", "end_t",
        "status", "cores", "node", "device", "reason", "lower_bound_s", "shared",
    )

    def __init__(self, id: int, spec: ActionSpec, task: str, traj: Trajectory | None,
                 turn: int, submit_t: float) -> None:
        self.id = id
        self.spec = spec
        self.task = task
        self.traj = traj
        self.turn = turn
        self.submit_t = submit_t
        self.start_t = math.nan
        self.end_t = math.nan
        self.status = PENDING
        self.cores = 0
        self.node = traj.node if traj is not None else -1
        self.device = -1
        self.reason = ""
        self.lower_bound_s = math.nan
        self.shared = False

    @property
    def kind(self) -> str:
        return self.spec.kind

    def __repr__(self) -> str:
        return (f"Action(id={self.id}, {self.spec.kind}:{self.task}/{self.spec.name}, "
                f"status={self.status}, submit_t={self.submit_t:.3f})")


class InvalidGrant(ValueError):
    """A scheduler asked for an allocation the state cannot give."""


@dataclass(slots=True)
class Grant:
    """A scheduling decision: run ``action`` now with this allocation.

    Attributes:
        action: a pending action.
        cores: cpu cores to grant (``min_cores <= cores <= max_cores``).
        node: cpu node for actions without a sandbox (``action.node == -1``).
        device: gpu device to run the batch on.
        batch: further pending requests to the same gpu service to run in the same batch.
        hold: cpu only: cores to reserve for the action's trajectory (at least
            ``cores``); they stay reserved after the action ends and return to the pool when
            the trajectory ends (trajectory-bound practice). 0: no reservation.
    """

    action: Action
    cores: int = 1
    node: int = -1
    device: int = -1
    batch: tuple[Action, ...] = ()
    hold: int = 0
