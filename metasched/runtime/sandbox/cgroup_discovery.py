"""Which cgroup controllers this process can use, and where: :func:`discover` reads
``/proc/self/mountinfo`` and ``/proc/self/cgroup`` and returns :class:`Hierarchies`
(each controller from cgroup v2 where it is enabled in the v2 directory the dispatcher
may use, else from its writable cgroup v1 hierarchy; why each missing one is missing)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from metasched.runtime.sandbox.cgroup_files import _read, _write

CONTROLLERS = ("cpuset", "memory", "pids")


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
