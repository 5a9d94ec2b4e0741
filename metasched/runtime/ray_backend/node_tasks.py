"""What runs on a Ray node for the dispatcher: a granted command (as a task holding its
cores in Ray's accounting), the node's description, and the removal of commands a
dead dispatcher left running.

A command runs through the same executor as on one machine
(:func:`metasched.runtime.process.run_process`: pinned to its core ids, its own session,
rlimits, a timeout that kills the group). The worker keeps one event loop for all the
tasks it runs (making one per task would cost more than a short command's spawn).
"""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import socket
from collections.abc import Collection
from dataclasses import dataclass

import psutil
import ray

from metasched.runtime.backend import CommandSpec
from metasched.runtime.machine import default_workdir, memory_gb, usable_cores

# Every command of a Ray-backed dispatcher carries its action's id (ACTION_ENV, as on one
# machine) and the dispatcher's name, so that the next dispatcher on the same journal finds
# what the dead one left on any node without a pid in the journal.
DISPATCHER_ENV = "METASCHED_DISPATCHER"

_loop: asyncio.AbstractEventLoop | None = None


def _event_loop() -> asyncio.AbstractEventLoop:
    global _loop
    if _loop is None or _loop.is_closed():
        _loop = asyncio.new_event_loop()
    return _loop


def pack(spec: CommandSpec, cores: list[int], workdir: str | None) -> bytes:
    """``run_command``'s argument: bytes pass through Ray without its serializer (a
    dataclass costs it ~10x a pickle of it; this is paid on every action)."""
    return pickle.dumps((spec, cores, workdir), pickle.HIGHEST_PROTOCOL)


@ray.remote(max_retries=0)
def run_command(packed: bytes) -> bytes:
    """Run the command of ``pack(spec, cores, workdir)``, pinned to ``cores`` of this
    node; how it ended (a pickled :class:`Outcome`, for the same reason).

    ``ray.cancel`` (non-forced) interrupts the wait: the command's process group is
    killed before the task ends, so nothing of it outlives the task.
    """
    from metasched.runtime.process import run_process

    spec, cores, workdir = pickle.loads(packed)
    loop = _event_loop()
    run = loop.create_task(run_process(
        spec.argv, cores=cores, timeout_s=spec.timeout_s, env=spec.env,
        mem_limit_mb=spec.mem_limit_mb, cpu_time_s=spec.cpu_time_s,
        tail_bytes=spec.tail_bytes, extra_env=spec.extra_env,
        cwd_root=workdir if workdir is not None else default_workdir()))
    try:
        return pickle.dumps(loop.run_until_complete(run), pickle.HIGHEST_PROTOCOL)
    except KeyboardInterrupt:  # how Ray delivers a cancellation
        run.cancel()
        try:
            loop.run_until_complete(run)  # kills the group, removes the scratch directory
        except BaseException:  # noqa: BLE001, S110 - cancelled: the task ends anyway
            pass
        raise


@dataclass(frozen=True)
class NodeFacts:
    """What a node says about itself (from a task pinned to it)."""

    node_id: str
    hostname: str
    cores: tuple[int, ...]  # the CPU ids its Ray workers may run on
    mem_gb: float


@ray.remote(num_cpus=0, max_retries=0)
def describe_node() -> NodeFacts:
    """This node's id, host name, usable core ids and memory."""
    return NodeFacts(ray.get_runtime_context().get_node_id(), socket.gethostname(),
                     tuple(usable_cores()), memory_gb())


@ray.remote(num_cpus=0, max_retries=0)
def kill_orphans(dispatcher: str, keys: Collection[str]) -> int:
    """Kill the process groups on this node whose processes carry ``dispatcher``'s name
    and one of ``keys`` as their action id; how many groups."""
    from metasched.runtime.dispatcher import ACTION_ENV

    wanted = set(keys)
    groups: set[int] = set()
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
            if env.get(DISPATCHER_ENV) == dispatcher and env.get(ACTION_ENV) in wanted:
                groups.add(os.getpgid(proc.pid))
        except (psutil.Error, OSError):
            continue  # gone, or not ours to read
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass
    return len(groups)


__all__ = ["DISPATCHER_ENV", "NodeFacts", "describe_node", "kill_orphans", "pack", "run_command"]
