"""Tasks the dispatcher runs on a Ray node besides its commands (which its node daemon
runs: :mod:`.node_daemon`): the node's description, and the removal of commands a dead
dispatcher left running."""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Collection
from dataclasses import dataclass

import psutil
import ray

from metasched.runtime.machine import memory_gb, usable_cores

# Every command of a Ray-backed dispatcher carries its action's id (ACTION_ENV, as on one
# machine) and the dispatcher's name, so that the next dispatcher on the same journal finds
# what the dead one left on any node without a pid in the journal.
DISPATCHER_ENV = "METASCHED_DISPATCHER"

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
    from metasched.runtime.dispatch.jobs import ACTION_ENV

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


__all__ = ["DISPATCHER_ENV", "NodeFacts", "describe_node", "kill_orphans"]
