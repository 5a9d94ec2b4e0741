"""How a dispatcher runs (:class:`DispatcherConfig`): the schema of its settings."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, InstanceOf, PlainValidator

from metasched.core.pools import EndpointSpec
from metasched.core.schema import Checked, Count, Flag, Number, Text
from metasched.errors import ConfigError, short
from metasched.runtime.api_calls import RetryPolicy
from metasched.runtime.dispatch.deadline_config import DeadlineConfig
from metasched.runtime.limits import RequestLimits
from metasched.runtime.sandbox.config import SandboxConfig

__all__ = ["DispatcherConfig"]


def _file_path(value: Any) -> str | Path | None:
    if value is None or isinstance(value, Path) or isinstance(value, str) and value:
        return value
    raise ConfigError("", f"must be a file path or null (got {short(value)})")


FilePath = Annotated[str | Path | None, PlainValidator(_file_path)]
"""A file's path (text or a Path), or None."""


class DispatcherConfig(Checked):
    """How a dispatcher runs: a pydantic schema, checked where it is built (from Python
    or from the apps' settings); a bad value is one line naming the setting.

    Attributes:
        scheduler: a checkpoint directory (the shipped ``checkpoints/default``) or a
            heuristic's name from ``metasched.agents.BASELINES``.
        scheduler_params: keyword arguments for a heuristic.
        cores: CPU ids actions may use (default: all this process may run on).
        mem_gb: memory of the node (default: the machine's).
        gpu_standin: CPU stand-in GPU devices (tests only; real GPUs come from NVML).
        gpu_standin_mem_gb: memory of each stand-in.
        endpoints: API endpoint quotas by name.
        journal: SQLite journal path (None: no durability, for tests and experiments).
        fsync: make the journal durable against power loss too (slower).
        journal_delay_s: how long starts and results may wait to be journaled with
            others (one commit for many); accepted requests are journaled at the end of
            the loop turn that accepted them, before they are queued.
        journal_env: also store requests' ``env`` values in the journal (default: only
            their names, and a digest of the request). A request recovered after a
            restart whose env was not stored waits for its resubmission (same id, same
            request), which brings the values back, instead of running without them.
        max_wait_s: the core's starvation guard (None: off).
        cost_alpha, default_est_s: the online cost model (see ``CostModel``).
        estimates: what the scheduler sees as an action's estimate: ``"online"`` (the
            cost model's, learned from measured durations; the request's ``est_s`` only
            until its signature has run) or ``"given"`` (the request's ``est_s`` when it
            has one, as a profile's or a trace's per-action estimates in simulation).
        retry: API retry policy (429 / 5xx / connection errors).
        sandbox: how commands are confined: isolation (namespaces, unprivileged users,
            workspaces), cgroups, environment, the workspace templates requests may name
            (see :class:`SandboxConfig`).
        limits: what a request gets when it does not say (memory, wall time) and the
            most it may ask (see :class:`~metasched.runtime.limits.RequestLimits`).
        workdir: where the dispatcher's run directory goes (None: the tmpfs
            ``/dev/shm`` when writable, else the system temporary directory): it records
            what this dispatcher made, for the next one to remove after a crash, and
            holds the scratch directories of commands run without isolation (a directory
            costs ~10 µs to make and remove on tmpfs, ~100-800 µs on a disk; files
            written there use memory). A directory that is missing or not writable is a
            ConfigError at construction.
        tail_bytes: how much of a command's stdout / stderr results keep.
        sample_interval_s: how often psutil / NVML are sampled.
        metrics_window: per-action measurements kept for the results (ACT percentiles):
            the most recent this many (about 45 bytes each); counts, utilisation and
            failure reasons always cover every action. None: keep all (memory grows
            with every action).
        trajectory_idle_s: a trajectory with nothing queued or running for this long is
            closed (its held cores return), in case its reward action never comes.
        task_demand: expected work per pool and task, in estimate-seconds, in the form
            of ``WorkloadInstance.demand_by_task()``: what the partitioning baselines
            (``static``, ``task_isolated``) size their partitions by; the simulator
            takes it from the workload. Empty (default): unknown.
        trace: a JSONL file to append every finished action to, with what was measured
            (``metasched.core.trace_writer``; ``metasched-calibrate`` fits a workload
            profile to it). None: no trace.
        ahead_per_core: handing ahead on a backend's nodes: each node may hold up to this
            many cpu commands per core ahead of its free cores, in a queue there that
            starts the next the moment a command exits, with no round trip to the
            dispatcher (see ``ClusterState.hand_ahead``). None: the backend's default
            (``RayBackend.AHEAD_PER_CORE``). The local backend starts every command on
            its core from this process, so it has no such queue: 0 only.
        deadlines: when callers give up (a default deadline), what happens to a
            command still queued then (time-shared on busy cores, or refused), and the
            lending of idle commands' cores (see :class:`DeadlineConfig`).
        predictor: a recorded trace (an action log, as ``trace`` writes, or a
            simulated recording; not the one ``trace`` records to) to fit the
            remaining-work predictor on at construction
            (``metasched.core.predictor``, design ``boost``): schedulers see it as
            ``state.predictor`` (``estimates: predictor``), and the dispatcher updates
            it online with measured runs, generation gaps and trajectory ends (a
            trajectory's siblings: those whose requests name its ``prompt``). None: no
            predictor (or the one given to the dispatcher, fitted: its ``predictor``
            keyword).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    scheduler: Text = "checkpoints/default"
    scheduler_params: dict[str, Any] = {}
    cores: Annotated[list[Count(0)], Field(min_length=1)] | None = None
    mem_gb: Number(gt=0.0) | None = None
    gpu_standin: Count(0) = 0
    gpu_standin_mem_gb: Number(gt=0.0) = 16.0
    endpoints: dict[str, InstanceOf[EndpointSpec]] = {}
    journal: FilePath = None
    fsync: Flag = False
    journal_delay_s: Number(ge=0.0) = 0.005
    journal_env: Flag = False
    max_wait_s: Number(gt=0.0) | None = 300.0
    cost_alpha: Number(gt=0.0, le=1.0) = 0.3
    default_est_s: Number(gt=0.0) = 1.0
    estimates: Literal["online", "given"] = "online"
    retry: InstanceOf[RetryPolicy] = Field(default_factory=RetryPolicy)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    limits: RequestLimits = Field(default_factory=RequestLimits)
    workdir: Text | None = None
    tail_bytes: Count(0) = 4096
    sample_interval_s: Number(gt=0.0) = 1.0
    metrics_window: Count(1) | None = 100_000
    trajectory_idle_s: Number(gt=0.0) = 3600.0
    task_demand: dict[str, dict[str, float]] = {}
    trace: FilePath = None
    ahead_per_core: Count(0) | None = None
    deadlines: DeadlineConfig = Field(default_factory=DeadlineConfig)
    predictor: FilePath = None

    one_line_root = 'dispatcher'

    def replace(self, **changes: Any) -> DispatcherConfig:
        """A copy with ``changes``, checked as a new one is."""
        return DispatcherConfig(**{**dict(self), **changes})
