"""What the dispatcher holds of a sandbox (:class:`Sandbox`) and of a command started in
one (:class:`Started`); :class:`~metasched.runtime.sandbox.manager.Sandboxes` makes both."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from metasched.runtime.sandbox.cgroups import Slot
from metasched.runtime.sandbox.workspace import Template

__all__ = ["Sandbox", "Started"]


@dataclass(eq=False)
class Sandbox:
    """One sandbox: its namespaces (held by the server), workspace, user and slots.

    Attributes:
        key: the trajectory's name, or ``""`` for the trajectory-less one.
        size_bytes: its tmpfs (workspace, ``/tmp``, ``/dev/shm``).
        ready: done when it can run commands (its exception says why it cannot).
        seeded: how its workspace was filled: ``""``, ``"overlay"``, ``"copy"``, ``"tar"``.
        init_pid: the pid of its namespaces' init (``nsenter -t`` takes it), once ready.
        parent: for a GPU's sandbox, the sandbox whose workspace it shares (and user).
        minor: for a GPU's sandbox, its GPU's minor number (``/dev/nvidia<minor>``).
        devices: the device nodes bound into it (names under ``/dev``).
        gpus: its GPUs' sandboxes, by the GPU's minor number.
    """

    sid: int
    key: str
    uid: int
    network: bool
    size_bytes: int
    template: Template | None
    ready: asyncio.Future[None]
    seeded: str = ""
    init_pid: int = -1
    parent: Sandbox | None = None
    minor: int | None = None
    devices: tuple[str, ...] = ()
    gpus: dict[int, Sandbox] = field(default_factory=dict)
    free_slots: list[Slot] = field(default_factory=list)
    running: int = 0
    closed: bool = False
    retired: bool = False
    # gVisor: the cgroup slot the whole container runs in, the grants (cores, memory
    # bytes) of its running commands by command id, and whether it serves one
    # trajectory-less command only
    box_slot: Slot | None = None
    grants: dict[int, tuple[tuple[int, ...], int]] = field(default_factory=dict)
    throwaway: bool = False
    # gVisor (:mod:`.warm`): whether its container is starting (a turn of the node's
    # cap on starts), and since when it is idle once wiped
    starting: bool = False
    idle_since: float = 0.0

    @property
    def shared(self) -> bool:
        """Whether this is the sandbox of trajectory-less commands."""
        return self.key == ""


@dataclass
class Started:
    """A command the server started: its id, host pid and slot (None: no cgroups).
    Started without waiting (:meth:`Sandboxes.start` with ``wait=False``), ``pid`` is
    None until ``spawned`` (its future) has it, or the OSError of why it did not start."""

    cmd: int
    pid: int | None
    slot: Slot | None
    uid: int
    spawned: asyncio.Future[int] | None = None
    in_gvisor: bool = False  # in a gVisor sandbox: killed through its exec server
    wipe: bool = False  # a sandbox's wipe before its reuse (:mod:`.warm`)
