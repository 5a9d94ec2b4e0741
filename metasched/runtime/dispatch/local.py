"""The local backend: this machine, as one node. Its cores are the ones this process
may run on (or ``DispatcherConfig.cores``), pinned by the dispatcher itself; its GPUs
come from NVML (or CPU stand-ins), their services run in this process
(:class:`~metasched.runtime.gpu.ServiceHost`); commands start from this process
(:mod:`metasched.runtime.dispatch.executors.local`), confined by this machine's
sandboxes. :class:`~metasched.runtime.ray_backend.RayBackend` is the other backend."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from metasched.errors import ConfigError
from metasched.runtime.backend import Node
from metasched.runtime.dispatch.config import DispatcherConfig
from metasched.runtime.dispatch.executors.local import LocalExecutors
from metasched.runtime.dispatch.jobs import ACTION_ENV
from metasched.runtime.gpu import GpuSampler, LiveService, ServiceHost, discover_devices
from metasched.runtime.journal import Journal
from metasched.runtime.launch import open_sandboxes
from metasched.runtime.machine import MachineMonitor, memory_gb, usable_cores
from metasched.runtime.process import kill_group
from metasched.runtime.sandbox.config import SandboxConfig
from metasched.runtime.sandbox.manager import Sandboxes
from metasched.runtime.sandbox.rundir import RunDirectory


class LocalBackend:
    """This machine as a dispatcher's backend (see the module docstring).

    Args:
        config: the dispatcher's; ``cores``, ``mem_gb``, ``gpu_standin`` and
            ``gpu_standin_mem_gb`` say what of this machine it schedules over.
        services: live GPU services by name (see :mod:`metasched.runtime.gpu`).

    Raises:
        ConfigError: no cores, or cores this process may not run on.
    """

    name = "local"
    # Each command starts on its core from this process: no ahead queue to hand
    # commands to ahead of their cores.
    AHEAD_PER_CORE = 0
    EXECUTORS = LocalExecutors  # commands pinned to core ids, started from this process

    def __init__(self, config: DispatcherConfig,
                 services: Mapping[str, LiveService] | None = None) -> None:
        usable = usable_cores()
        self.cores = sorted(set(config.cores)) if config.cores is not None else usable
        if not self.cores:
            raise ConfigError("cores", "no CPU cores to run actions on")
        if not set(self.cores) <= set(usable):
            raise ConfigError("cores", f"{sorted(set(self.cores) - set(usable))} are not "
                              f"usable here (usable: {usable})")
        self.devices, self.no_gpu_reason = discover_devices(
            standin=config.gpu_standin, standin_mem_gb=config.gpu_standin_mem_gb)
        self.host = ServiceHost(self.devices)
        for name, svc in (services or {}).items():
            self.host.register(name, svc)
        mem = config.mem_gb if config.mem_gb is not None else memory_gb()
        self.nodes = [Node(self.name, tuple(self.cores), mem)]
        # NVML readings and per-core load, sampled by the dispatcher's ticker from
        # open() on (NVML is held from then until close()).
        self.gpu_sampler: GpuSampler | None = None
        self.monitor: MachineMonitor | None = None
        self.free_cores = list(self.cores)
        # Cores a trajectory holds (a scheduler's ``hold``, e.g. static's sandboxes), by
        # trajectory id: out of the free pool until it closes; its actions run on them
        # (sharing them, as processes of one sandbox do) before taking free ones.
        self.held_cores: dict[int, list[int]] = {}
        self.workdir: str | None = None  # where the run directory goes (see open)
        self.run_dir: RunDirectory | None = None  # made by start_sandboxes

    def open(self, workdir: str | None) -> None:
        """Ready for its dispatcher: the run directory goes in ``workdir`` (None: the
        system temporary directory), and the machine is sampled from now on."""
        self.workdir = workdir
        self.gpu_sampler = GpuSampler(self.devices, self.host) if self.devices else None
        self.monitor = MachineMonitor(self.cores, self.gpu_sampler)

    async def start_sandboxes(self, config: SandboxConfig, hide: list[str]) -> Sandboxes:
        """Set up this machine's sandboxes (see
        :func:`metasched.runtime.launch.open_sandboxes`): the run directory in
        ``workdir`` and the sandboxes."""
        self.run_dir, sandboxes = await open_sandboxes(self.workdir, config, hide=hide)
        return sandboxes

    async def kill_orphans(self, journal: Journal) -> None:
        """Kill the commands a previous dispatcher on ``journal`` left running (found by
        the process group its journal recorded; their scratch directories and cgroups
        go with its run directory: see :meth:`start_sandboxes`)."""
        import psutil

        for key, pid in journal.orphans():
            try:  # only a process that still carries this action's id is ours
                if psutil.Process(pid).environ().get(ACTION_ENV) == key:
                    kill_group(pid)
            except psutil.ZombieProcess:
                # An unreaped leader keeps its pid (and so its group id) from reuse: what
                # is left of the group is the action's.
                kill_group(pid)
            except (psutil.Error, OSError):
                pass

    def take_cores(self, k: int) -> list[int]:
        """``k`` free core ids, least loaded first, out of the free pool."""
        cores = self.monitor.least_loaded(self.free_cores, k)
        for c in cores:
            self.free_cores.remove(c)
        return cores

    def sample(self) -> None:
        """Sample the cores' load and the GPUs (NVML)."""
        self.monitor.sample()

    def measured_utilisation(self) -> dict[str, Any]:
        """Mean measured utilisation since the start (see :class:`MachineMonitor`)."""
        return self.monitor.summary()

    async def close(self) -> None:
        """Remove the run directory (after the sandboxes have closed) and stop NVML."""
        if self.run_dir is not None:
            self.run_dir.remove()
            self.run_dir = None
        if self.gpu_sampler is not None:
            self.gpu_sampler.close()
            self.gpu_sampler = None


__all__ = ["LocalBackend"]
