"""What a dispatcher made on the machine, recorded so that the next one removes exactly
that after a crash, and nothing else.

Each dispatcher makes one run directory, ``<root>/metasched-run-<pid>-<random>``
(``root``: ``/dev/shm`` by default), and writes a marker file in it holding its pid, the
pid's start time (so a reused pid is not taken for the dispatcher) and every other
directory it made (its cgroups). Commands' scratch directories go inside the run
directory. At start, :func:`remove_dead_runs` looks at each ``metasched-run-*`` entry of
``root``: one whose marker names a dispatcher that is no longer running is removed,
with the cgroups its marker lists (processes left in them are killed first). An entry
without a readable marker is left alone, whatever its name: recovery never guesses what
is its own.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Iterable

from metasched.runtime.sandbox import cgroups

__all__ = ["MARKER", "RunDirectory", "remove_dead_runs"]

MARKER = ".metasched-run.json"
_PREFIX = "metasched-run-"


def _start_time(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (clock ticks after boot), None if no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    try:
        return int(data[data.rfind(b")") + 2:].split()[19])
    except (IndexError, ValueError):
        return None


class RunDirectory:
    """This dispatcher's run directory and its marker (see the module docstring).

    Raises:
        OSError: ``root`` is not writable.
    """

    def __init__(self, root: str) -> None:
        self.root = root
        pid = os.getpid()
        self.path = os.path.join(root, f"{_PREFIX}{pid}-{secrets.token_hex(4)}")
        os.mkdir(self.path, 0o700)
        self._doc = {"pid": pid, "start_time": _start_time(pid), "cgroups": []}
        self._write()

    def record(self, directories: Iterable[str]) -> None:
        """Add directories (cgroups) this dispatcher made, to be removed after a crash."""
        self._doc["cgroups"] = sorted({*self._doc["cgroups"], *directories})
        self._write()

    def _write(self) -> None:
        tmp = os.path.join(self.path, MARKER + ".tmp")
        with open(tmp, "w") as f:
            json.dump(self._doc, f)
        os.replace(tmp, os.path.join(self.path, MARKER))

    def remove(self) -> None:
        """Remove the run directory (at a clean exit; its cgroups are removed by their
        owner)."""
        shutil.rmtree(self.path, ignore_errors=True)


def remove_dead_runs(root: str) -> list[str]:
    """Remove the run directories under ``root`` (and the cgroups they list) whose
    dispatcher is gone; the run directories removed."""
    removed: list[str] = []
    try:
        entries = [e for e in os.scandir(root) if e.name.startswith(_PREFIX)]
    except OSError:
        return removed
    for entry in entries:
        if entry.is_symlink() or not entry.is_dir():
            continue
        try:
            with open(os.path.join(entry.path, MARKER)) as f:
                doc = json.load(f)
            pid, started = int(doc["pid"]), doc.get("start_time")
            made = [str(p) for p in doc.get("cgroups", [])]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a run directory this code made
        if pid == os.getpid() or (_start_time(pid) is not None and _start_time(pid) == started):
            continue  # its dispatcher is alive
        for path in made:
            _remove_cgroup_tree(path)
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    return removed


def _remove_cgroup_tree(path: str) -> None:
    """Kill every process below the cgroup ``path``, then remove it (children first)."""
    if not path.startswith("/sys/fs/cgroup/") or not os.path.isdir(path):
        return
    for root, dirs, _ in os.walk(path):
        for d in [root, *(os.path.join(root, x) for x in dirs)]:
            cgroups.kill_members(d)
    cgroups.remove_dir(path)
