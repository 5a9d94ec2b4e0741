"""Commands on a backend's nodes (:class:`~metasched.runtime.backend.Backend`, e.g. a
Ray cluster): each is handed to the backend for its node, which picks its cores there
and confines it as on one machine; cpu commands may be handed ahead of their cores, to
the node's queue (handing ahead). Their starts are journaled at the grant (the next
dispatcher finds them on every node by their action id)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import Protocol

from metasched.core.actions import Action, Grant
from metasched.runtime.backend import Backend, Command, CommandSpec
from metasched.runtime.dispatch.executors.base import ExecutorHost, Executors
from metasched.runtime.dispatch.jobs import ACTION_ENV, Job
from metasched.runtime.dispatch.trajectories import Trajectories
from metasched.runtime.gpu import command_env
from metasched.runtime.outcome import Outcome
from metasched.runtime.requests import Request


class NodeExecutorHost(ExecutorHost, Protocol):
    """What commands on a backend's nodes ask of their dispatcher, beyond what every
    executor does (the :class:`~metasched.runtime.dispatch.dispatcher.Dispatcher`)."""

    base_env: dict[str, str]
    trajectories: Trajectories


class NodeExecutors(Executors):
    """Runs dispatcher ``d``'s commands on ``backend``'s nodes."""

    def __init__(self, d: NodeExecutorHost, backend: Backend) -> None:
        super().__init__(d)
        self.d: NodeExecutorHost = d
        self.backend = backend

    def reserved_ids(self, k: int) -> list[int]:
        return []  # the backend picks them on the node

    def start_cpu(self, job: Job, g: Grant) -> Callable[[], Awaitable[None]] | None:
        cmd = self._start_remote(job, g.action.node, g.cores)
        return self._awaited(job, cmd)

    def start_ahead(self, a: Action) -> None:
        """Hand an action the state put in its node's queue to the backend now: the node
        starts it when the commands before it there exit. For the journal it has started
        (a crash re-queues it, and the next dispatcher kills it where it runs)."""
        job = self.d.jobs.of_action(a.id)
        self.mark_started(job, self.d.loop.wall0 + self.d.state.t)
        work = self._awaited(job, self._start_remote(job, a.node, a.cores))
        if work is not None:
            self.spawn(work, [job])

    def _awaited(self, job: Job, cmd: Command | Exception
                 ) -> Callable[[], Awaitable[None]] | None:
        """What waits for ``cmd``: a task's work, or None where the command calls back
        as it ends (a node's stream: no task and no loop turn per command)."""
        then = getattr(cmd, "then", None)
        if then is None:
            return partial(self._run_remote, job, cmd)
        then(partial(self._ended, job, cmd))
        return None

    def _ended(self, job: Job, cmd: Command, out: Outcome) -> None:
        self.commands.discard(cmd)
        if "cores" in out.detail:  # the node chose them (in its queue's order)
            job.alloc["cores"] = list(out.detail["cores"])
        try:
            self.d.complete(job, out)
        except Exception as e:  # noqa: BLE001 - a bug: its job must still end
            self.broke([job], e)

    def _command_spec(self, req: Request, extra_env: Mapping[str, str] | None = None,
                      gpu: int | None = None) -> CommandSpec:
        # The dispatcher's allow-listed environment, as its own commands get (no secret).
        d = self.d
        return CommandSpec(req.argv, req.timeout_s, d.base_env, req.mem_limit_mb,
                           req.cpu_time_s, d.config.tail_bytes,
                           {ACTION_ENV: req.id, **(extra_env or {})}, req.env,
                           req.pids_max or d.config.sandbox.pids_max, gpu)

    def _start_remote(self, job: Job, node: int, n_cores: int) -> Command | Exception:
        """Start a cpu action's command on the backend's ``node`` now (not a loop turn
        later in its task: the time from a freed core to the next start is what leaves
        the core idle); an exception (a bug) is handed to the task to report."""
        try:
            cmd = self.backend.start_command(node, n_cores, self._command_spec(job.request),
                                             job.sandbox)
        except Exception as e:  # noqa: BLE001
            return e
        job.alloc = {"node": self.backend.nodes[node].name, "cores": cmd.cores}
        self.commands.add(cmd)
        return cmd

    async def _run_remote(self, job: Job, cmd: Command | Exception) -> None:
        try:
            if isinstance(cmd, Exception):
                raise cmd
            out = await cmd.wait()
        finally:
            self.commands.discard(cmd)
        if "cores" in out.detail:  # the node chose them (in its queue's order)
            job.alloc["cores"] = list(out.detail["cores"])
        self.d.complete(job, out)

    async def run_gpu_command(self, job: Job, device: int) -> None:
        self.d.complete(job, await self._run_device_command(job, device))

    async def _run_device_command(self, job: Job, device: int) -> Outcome:
        """A gpu command on a backend, confined as on one machine: on its device's node,
        in its trajectory's sandbox there, through the node's launch path (the backend's
        ``start_command``), with ``min_cores`` cores of that node counted busy, seeing
        its device alone."""
        d = self.d
        req = job.request
        node = self.backend.device_node(device)
        traj = d.trajectories.get(req.trajectory) if req.trajectory is not None else None
        names = [n.name[:12] for n in self.backend.nodes]
        if node < 0:
            return Outcome(False, f"GPU {device}'s node has no CPU the dispatcher grants")
        if job.sandbox is not None and traj is not None and traj.node not in (-1, node):
            return Outcome(False, f"trajectory {req.trajectory}'s sandbox is on node "
                           f"{names[traj.node]}, GPU {device} on node {names[node]} (a gpu "
                           f"command runs on its GPU's node)")
        await self.reserve_cores(req.min_cores, node)
        cmd: Command | None = None
        try:
            cmd = self.backend.start_command(
                node, req.min_cores, self._command_spec(req, command_env(d.devices[device]),
                                                        d.devices[device].nvml_index),
                job.sandbox)
            job.alloc.update(node=self.backend.nodes[node].name, cores=cmd.cores)
            self.commands.add(cmd)
            out = await cmd.wait()
            if "cores" in out.detail:  # the node chose them (in its queue's order)
                job.alloc["cores"] = list(out.detail["cores"])
            return out
        finally:
            if cmd is not None:
                self.commands.discard(cmd)
            self.unreserve_cores([], node, req.min_cores)


__all__ = ["NodeExecutors"]
