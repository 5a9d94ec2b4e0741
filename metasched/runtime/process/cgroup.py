"""Optional cgroup v2 confinement of each action to its granted cores.

Affinity set by ``sched_setaffinity`` can be widened again by the child itself; a
cpuset cgroup cannot. Where ``/sys/fs/cgroup`` is cgroup v2 and the operator has
delegated a writable parent cgroup with the ``cpuset`` controller,
``run_process(..., cgroup=CpusetCgroup(parent))`` moves each action into its own child
cgroup whose ``cpuset.cpus`` are the granted cores, and removes it afterwards
(``cgroup.kill`` first, which also ends processes that escaped the group with
``setsid``). The child is pinned by affinity before it runs, so the short time before
it is moved in is covered. Anywhere else (cgroup v1, no delegation) it is a no-op whose
:meth:`CpusetCgroup.available` says why; it never fails an action.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from pathlib import Path

__all__ = ["CpusetCgroup", "release_cgroup"]


class CpusetCgroup:
    """Optional per-action cgroup v2 with ``cpuset.cpus`` = the granted cores.

    ``parent`` is a cgroup v2 directory delegated to this process (writable, listing
    ``cpuset`` in ``cgroup.controllers``). Where that does not hold, every method is a
    no-op and :meth:`available` says why.
    """

    def __init__(self, parent: str | os.PathLike[str]) -> None:
        self.parent = Path(parent)
        self._available = self._probe()

    def available(self) -> tuple[bool, str]:
        """(usable, why not — or "ok")."""
        return self._available

    def _probe(self) -> tuple[bool, str]:
        controllers = self.parent / "cgroup.controllers"
        try:
            names = controllers.read_text().split()
        except OSError:
            return False, f"{self.parent} is not a cgroup v2 directory"
        if "cpuset" not in names:
            return False, f"the cpuset controller is not delegated to {self.parent}"
        if not os.access(self.parent, os.W_OK):
            return False, f"{self.parent} is not writable"
        subtree = self.parent / "cgroup.subtree_control"
        try:
            if "cpuset" not in subtree.read_text().split():
                subtree.write_text("+cpuset")
        except OSError as exc:
            return False, f"cannot enable cpuset below {self.parent}: {exc.strerror or exc}"
        return True, "ok"

    def confine(self, pid: int, cores: Sequence[int]) -> Path | None:
        """Move ``pid`` into a new child cgroup limited to ``cores``; its path, or None
        when unavailable or when any step fails (the action runs unconfined)."""
        if not self._available[0]:
            return None
        path = self.parent / f"action-{pid}"
        try:
            path.mkdir()
        except OSError:
            return None
        try:
            (path / "cpuset.cpus").write_text(",".join(str(c) for c in cores))
            (path / "cgroup.procs").write_text(str(pid))
        except OSError:
            self.release(path)
            return None
        return path

    def release(self, path: Path) -> bool:
        """Kill what is left in the cgroup and remove it; whether it is gone."""
        kill = path / "cgroup.kill"  # Linux >= 5.14
        if kill.exists():
            try:
                kill.write_text("1")
            except OSError:
                pass
        try:
            path.rmdir()
        except FileNotFoundError:
            return True
        except OSError:
            return False
        return True


def release_cgroup(loop: asyncio.AbstractEventLoop, cgroup: CpusetCgroup, path: Path) -> None:
    """Release an action's cgroup now, or once more shortly if it is still busy."""
    if not cgroup.release(path):
        # Killed processes leave the cgroup asynchronously: rmdir may need a moment.
        loop.call_later(0.5, cgroup.release, path)
