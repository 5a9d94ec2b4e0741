"""Commands on this machine (:class:`~metasched.runtime.dispatch.local.LocalBackend`):
each starts from this process, pinned to core ids the dispatcher picks (a trajectory's
held cores first, then the least loaded free ones), in its sandbox and a cgroup slot;
its start is journaled with its process group once it runs."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import Any, Protocol

from metasched.core.actions import Grant
from metasched.errors import ConfigError
from metasched.runtime.dispatch.executors.base import ExecutorHost, Executors
from metasched.runtime.dispatch.jobs import ACTION_ENV, Job
from metasched.runtime.dispatch.sharing import Sharing
from metasched.runtime.gpu import command_env
from metasched.runtime.launch import gpu_sandbox, launch
from metasched.runtime.outcome import Outcome
from metasched.runtime.process import Process
from metasched.runtime.sandbox.manager import Sandbox
from metasched.runtime.sandbox.rundir import RunDirectory


class LocalExecutorHost(ExecutorHost, Protocol):
    """What commands on this machine ask of their dispatcher, beyond what every
    executor does (the :class:`~metasched.runtime.dispatch.dispatcher.Dispatcher`)."""

    base_env: dict[str, str]
    sandboxes: Any  # this machine's Sandboxes (made at start)
    sharing: Sharing


class CoreLedger(Protocol):
    """This machine's cores as the executors take and return them
    (:class:`~metasched.runtime.dispatch.local.LocalBackend`)."""

    free_cores: list[int]
    held_cores: dict[int, list[int]]  # a trajectory's held cores, by its id
    run_dir: RunDirectory | None

    def take_cores(self, k: int) -> list[int]: ...


class LocalExecutors(Executors):
    """Runs dispatcher ``d``'s commands on ``machine``'s cores."""

    PIDS_JOURNALED = True
    SHARES = True

    def __init__(self, d: LocalExecutorHost, machine: CoreLedger) -> None:
        super().__init__(d)
        self.d: LocalExecutorHost = d
        self.machine = machine

    @classmethod
    def check_ahead(cls, ahead: int) -> None:
        if ahead:
            raise ConfigError("ahead_per_core", "the local backend starts each command on "
                              "its core itself (no ahead queue to hand commands to): must be 0")

    def reserved_ids(self, k: int) -> list[int]:
        return self.machine.take_cores(k)

    def free(self, cores: list[int]) -> None:
        self.machine.free_cores.extend(cores)

    def release_held(self, traj_id: int) -> None:
        self.machine.free_cores.extend(self.machine.held_cores.pop(traj_id, ()))

    def start_cpu(self, job: Job, g: Grant) -> Callable[[], Awaitable[None]]:
        cores, own = self._grant_cores(g)
        job.alloc = {"cores": cores}
        proc = self._start_command(job, cores)
        self.d.sharing.started(job, proc, cores)
        return partial(self._run_cpu, job, own, proc)

    def start_shared(self, job: Job, cores: list[int], release: Callable[[], None]) -> None:
        job.alloc = {"cores": cores, "shared": True}
        proc = self._start_command(job, cores)
        self.d.sharing.started(job, proc, cores)
        self.spawn(partial(self._run_shared, job, proc, release), [job])

    async def _run_shared(self, job: Job, proc: Process | Exception,
                          release: Callable[[], None]) -> None:
        try:
            out = await self._wait_command(proc, release)
        finally:
            self.d.sharing.ended(job)
        self.d.complete(job, out)

    def _grant_cores(self, g: Grant) -> tuple[list[int], list[int]]:
        """The core ids of a started cpu grant, and those of them it took from the free
        pool (returned when it ends): first the ones its trajectory holds (the state has
        already counted a new hold), then free ones, least loaded first."""
        traj = g.action.traj
        held: list[int] = []
        if traj is not None and traj.held_cores:
            held = self.machine.held_cores.setdefault(traj.id, [])
            held.extend(self.machine.take_cores(traj.held_cores - len(held)))
        from_held = held[:g.cores]
        own = self.machine.take_cores(g.cores - len(from_held))
        return from_held + own, own

    def _on_pid(self, job: Job) -> Callable[[int], None]:
        def record(pid: int) -> None:
            if self.d.writer is not None:
                self.d.writer.start(job.request.id, pid, job.attempts)
        return record

    def _start_command(self, job: Job, cores: list[int],
                       extra_env: Mapping[str, str] | None = None,
                       sandbox: Sandbox | None = None) -> Process | Exception:
        """Start a command now, not a loop turn later in its task: the time from a freed
        core to the next start is what leaves the core idle. It runs in ``sandbox``
        (default: the job's; isolation on) or on the host, in a cgroup slot when there
        are cgroups. An exception (a bug, not the action's failure) is handed to the task
        to report."""
        d = self.d
        req = job.request
        try:
            proc = launch(
                req.argv, cores=cores, timeout_s=req.timeout_s, env=d.base_env,
                request_env=req.env, sandboxes=d.sandboxes,
                sandbox=sandbox if sandbox is not None else job.sandbox,
                cwd_root=self.machine.run_dir.path,
                pids_max=req.pids_max or d.config.sandbox.pids_max,
                mem_limit_mb=req.mem_limit_mb, cpu_time_s=req.cpu_time_s,
                tail_bytes=d.config.tail_bytes,
                extra_env={ACTION_ENV: req.id, **(extra_env or {})},
                on_start=self._on_pid(job))
        except Exception as e:  # noqa: BLE001
            return e
        self.commands.add(proc)
        job.process = proc
        return proc

    async def _run_cpu(self, job: Job, cores: list[int], proc: Process | Exception) -> None:
        try:
            out = await self._wait_command(proc, lambda: self.machine.free_cores.extend(cores))
        finally:
            self.d.sharing.ended(job)
        self.d.complete(job, out)

    async def _wait_command(self, proc: Process | Exception,
                            release: Callable[[], None]) -> Outcome:
        """How a started command ended; ``release`` gives its cores back, whatever
        happens (an exception from the start is raised here, for the task to report)."""
        try:
            if isinstance(proc, Exception):
                raise proc
            return await proc.wait()
        finally:
            self.commands.discard(proc)
            release()

    async def run_gpu_command(self, job: Job, device: int) -> None:
        d = self.d
        dev = d.devices[device]
        cores = await self.reserve_cores(job.request.min_cores)
        job.alloc["cores"] = cores
        try:  # its sandbox with its GPU's device nodes (isolation on)
            sandbox = (await gpu_sandbox(d.sandboxes, job.sandbox, dev.nvml_index)
                       if d.sandboxes is not None else None)
        except OSError as e:
            self.unreserve_cores(cores)
            d.complete(job, Outcome(False, f"cannot start: {e.strerror or e}",
                                     detail={"cores": cores}))
            return
        proc = self._start_command(job, cores, extra_env=command_env(dev), sandbox=sandbox)
        out = await self._wait_command(proc, lambda: self.unreserve_cores(cores))
        d.complete(job, out)


__all__ = ["LocalExecutors"]
