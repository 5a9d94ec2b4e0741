"""Where a dispatcher's actions run: the seam between the scheduling core on the
dispatcher's clock and the machines that execute what it grants.

A :class:`~metasched.runtime.dispatch.Dispatcher` built without a backend runs
everything on this machine, through a
:class:`~metasched.runtime.dispatch.local.LocalBackend` (one node: the cores this
process may use; GPUs from NVML; commands through :mod:`metasched.runtime.process`,
pinned to core ids by the dispatcher). Given another :class:`Backend`, it schedules over
the backend's nodes and devices instead, and hands it each granted command and GPU
batch; the journal, the queue, the guard, the policy and API calls (whose quotas the
dispatcher's ``ApiPool`` holds for every caller) and the sandboxes' bookkeeping (which
trajectory's sandbox is on which node, its memory) stay in the dispatcher; the backend
confines each command on its node as the local backend does here.
:mod:`metasched.runtime.ray_backend` is the backend for a Ray cluster.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from metasched.runtime.gpu import GpuHost, LiveDevice
from metasched.runtime.outcome import Outcome
from metasched.runtime.sandbox.config import SandboxConfig

if TYPE_CHECKING:
    from metasched.runtime.dispatch.executors import Executors
    from metasched.runtime.journal import Journal


@dataclass(frozen=True)
class Node:
    """One machine whose cores the dispatcher grants.

    Attributes:
        name: how the backend names it (a Ray node id).
        cores: CPU ids commands on it may be pinned to (as many as the dispatcher may
            grant there).
        mem_gb: its memory, GB (what ``mem_limit_mb`` and sandboxes are bounded by).
    """

    name: str
    cores: tuple[int, ...]
    mem_gb: float


@dataclass(frozen=True)
class CommandSpec:
    """What a granted command needs, wherever it runs (the arguments of
    :func:`metasched.runtime.launch.launch`, less its cores and sandbox).

    ``env`` is the dispatcher's allow-listed environment, ``request_env`` the request's
    own (over a sandbox's home), ``extra_env`` what the dispatcher marks it with (its
    action id). ``gpu`` is the NVML index, on its node, of the GPU a gpu command was
    granted (None: a cpu command, or a stand-in device): it runs in its sandbox's
    sandbox for that GPU (:func:`metasched.runtime.launch.gpu_sandbox`)."""

    argv: tuple[str, ...]
    timeout_s: float
    env: Mapping[str, str] | None = None
    mem_limit_mb: float | None = None
    cpu_time_s: float | None = None
    tail_bytes: int = 4096
    extra_env: Mapping[str, str] | None = None
    request_env: Mapping[str, str] | None = None
    pids_max: int | None = None
    gpu: int | None = None


class Command(Protocol):
    """A started command: ``await wait()`` for how it ended, or ``abandon()`` it (stop
    it and clean up, never waiting)."""

    cores: list[int]

    async def wait(self) -> Outcome: ...

    def abandon(self) -> None: ...


class Backend(Protocol):
    """The machines a dispatcher schedules over (see the module docstring).

    Attributes:
        name: a word for logs and stats ("ray").
        nodes: the CPU nodes, in the order of the core's ``CpuPool``.
        devices: the GPUs, ``devices[i].index == i`` as in the core's ``GpuPool``.
        no_gpu_reason: why there is no GPU ("" when there are some).
        host: runs batches of GPU services on ``devices``.
        cores: the CPU ids of this machine the dispatcher pins commands to itself
            (empty: the backend picks the cores on its nodes).
        EXECUTORS: the class of what runs the dispatcher's grants on it
            (:class:`~metasched.runtime.dispatch.executors.Executors`), made with
            ``(dispatcher, backend)``.
        AHEAD_PER_CORE: (optional) the default of ``DispatcherConfig.ahead_per_core``.
    """

    name: str
    nodes: Sequence[Node]
    devices: Sequence[LiveDevice]
    no_gpu_reason: str
    host: GpuHost
    cores: Sequence[int]
    EXECUTORS: type[Executors]

    async def start_sandboxes(self, config: SandboxConfig, hide: list[str]) -> Any:
        """Set up each node's sandboxes as ``config`` says (``hide``: host paths
        commands must not see); the dispatcher's view of the sandboxes (the interface of
        :class:`~metasched.runtime.sandbox.manager.Sandboxes` it uses: ``isolated``,
        ``get``, ``open``, ``shared``, ``close_trajectory``, ``close``, ``describe``).

        Raises:
            ConfigError: a node cannot confine commands as configured.
        """
        ...

    def start_command(self, node: int, n_cores: int, spec: CommandSpec,
                      sandbox: Any = None) -> Command:
        """Start ``spec`` on ``n_cores`` cores of ``nodes[node]`` now, in ``sandbox`` (one
        of :meth:`start_sandboxes`'s, on that node; None: outside any); the cores are the
        backend's to choose and free; a failure to start is the Command's Outcome."""
        ...

    def device_node(self, device: int) -> int:
        """The index in ``nodes`` of the node ``devices[device]`` is on (-1: on none of
        them); the dispatcher starts a command that needs the device there, through
        :meth:`start_command`, confined as every command."""
        ...

    async def kill_orphans(self, journal: Journal) -> None:
        """Kill the commands a previous dispatcher on ``journal`` left running for its
        unfinished requests (before they are queued again).

        Raises:
            sqlite3.DatabaseError: the journal cannot be read.
        """
        ...

    def sample(self) -> None:
        """Measure the machines' load now (the dispatcher calls it every
        ``sample_interval_s`` seconds, and once at close)."""
        ...

    def measured_utilisation(self) -> dict[str, float]:
        """Mean measured utilisation since the start (``cpu``, ``gpu``); empty if the
        backend does not measure it."""
        ...

    async def close(self) -> None:
        """Stop what the backend started for this dispatcher (its GPU hosts...)."""
        ...


__all__ = ["Backend", "Command", "CommandSpec", "GpuHost", "Node"]
