"""Per-command cgroups: the granted cpuset, a memory limit and a process limit, enforced
by the kernel, on cgroup v2, cgroup v1, or a host that mixes them.

Each controller (``cpuset``, ``memory``, ``pids``) is taken from cgroup v2 where it is
enabled in the v2 directory the dispatcher may use (a delegated subtree, or the v2 root),
else from its cgroup v1 hierarchy where that is mounted and writable; a controller found
in neither is reported missing (the caller falls back to affinity and rlimits and says
so). Killing uses v2's ``cgroup.kill`` wherever a v2 directory is writable, even one
without controllers (this project's machines: v2 mounted at ``/sys/fs/cgroup/unified``
with no controllers, v1 ``cpuset``, ``memory``, ``pids`` writable); without v2 it stops
forks (``pids.max`` = 0) and kills the members until none is left.

:class:`CgroupTree` is the dispatcher's subtree: one directory in each hierarchy used,
made below the cgroup the dispatcher runs in (so whatever limits the dispatcher itself
lives under still hold), named ``metasched-<pid>-<random>``, removed by :meth:`close`.
:class:`Slot` is one command's set of cgroups inside it. Slots are reused (making a
memory cgroup costs ~0.8 ms, a cpuset one ~0.4 ms here; rewriting a limit costs µs):
each command rewrites its slot's ``cpuset.cpus``, memory limit and ``pids.max``.

Memory a command writes to a tmpfs is charged to its memory cgroup like its processes'
memory, and files outlive the command: a workspace's files stay charged to the slot that
wrote them. So a slot's memory limit is set to what the slot holds when the command
starts plus the command's own limit: ``mem_limit_mb`` is what one command may add, in
processes and in new files. Give each workspace its own slots (the caller does) so that
what one sandbox holds never counts against another.

Writes to a slot's files need root (or a delegated subtree): commands never can (they
run as other users, and see ``/sys`` read-only).

The parts: :mod:`.cgroup_discovery` (which controllers, where: :func:`discover`) and
:mod:`.cgroup_files` (a cgroup's files, removing and emptying a cgroup directory).
"""

from __future__ import annotations

import errno
import os
import secrets
import signal
import time
from collections.abc import Sequence

from metasched.runtime.sandbox.cgroup_discovery import CONTROLLERS, Hierarchies, discover
from metasched.runtime.sandbox.cgroup_files import (
    _counter,
    _read,
    _remove_dirs,
    _write,
    kill_members,
    remove_dir,
)

__all__ = ["CONTROLLERS", "CgroupTree", "Hierarchies", "Slot", "discover", "kill_members",
           "remove_dir"]

_UNLIMITED_V1 = "-1"
_KILL_ROUNDS = 200  # v1 without cgroup.kill: kill passes before giving up


class CgroupTree:
    """The dispatcher's own cgroups: a directory in each hierarchy used, slots below.

    Args:
        hierarchies: from :func:`discover`.
        name: the subtree's directory name (default ``metasched-<pid>-<random>``).

    Raises:
        OSError: a directory could not be made (then nothing is left behind).
    """

    def __init__(self, hierarchies: Hierarchies, name: str | None = None) -> None:
        self.h = hierarchies
        self.name = name or f"metasched-{os.getpid()}-{secrets.token_hex(4)}"
        self.place = hierarchies.placement()
        self.dirs: dict[str, str] = {}  # "v2" or a v1 controller -> the subtree's directory
        self.slots: list[Slot] = []  # every slot made and not yet removed
        self._next = 0
        try:
            if hierarchies.v2 is not None:
                path = os.path.join(hierarchies.v2, self.name)
                os.mkdir(path)
                self.dirs["v2"] = path
                wanted = [c for c, v in self.place.items() if v == "v2"]
                if wanted:
                    _write(os.path.join(path, "cgroup.subtree_control"),
                           " ".join(f"+{c}" for c in wanted))
            for c, version in self.place.items():
                if version != "v1":
                    continue
                path = os.path.join(hierarchies.v1[c], self.name)
                os.mkdir(path)
                self.dirs[c] = path
                if c == "cpuset":
                    # A v1 cpuset starts empty: give it the parent's, and make slots
                    # start with them too.
                    parent = hierarchies.v1[c]
                    for key in ("cpuset.cpus", "cpuset.mems"):
                        _write(os.path.join(path, key), _read(os.path.join(parent, key)).strip())
                    _write(os.path.join(path, "cgroup.clone_children"), "1")
        except BaseException:
            self.close()
            raise

    @property
    def controllers(self) -> set[str]:
        """The controllers slots of this tree have."""
        return set(self.place)

    def directories(self) -> list[str]:
        """Every directory this tree made (for a crash-recovery record)."""
        return list(self.dirs.values())

    def new_slot(self) -> Slot:
        """A new, empty slot (its directories made now)."""
        n = self._next
        self._next += 1
        slot = Slot(self, f"c{n}")
        self.slots.append(slot)
        return slot

    def close(self, timeout_s: float = 2.0) -> bool:
        """Kill whatever is left in any slot, remove every slot and the subtree;
        whether it is all gone."""
        for slot in list(self.slots):
            slot.kill()
        deadline = time.monotonic() + timeout_s
        for slot in list(self.slots):
            slot.wait_empty(max(0.0, deadline - time.monotonic()))
            slot.remove()
        return _remove_dirs(self.dirs)


