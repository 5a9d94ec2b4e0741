"""The dispatcher's daemon on each Ray node: that node's sandboxes, and the commands
granted there.

A sandbox is held by a process for as long as its trajectory lives (the sandbox server
keeps its namespaces; its workspace is a tmpfs there), which a Ray task, gone when its
function returns, cannot be. So each node of a Ray-backed dispatcher has one
:class:`NodeDaemon` (an async actor pinned to it, started by the dispatcher and ending
with it): it makes the node's run directory and
:class:`~metasched.runtime.sandbox.manager.Sandboxes` as the dispatcher does on one
machine (:func:`~metasched.runtime.launch.open_sandboxes`: bwrap namespaces,
an unprivileged user per trajectory, cgroup slots), and starts each command through
the same call (:func:`~metasched.runtime.launch.launch`) in its trajectory's
sandbox on that node: the workspace persists across the trajectory's commands, wherever
the dispatcher runs. A gpu command (its spec names its GPU's NVML index on this node)
runs in that sandbox's sandbox for its GPU, which binds that GPU's device node alone
(:func:`~metasched.runtime.launch.gpu_sandbox`). When the dispatcher's actor
dies, Ray ends the daemons it owns, and with each its sandbox server: every sandbox and
command on the node ends too.

Commands reach an daemon one call per command (:meth:`NodeDaemon.run`), or on the
dispatcher's direct stream (:meth:`NodeDaemon.open_stream`, :mod:`.channel`); which, and
how a command holds its cores in Ray's accounting, is :class:`~.cluster.RayBackend`'s.

Handing ahead: the daemon holds the node's granted cores (:class:`CoreQueue`) and starts the
commands it is given in the order they arrive, each as soon as enough of the cores are
free, so the dispatcher may hand it commands ahead of free cores: the next one starts the
moment one exits, not a round trip (daemon, dispatcher, daemon) later.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import pickle
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray

from metasched.runtime.backend import CommandSpec
from metasched.runtime.launch import gpu_sandbox, launch, open_sandboxes
from metasched.runtime.outcome import Outcome
from metasched.runtime.ray_backend import channel
from metasched.runtime.sandbox.config import SandboxConfig
from metasched.runtime.sandbox.workspace import Template

CANCEL_CHECK_S = 0.1  # how soon a task sees its cancellation while its command runs


@dataclass(frozen=True)
class BoxSpec:
    """The sandbox a command runs in, as the dispatcher decided it (its trajectory's
    first command decides): ``key`` is the trajectory's name, ``""`` for the shared
    sandbox of trajectory-less commands."""

    key: str
    network: bool
    size_mb: float
    template: Template | None = None


def pack(spec: CommandSpec, cores: list[int] | int, box: BoxSpec | None) -> bytes:
    """:meth:`NodeDaemon.run`'s argument: bytes pass through Ray without its serializer (a
    dataclass costs it ~10x a pickle of it; this is paid on every action). ``cores``: the
    core ids to pin it to, or how many of the daemon's cores it takes, in its queue's
    order (:class:`CoreQueue`)."""
    return pickle.dumps((spec, cores, box), pickle.HIGHEST_PROTOCOL)


class CoreQueue:
    """A node's granted cores, given to commands strictly in the order they ask (a
    first-in, first-out queue: a command that needs more cores than are free waits, and
    so do those after it, as the dispatcher's state counts the node's queue)."""

    def __init__(self, cores: Sequence[int]) -> None:
        self.free = sorted(cores)
        self.waiting: deque[tuple[int, asyncio.Future[list[int]]]] = deque()

    def take(self, n: int) -> asyncio.Future[list[int]]:
        """A future of ``n`` core ids, set when they are this command's turn and free."""
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append((n, fut))
        self._serve()
        return fut

    def give(self, cores: Sequence[int]) -> None:
        """Cores a command no longer uses; the next in the queue start on them."""
        self.free.extend(cores)
        self.free.sort()
        self._serve()

    def drop(self, fut: asyncio.Future[list[int]]) -> None:
        """A command left before it ran (its call was cancelled): its place in the queue
        goes, and cores it was given come back."""
        if fut.done() and not fut.cancelled():
            self.give(fut.result())
        else:
            fut.cancel()
            self._serve()

    def _serve(self) -> None:
        q = self.waiting
        while q:
            n, fut = q[0]
            if fut.done():  # cancelled while waiting
                q.popleft()
                continue
            if len(self.free) < n:
                return
            q.popleft()
            got, self.free = self.free[:n], self.free[n:]
            fut.set_result(got)

    @property
    def queued(self) -> int:
        """Commands waiting for their cores."""
        return sum(1 for _, f in self.waiting if not f.done())


