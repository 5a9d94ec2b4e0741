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
"""

from __future__ import annotations

import errno
import os
import secrets
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["CONTROLLERS", "CgroupTree", "Hierarchies", "Slot", "discover"]

CONTROLLERS = ("cpuset", "memory", "pids")
_UNLIMITED_V1 = "-1"
_KILL_ROUNDS = 200  # v1 without cgroup.kill: kill passes before giving up


@dataclass
class Hierarchies:
    """Where each controller can be used, as found on this host.

    Attributes:
        v2: the cgroup v2 directory to make subtrees in (None: no writable v2).
        v2_controllers: controllers usable below ``v2``.
        v1: controller name -> the v1 directory this process is in (writable ones only).
        missing: controller -> why it is unavailable (every controller not placed).
        favordynmods: whether a cgroup hierarchy is mounted with ``favordynmods``
            (Linux >= 6.0). Without it, moving a process into a cgroup after some idle
            time waits for an RCU grace period (milliseconds: the lock that guards
            migrations is put back into its fast-reader mode when unused); with
            it migrations stay cheap, at a small cost to every fork and exit.
    """

    v2: str | None = None
    v2_controllers: set[str] = field(default_factory=set)
    v1: dict[str, str] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)
    favordynmods: bool = False

    def placement(self) -> dict[str, str]:
        """controller -> ``"v2"`` or ``"v1"`` for every available controller."""
        out = {}
        for c in CONTROLLERS:
            if c in self.v2_controllers:
                out[c] = "v2"
            elif c in self.v1:
                out[c] = "v1"
        return out

    def describe(self) -> str:
        """One line: which controllers come from where, and what kills a slot."""
        place = self.placement()
        parts = []
        for version in ("v2", "v1"):
            names = [c for c in CONTROLLERS if place.get(c) == version]
            if names:
                parts.append(f"{version} ({', '.join(names)})")
        kill = "v2 cgroup.kill" if self.v2 else "freezing forks (pids.max 0), then SIGKILL"
        text = " + ".join(parts) if parts else "no controllers"
        if self.missing:
            text += "; missing " + ", ".join(f"{c} ({why})" for c, why in self.missing.items())
        return f"{text}; slots killed by {kill}"


def _lines(path: str) -> list[str]:
    """The lines of a /proc file ([] if unreadable)."""
    try:
        with open(path) as f:
            return f.read().splitlines()
    except OSError:
        return []


def _favordynmods() -> bool:
    """Whether some cgroup hierarchy is mounted with ``favordynmods`` (the migration
    lock's mode is global, so one is enough)."""
    for line in _lines("/proc/self/mountinfo"):
        _, _, right = line.partition(" - ")
        rest = right.split()
        if len(rest) >= 3 and rest[0] in ("cgroup", "cgroup2") and \
                "favordynmods" in rest[2].split(","):
            return True
    return False


def _mounts() -> tuple[str | None, dict[str, str]]:
    """(cgroup2 mount point, {v1 controller: mount point}) from /proc/self/mountinfo
    (mounts whose root is the hierarchy's root only)."""
    v2: str | None = None
    v1: dict[str, str] = {}
    for line in _lines("/proc/self/mountinfo"):
        left, _, right = line.partition(" - ")
        fields, rest = left.split(), right.split()
        if len(fields) < 5 or len(rest) < 3 or fields[3] != "/":
            continue
        point, fstype, options = fields[4], rest[0], rest[2].split(",")
        if fstype == "cgroup2" and v2 is None:
            v2 = point
        elif fstype == "cgroup":
            for c in CONTROLLERS:
                if c in options and c not in v1:
                    v1[c] = point
    return v2, v1


def _own_paths() -> tuple[str | None, dict[str, str]]:
    """(this process's v2 cgroup path, {v1 controller: path}) from /proc/self/cgroup."""
    v2: str | None = None
    v1: dict[str, str] = {}
    for line in _lines("/proc/self/cgroup"):
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, names, path = parts
        if names == "":
            v2 = path
        for c in names.split(","):
            if c in CONTROLLERS:
                v1[c] = path
    return v2, v1


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def discover(mode: str = "auto", v2_parent: str | None = None) -> Hierarchies:
    """Find the controllers this process can use.

    Args:
        mode: ``"auto"`` (each controller from v2 where enabled, else v1), ``"v2"`` or
            ``"v1"`` (that version only), ``"none"`` (no cgroups).
        v2_parent: a cgroup v2 directory delegated to this process; default: the v2
            directory this process is in, when that is the root or already delegates
            controllers to its children.
    """
    h = Hierarchies()
    if mode == "none":
        h.missing = dict.fromkeys(CONTROLLERS, "cgroups are off")
        return h
    v2_mount, v1_mounts = _mounts()
    v2_own, v1_own = _own_paths()
    h.favordynmods = _favordynmods()
    if mode in ("auto", "v2"):
        _find_v2(h, v2_mount, v2_own, v2_parent)
    if mode in ("auto", "v1"):
        for c in CONTROLLERS:
            if c in h.v2_controllers:
                continue
            point = v1_mounts.get(c)
            if point is None or c not in v1_own:
                h.missing.setdefault(c, "no cgroup v1 hierarchy mounted")
                continue
            path = os.path.join(point, v1_own[c].lstrip("/"))
            if not os.access(path, os.W_OK):
                h.missing.setdefault(c, f"{path} is not writable")
                continue
            h.v1[c] = path
            h.missing.pop(c, None)
    for c in CONTROLLERS:
        if c not in h.v2_controllers and c not in h.v1:
            h.missing.setdefault(c, "not available")
    if mode == "v1":
        h.v2, h.v2_controllers = None, set()
    return h


def _find_v2(h: Hierarchies, mount: str | None, own: str | None,
             parent: str | None) -> None:
    is_root = parent is None and own in ("/", "")
    if parent is None:
        if mount is None or own is None:
            for c in CONTROLLERS:
                h.missing[c] = "no cgroup v2 mounted"
            return
        parent = os.path.join(mount, own.lstrip("/"))
    try:
        available = set(_read(os.path.join(parent, "cgroup.controllers")).split())
        enabled = set(_read(os.path.join(parent, "cgroup.subtree_control")).split())
    except OSError:
        for c in CONTROLLERS:
            h.missing[c] = f"{parent} is not a cgroup v2 directory"
        return
    if not os.access(parent, os.W_OK):
        for c in CONTROLLERS:
            h.missing[c] = f"{parent} is not writable"
        return
    h.v2 = parent
    for c in CONTROLLERS:
        if c not in available:
            h.missing[c] = f"not enabled in {parent} (cgroup.controllers)"
            continue
        if c not in enabled:
            try:
                _write(os.path.join(parent, "cgroup.subtree_control"), f"+{c}")
            except OSError as e:
                # A non-root cgroup holding processes cannot delegate domain
                # controllers to children (the "no internal processes" rule).
                why = e.strerror or str(e)
                hint = "" if is_root else " (give a delegated cgroup_parent)"
                h.missing[c] = f"cannot enable it below {parent}: {why}{hint}"
                continue
        h.v2_controllers.add(c)


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
        return (self.oom_kills() > self._oom_base, self.pids_refused() > self._pids_base)

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


def _counter(path: str, key: str) -> int:
    """The ``key N`` line of a flat-keyed cgroup file (0 if absent)."""
    try:
        text = _read(path)
    except OSError:
        return 0
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            try:
                return int(value)
            except ValueError:
                return 0
    return 0


def _remove_dirs(dirs: dict[str, str]) -> bool:
    """Remove each directory of ``dirs`` (forgetting those removed); whether all are."""
    for key in list(dirs):
        if remove_dir(dirs[key]):
            del dirs[key]
    return not dirs


def remove_dir(path: str) -> bool:
    """rmdir a cgroup directory (children first); whether it is gone. A cgroup still
    holding processes stays."""
    try:
        entries = os.scandir(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    with entries:
        children = [e.path for e in entries if e.is_dir(follow_symlinks=False)]
    for child in children:
        remove_dir(child)
    try:
        os.rmdir(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def kill_members(path: str, timeout_s: float = 2.0) -> bool:
    """SIGKILL every process in the cgroup directory ``path`` (not its children) and
    wait for them to be gone; whether it emptied."""
    kill = os.path.join(path, "cgroup.kill")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            pids = [int(x) for x in _read(os.path.join(path, "cgroup.procs")).split()]
        except OSError:
            return True
        if not pids:
            return True
        if os.path.exists(kill):
            try:
                _write(kill, "1")
            except OSError:
                pass
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