class Slot:
    """One command's cgroups: a directory named ``name`` in each of the tree's
    hierarchies.

    The sandbox server moves itself into the slot (by writing ``0`` to each
    ``cgroup.procs`` in :attr:`procs_fds`) just before it spawns the command and back
    after, so the command is inside from its first instruction.
    """

    def __init__(self, tree: CgroupTree, name: str) -> None:
        self.tree = tree
        self.dirs: dict[str, str] = {}
        self.procs_fds: list[int] = []
        self.cores: tuple[int, ...] | None = None
        self._mem_limit: int | None = None
        self._pids_max: int | None = None
        self._oom_base = 0
        self._pids_base = 0
        # A gVisor sandbox's slot and its kills when this command started: the limits
        # of the command are enforced there (gVisor's kernel holds its memory)
        self.enforced_by: tuple[Slot, int] | None = None
        try:
            for key, parent in tree.dirs.items():
                path = os.path.join(parent, name)
                os.mkdir(path)
                self.dirs[key] = path
                self.procs_fds.append(os.open(os.path.join(path, "cgroup.procs"),
                                              os.O_WRONLY | os.O_CLOEXEC))
        except BaseException:
            self.remove()
            raise

    # --- which file holds what, by controller and version ---------------------------

    def _dir(self, controller: str) -> str | None:
        version = self.tree.place.get(controller)
        if version is None:
            return None
        return self.dirs.get("v2" if version == "v2" else controller)

    def _v2(self, controller: str) -> bool:
        return self.tree.place.get(controller) == "v2"

    # --- configuring --------------------------------------------------------------------

    def configure(self, cores: Sequence[int], mem_limit_bytes: int | None,
                  pids_max: int | None) -> None:
        """Set the slot up for one command: its cpuset, memory limit (on top of what the
        slot holds now) and process limit; None: unlimited.

        Raises:
            OSError: the kernel refused a value (e.g. a core outside the parent's set).
        """
        cores_t = tuple(sorted(int(c) for c in cores))
        d = self._dir("cpuset")
        if d is not None and cores_t != self.cores:
            _write(os.path.join(d, "cpuset.cpus"), ",".join(map(str, cores_t)))
            self.cores = cores_t
        d = self._dir("memory")
        if d is not None:
            limit = None if mem_limit_bytes is None else self.memory_used() + int(mem_limit_bytes)
            if limit != self._mem_limit:
                self._set_memory_limit(d, limit)
                self._mem_limit = limit
            self._oom_base = self.oom_kills()
        d = self._dir("pids")
        if d is not None:
            self._pids_base = self.pids_refused()
            if pids_max != self._pids_max:
                _write(os.path.join(d, "pids.max"), "max" if pids_max is None else str(pids_max))
                self._pids_max = pids_max

    def _set_memory_limit(self, d: str, limit: int | None) -> None:
        if self._v2("memory"):
            _write(os.path.join(d, "memory.max"), "max" if limit is None else str(limit))
            swap = os.path.join(d, "memory.swap.max")
            if os.path.exists(swap):  # swapped-out memory counts too
                _write(swap, "max" if limit is None else "0")
            return
        value = _UNLIMITED_V1 if limit is None else str(limit)
        memsw = os.path.join(d, "memory.memsw.limit_in_bytes")
        has_memsw = os.path.exists(memsw)
        # memory + swap must stay >= memory: raise memsw first, lower it last.
        try:
            _write(os.path.join(d, "memory.limit_in_bytes"), value)
        except OSError as e:
            if e.errno != errno.EINVAL or not has_memsw:
                raise
            _write(memsw, value)
            _write(os.path.join(d, "memory.limit_in_bytes"), value)
        else:
            if has_memsw:
                _write(memsw, value)

    # --- reading ------------------------------------------------------------------------

    def memory_used(self) -> int:
        """Bytes charged to the slot (its processes and the tmpfs pages they wrote)."""
        d = self._dir("memory")
        if d is None:
            return 0
        name = "memory.current" if self._v2("memory") else "memory.usage_in_bytes"
        try:
            return int(_read(os.path.join(d, name)))
        except (OSError, ValueError):
            return 0

    def oom_kills(self) -> int:
        """Processes the kernel killed for the slot's memory limit, ever."""
        d = self._dir("memory")
        if d is None:
            return 0
        name = "memory.events" if self._v2("memory") else "memory.oom_control"
        return _counter(os.path.join(d, name), "oom_kill")

    def pids_refused(self) -> int:
        """Forks the slot's process limit refused, ever."""
        d = self._dir("pids")
        if d is None:
            return 0
        return _counter(os.path.join(d, "pids.events"), "max")

    def exceeded(self) -> tuple[bool, bool]:
        """(memory limit hit, process limit hit) since :meth:`configure`."""
        memory = self.oom_kills() > self._oom_base
        if self.enforced_by is not None:
            box, base = self.enforced_by
            memory = memory or box.oom_kills() > base
        return (memory, self.pids_refused() > self._pids_base)

    def cpu_seconds(self) -> float | None:
        """CPU time used by the slot's processes, ever (all its commands: compare two
        readings). From cgroup v2's ``cpu.stat`` (``usage_usec``: kept by every v2
        cgroup, with or without the cpu controller); None without a v2 directory."""
        d = self.dirs.get("v2")
        if d is None:
            return None
        usec = _counter(os.path.join(d, "cpu.stat"), "usage_usec")
        return usec / 1e6

    def members(self) -> list[int]:
        """Process ids in the slot (as this process sees them)."""
        for d in self.dirs.values():
            try:
                return [int(x) for x in _read(os.path.join(d, "cgroup.procs")).split()]
            except OSError:
                continue
        return []

    def empty(self) -> bool:
        """Whether no process is left in the slot."""
        d = self.dirs.get("v2")
        if d is not None:
            try:
                return "populated 0" in _read(os.path.join(d, "cgroup.events"))
            except OSError:
                pass
        return not any(self._members_of(d) for k, d in self.dirs.items() if k != "v2")

    @staticmethod
    def _members_of(d: str) -> list[str]:
        try:
            return _read(os.path.join(d, "cgroup.procs")).split()
        except OSError:
            return []

    # --- ending -------------------------------------------------------------------------

    def kill(self) -> None:
        """SIGKILL every process in the slot, including any that left the command's
        session or process group (v2: ``cgroup.kill``; v1: forks stopped, then the
        members killed until none is left or the kernel does not let them go)."""
        d = self.dirs.get("v2")
        if d is not None:
            try:
                _write(os.path.join(d, "cgroup.kill"), "1")
                return
            except OSError:
                pass  # Linux < 5.14: no cgroup.kill
        pids_dir = self._dir("pids")
        if pids_dir is not None:
            try:
                _write(os.path.join(pids_dir, "pids.max"), "0")  # no new processes
                self._pids_max = 0
            except OSError:
                pass
        for _ in range(_KILL_ROUNDS):
            pids = self.members()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def wait_empty(self, timeout_s: float) -> bool:
        """Poll until no process is left (killed processes take a moment to exit)."""
        deadline = time.monotonic() + timeout_s
        delay = 0.0002
        while not self.empty():
            if time.monotonic() >= deadline:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 0.02)
        return True

    def remove(self) -> bool:
        """Close the slot's files and remove its directories; whether all are gone (a
        slot with processes left cannot be removed: kill it first)."""
        for fd in self.procs_fds:
            os.close(fd)
        self.procs_fds = []
        gone = _remove_dirs(self.dirs)
        if gone and self in self.tree.slots:
            self.tree.slots.remove(self)
        return gone