class NodeDaemon:
    """The sandboxes and commands of one node (see the module docstring); started by
    :class:`~.cluster.RayBackend` as a Ray actor pinned to its node.

    Args:
        config: how commands are confined (the dispatcher's ``sandbox`` settings).
        hide: host paths commands must not see (the journal's, on its node).
        workdir: where the run directory goes (None: ``/dev/shm`` where writable).
        cores: the core ids the dispatcher grants on this node, which commands given a
            count of cores take in arrival order (:class:`CoreQueue`); None: commands
            come with their core ids.
    """

    def __init__(self, config: SandboxConfig, hide: Sequence[str], workdir: str | None,
                 cores: Sequence[int] | None = None) -> None:
        self.config = config
        self.hide = list(hide)
        self.workdir = workdir
        self.cores = CoreQueue(cores) if cores is not None else None
        self._stream_secret = b""
        self._listener: asyncio.Server | None = None
        self.run_dir = None
        self.sandboxes = None
        self._starting: asyncio.Task | None = None

    async def _ready(self):
        if self.sandboxes is None:
            if self._starting is None:
                self._starting = asyncio.ensure_future(self._start())
            await asyncio.shield(self._starting)
        return self.sandboxes

    async def _start(self) -> None:
        from metasched.runtime.machine import default_workdir

        workdir = self.workdir if self.workdir is not None else default_workdir()
        self.run_dir, self.sandboxes = await open_sandboxes(workdir, self.config, hide=self.hide)

    async def describe(self) -> dict[str, Any]:
        """Start the node's sandboxes; what it is (or ``error``: why it cannot be)."""
        from metasched.errors import ConfigError

        try:
            sandboxes = await self._ready()
        except ConfigError as e:
            self._starting = None
            return {"error": str(e)}
        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "isolated": sandboxes.isolated, "sandboxes": sandboxes.describe(),
                "warnings": list(sandboxes.warnings)}

    async def run(self, packed: bytes) -> bytes:
        """Run the command of :func:`pack` on this node, pinned to its cores, in its
        sandbox (made at its trajectory's first command here); how it ended, pickled.
        Given a count of cores, it waits for them in the node's queue (its place taken
        on arrival, before anything else), and gives them back the moment it exits.
        Cancelling the call kills the command (its whole cgroup slot or group), or takes
        it out of the queue."""
        spec, cores, box = pickle.loads(packed)
        if isinstance(cores, int):
            turn = self.cores.take(cores)
            try:
                # The sandbox is made (at a trajectory's first command) while it waits.
                sandboxes = await self._ready()
                sb = await self._sandbox(sandboxes, box)
                cores = await turn
            except BaseException:
                self.cores.drop(turn)
                raise
            try:
                return await self._launch(spec, cores, sandboxes, sb)
            finally:
                self.cores.give(cores)
        sandboxes = await self._ready()
        return await self._launch(spec, cores, sandboxes, await self._sandbox(sandboxes, box))

    async def _sandbox(self, sandboxes, box: BoxSpec | None):
        """The command's sandbox on this node (opened at its trajectory's first command),
        or None: outside any."""
        sb = None
        if box is not None and sandboxes.isolated:
            if box.key == "":
                sb = sandboxes.shared(box.network)
            else:
                sb = sandboxes.get(box.key) or sandboxes.open(
                    box.key, size_mb=box.size_mb, template=box.template, network=box.network)
            try:
                await sb.ready
            except OSError:
                pass  # launch fails the command with the reason
        return sb

    async def _launch(self, spec: CommandSpec, cores: list[int], sandboxes, sb) -> bytes:
        try:  # a gpu command: its sandbox with its GPU's device nodes
            sb = await gpu_sandbox(sandboxes, sb, spec.gpu)
        except OSError as e:
            return pickle.dumps(Outcome(False, f"cannot start: {e.strerror or e}",
                                        detail={"cores": cores}), pickle.HIGHEST_PROTOCOL)
        proc = launch(spec.argv, cores=cores, timeout_s=spec.timeout_s, env=spec.env or {},
                      request_env=spec.request_env, sandboxes=sandboxes, sandbox=sb,
                      cwd_root=self.run_dir.path, pids_max=spec.pids_max,
                      mem_limit_mb=spec.mem_limit_mb, cpu_time_s=spec.cpu_time_s,
                      tail_bytes=spec.tail_bytes, extra_env=spec.extra_env)
        out: Outcome = await proc.wait()  # cancelled: the command is killed first
        return pickle.dumps(out, pickle.HIGHEST_PROTOCOL)

    # ---------------------------------------------------------- the direct stream

    async def open_stream(self, secret: bytes) -> tuple[str, int]:
        """Listen for the dispatcher's stream (``submit="stream"``, see :mod:`.channel`)
        on this node's address; the address and port. Only a peer that proves it holds
        ``secret`` is served."""
        host = ray.util.get_node_ip_address()
        self._stream_secret = secret
        self._listener = await asyncio.start_server(self._serve_stream, host, 0)
        return host, self._listener.sockets[0].getsockname()[1]

    async def _serve_stream(self, reader: asyncio.StreamReader,
                            writer: asyncio.StreamWriter) -> None:
        """One dispatcher's stream: each ``("start", key, pack(...))`` runs as :meth:`run`
        does, in arrival order, and its result goes back as ``(key, pickled Outcome)``;
        ``("cancel", key)`` cancels it (killed, or out of the node's queue). When the
        stream ends, its commands are cancelled."""
        if not await channel.serve_challenge(reader, writer, self._stream_secret):
            writer.close()
            return
        out = channel.Outbox(writer)
        running: dict[int, asyncio.Task] = {}

        def done(key: int, task: asyncio.Task) -> None:
            running.pop(key, None)
            if task.cancelled():
                result = Outcome(ok=False, reason="cancelled")
            elif task.exception() is not None:
                e = task.exception()
                result = Outcome(ok=False, reason=f"node daemon: {type(e).__name__}: {e}")
            else:
                out.put((key, task.result()))
                return
            out.put((key, pickle.dumps(result, pickle.HIGHEST_PROTOCOL)))

        try:
            while True:
                for op, key, *item in await channel.read_frame(reader):
                    if op == "start":
                        # A task's first step (its place in the node's queue) runs in
                        # creation order: the order the commands came in.
                        task = running[key] = asyncio.ensure_future(self.run(item[0]))
                        task.add_done_callback(lambda t, key=key: done(key, t))
                    elif op == "cancel" and key in running:
                        running[key].cancel()
        except (channel.ChannelError, ConnectionError):
            pass  # the dispatcher closed the stream, or is gone
        finally:
            for task in list(running.values()):
                task.cancel()
            writer.close()

    def queued(self) -> int:
        """Commands waiting here for their cores (handed ahead of free ones)."""
        return self.cores.queued if self.cores is not None else 0

    def close_trajectory(self, key: str) -> None:
        """End trajectory ``key``'s sandbox here (its workspace, whatever runs in it)."""
        if self.sandboxes is not None:
            self.sandboxes.close_trajectory(key)

    def close(self) -> None:
        """End every sandbox and command here, remove the run directory and cgroups."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self.sandboxes is not None:
            self.sandboxes.close()
            self.sandboxes = None
        if self.run_dir is not None:
            self.run_dir.remove()
            self.run_dir = None


@ray.remote(max_retries=0)
def run_on_daemon(daemon: Any, packed: bytes) -> bytes:
    """A command as a Ray task: it holds its granted cores in Ray's accounting (its
    ``num_cpus``) while the node's daemon runs it. ``ray.cancel`` (non-forced) cancels
    the daemon's call, which kills the command.

    The result is awaited through the reference's future, not ``ray.get``: a task
    blocked in ``ray.get`` lends its CPUs back to Ray until it returns, and the command's
    cores would be counted free while it runs. The wait wakes every
    ``CANCEL_CHECK_S`` so that a cancellation (an exception Ray raises in this thread)
    is seen."""
    ref = daemon.run.remote(packed)
    done = ref.future()
    try:
        while True:
            try:
                return done.result(timeout=CANCEL_CHECK_S)
            except concurrent.futures.TimeoutError:
                continue
    except KeyboardInterrupt:  # how Ray delivers a cancellation
        ray.cancel(ref)
        raise


__all__ = ["BoxSpec", "CoreQueue", "NodeDaemon", "pack", "run_on_daemon"]
