"""The dispatcher's agent on each Ray node: that node's confinement, and the commands
granted there.

A sandbox is held by a process for as long as its trajectory lives (the sandbox server
keeps its namespaces; its workspace is a tmpfs there), which a Ray task, gone when its
function returns, cannot be. So each node of a Ray-backed dispatcher has one
:class:`NodeAgent` (an async actor pinned to it, started by the dispatcher and ending
with it): it makes the node's run directory and
:class:`~metasched.runtime.sandbox.manager.Sandboxes` as the dispatcher does on one
machine (:func:`~metasched.runtime.sandbox.launch.open_confinement`: bwrap namespaces,
an unprivileged user per trajectory, cgroup slots), and starts each command through
the same call (:func:`~metasched.runtime.sandbox.launch.launch`) in its trajectory's
sandbox on that node: the workspace persists across the trajectory's commands, wherever
the dispatcher runs. A gpu command (its spec names its GPU's NVML index on this node)
runs in that sandbox's sandbox for its GPU, which binds that GPU's device node alone
(:func:`~metasched.runtime.sandbox.launch.gpu_sandbox`). When the dispatcher's actor
dies, Ray ends the agents it owns, and with each its sandbox server: every sandbox and
command on the node ends too.

Commands reach an agent one call per command (:meth:`NodeAgent.run`); how a call is
made, and how it holds its cores in Ray's accounting, is :class:`~.cluster.RayBackend`'s.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray

from metasched.runtime.backend import CommandSpec
from metasched.runtime.outcome import Outcome
from metasched.runtime.sandbox.config import SandboxConfig
from metasched.runtime.sandbox.launch import gpu_sandbox, launch, open_confinement
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


def pack(spec: CommandSpec, cores: list[int], box: BoxSpec | None) -> bytes:
    """:meth:`NodeAgent.run`'s argument: bytes pass through Ray without its serializer (a
    dataclass costs it ~10x a pickle of it; this is paid on every action)."""
    return pickle.dumps((spec, cores, box), pickle.HIGHEST_PROTOCOL)


class NodeAgent:
    """The confinement and commands of one node (see the module docstring); started by
    :class:`~.cluster.RayBackend` as a Ray actor pinned to its node.

    Args:
        config: how commands are confined (the dispatcher's ``sandbox`` settings).
        hide: host paths commands must not see (the journal's, on its node).
        workdir: where the run directory goes (None: ``/dev/shm`` where writable).
    """

    def __init__(self, config: SandboxConfig, hide: Sequence[str], workdir: str | None) -> None:
        self.config = config
        self.hide = list(hide)
        self.workdir = workdir
        self.run_dir = None
        self.boxes = None
        self._starting: asyncio.Task | None = None

    async def _ready(self):
        if self.boxes is None:
            if self._starting is None:
                self._starting = asyncio.ensure_future(self._start())
            await asyncio.shield(self._starting)
        return self.boxes

    async def _start(self) -> None:
        from metasched.runtime.machine import default_workdir

        workdir = self.workdir if self.workdir is not None else default_workdir()
        self.run_dir, self.boxes = await open_confinement(workdir, self.config, hide=self.hide)

    async def describe(self) -> dict[str, Any]:
        """Start the node's confinement; what it is (or ``error``: why it cannot be)."""
        from metasched.errors import ConfigError

        try:
            boxes = await self._ready()
        except ConfigError as e:
            self._starting = None
            return {"error": str(e)}
        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "isolated": boxes.isolated, "confinement": boxes.describe(),
                "warnings": list(boxes.warnings)}

    async def run(self, packed: bytes) -> bytes:
        """Run the command of :func:`pack` on this node, pinned to its cores, in its
        sandbox (made at its trajectory's first command here); how it ended, pickled.
        Cancelling the call kills the command (its whole cgroup slot or group)."""
        spec, cores, box = pickle.loads(packed)
        boxes = await self._ready()
        sb = None
        if box is not None and boxes.isolated:
            if box.key == "":
                sb = boxes.shared(box.network)
            else:
                sb = boxes.get(box.key) or boxes.open(
                    box.key, size_mb=box.size_mb, template=box.template, network=box.network)
            try:
                await sb.ready
            except OSError:
                pass  # launch fails the command with the reason
            try:  # a gpu command: its sandbox with its GPU's device nodes
                sb = await gpu_sandbox(boxes, sb, spec.gpu)
            except OSError as e:
                return pickle.dumps(Outcome(False, f"cannot start: {e.strerror or e}",
                                            detail={"cores": cores}), pickle.HIGHEST_PROTOCOL)
        proc = launch(spec.argv, cores=cores, timeout_s=spec.timeout_s, env=spec.env or {},
                      request_env=spec.request_env, boxes=boxes, sandbox=sb,
                      cwd_root=self.run_dir.path, pids_max=spec.pids_max,
                      mem_limit_mb=spec.mem_limit_mb, cpu_time_s=spec.cpu_time_s,
                      tail_bytes=spec.tail_bytes, extra_env=spec.extra_env)
        out: Outcome = await proc.wait()  # cancelled: the command is killed first
        return pickle.dumps(out, pickle.HIGHEST_PROTOCOL)

    def close_trajectory(self, key: str) -> None:
        """End trajectory ``key``'s sandbox here (its workspace, whatever runs in it)."""
        if self.boxes is not None:
            self.boxes.close_trajectory(key)

    def close(self) -> None:
        """End every sandbox and command here, remove the run directory and cgroups."""
        if self.boxes is not None:
            self.boxes.close()
            self.boxes = None
        if self.run_dir is not None:
            self.run_dir.remove()
            self.run_dir = None


@ray.remote(max_retries=0)
def run_on_agent(agent: Any, packed: bytes) -> bytes:
    """A command as a Ray task: it holds its granted cores in Ray's accounting (its
    ``num_cpus``) while the node's agent runs it. ``ray.cancel`` (non-forced) cancels
    the agent's call, which kills the command.

    The result is awaited through the reference's future, not ``ray.get``: a task
    blocked in ``ray.get`` lends its CPUs back to Ray until it returns, and the command's
    cores would be counted free while it runs. The wait wakes every
    ``CANCEL_CHECK_S`` so that a cancellation (an exception Ray raises in this thread)
    is seen."""
    ref = agent.run.remote(packed)
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


__all__ = ["BoxSpec", "NodeAgent", "pack", "run_on_agent"]
