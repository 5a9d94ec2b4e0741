"""How a dispatcher runs: :class:`DispatcherConfig` (its settings, with their defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from metasched.core.pools import EndpointSpec
from metasched.runtime.api_calls import RetryPolicy
from metasched.runtime.limits import RequestLimits
from metasched.runtime.sandbox.config import SandboxConfig


@dataclass
class DispatcherConfig:
    """How a dispatcher runs.

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
            until its signature has run) or ``"request"`` (the request's ``est_s`` when it
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
            (``metasched.core.action_log``; ``metasched-calibrate`` fits a workload
            profile to it). None: no trace.
        ahead_per_core: pipelining on a backend's nodes: each node may hold up to this
            many cpu commands per core ahead of its free cores, in a queue there that
            starts the next the moment a command exits, with no round trip to the
            dispatcher (see ``ClusterState.hand_ahead``). None: the backend's default
            (``RayBackend.AHEAD_PER_CORE``). The local backend starts every command on
            its core from this process, so it has no such queue: 0 only.
    """

    scheduler: str = "checkpoints/default"
    scheduler_params: dict[str, Any] = field(default_factory=dict)
    cores: list[int] | None = None
    mem_gb: float | None = None
    gpu_standin: int = 0
    gpu_standin_mem_gb: float = 16.0
    endpoints: dict[str, EndpointSpec] = field(default_factory=dict)
    journal: str | Path | None = None
    fsync: bool = False
    journal_delay_s: float = 0.005
    journal_env: bool = False
    max_wait_s: float | None = 300.0
    cost_alpha: float = 0.3
    default_est_s: float = 1.0
    estimates: str = "online"
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    limits: RequestLimits = field(default_factory=RequestLimits)
    workdir: str | None = None
    tail_bytes: int = 4096
    sample_interval_s: float = 1.0
    metrics_window: int | None = 100_000
    trajectory_idle_s: float = 3600.0
    task_demand: dict[str, dict[str, float]] = field(default_factory=dict)
    trace: str | Path | None = None
    ahead_per_core: int | None = None


__all__ = ["DispatcherConfig"]
