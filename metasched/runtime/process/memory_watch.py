"""The memory watchdog: kills a process group whose resident memory exceeds its limit.

``RLIMIT_AS`` (see :mod:`.limits`) is per process, so a command that forks N workers
may use N times the limit. While memory-limited actions run, one pass over
``/proc/*/stat`` every 50 ms, shared by every action of the event loop (~10 us per
process on the machine; on a node with thousands of processes the passes are spaced out
to take at most ~5% of the loop thread), sums the anonymous resident memory of each
action's process group (``/proc/<pid>/statm``: resident minus file-backed, so shared
libraries are not counted once per process) and kills a group above its limit, which
makes the reason definitive. psutil was considered, but it has no process-group
accessor, so it would cost a ``getpgid`` call per process on top of its own reads.
Pages shared copy-on-write after ``fork`` are counted once per process, an overestimate
the limit errs on the safe side of. The rlimit stays the first line: a single process's
resident memory cannot outgrow its address space, so the watchdog only ever fires for
groups, and allocations between two passes are not seen.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterable

from metasched.runtime.process.fd_watch import PerLoop

__all__ = ["MemoryWatch", "group_anon_rss"]

_WATCH_INTERVAL_S = 0.05  # period of the passes over /proc


class MemoryWatch(PerLoop):
    """Kills process groups whose anonymous resident memory exceeds their limit.

    One instance per event loop; it ticks (``call_later``, no task to cancel at
    shutdown) only while some group is watched, and each tick makes a single pass over
    ``/proc`` for all watched groups.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self.groups: dict[int, tuple[int, Callable[[], None]]] = {}
        self.handle: asyncio.TimerHandle | None = None
        self.page = os.sysconf("SC_PAGE_SIZE")

    def add(self, pgid: int, limit_bytes: int, on_exceed: Callable[[], None]) -> None:
        self.groups[pgid] = (limit_bytes, on_exceed)
        loop = self.loop()
        if self.handle is None and loop is not None:
            self.handle = loop.call_later(_WATCH_INTERVAL_S, self._tick)

    def remove(self, pgid: int) -> None:
        self.groups.pop(pgid, None)
        if not self.groups and self.handle is not None:
            self.handle.cancel()
            self.handle = None

    def _tick(self) -> None:
        self.handle = None
        started = time.perf_counter()
        usage = group_anon_rss(self.groups.keys(), self.page)
        for pgid, used in usage.items():
            entry = self.groups.get(pgid)
            if entry is not None and used > entry[0]:
                entry[1]()
        loop = self.loop()
        if self.groups and loop is not None:
            # A pass costs ~10 us per process on the machine: on a node running
            # thousands, space the passes out so they take at most ~5% of this thread.
            delay = max(_WATCH_INTERVAL_S, 20 * (time.perf_counter() - started))
            self.handle = loop.call_later(delay, self._tick)


def group_anon_rss(pgids: Iterable[int], page_size: int | None = None) -> dict[int, int]:
    """Anonymous resident bytes of each process group in ``pgids`` (one ``/proc`` pass).

    Processes that vanish during the pass are skipped. Groups with no live member are
    absent from the result.
    """
    wanted = set(pgids)
    page = page_size or os.sysconf("SC_PAGE_SIZE")
    totals: dict[int, int] = {}
    if not wanted:
        return totals
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        stat_bytes = _read_proc(f"/proc/{name}/stat")
        if stat_bytes is None:
            continue
        # The command name (field 2) may contain spaces and ')': split after the last ')'.
        fields = stat_bytes[stat_bytes.rfind(b")") + 2:].split()
        try:
            pgrp = int(fields[2])
        except (IndexError, ValueError):
            continue
        if pgrp not in wanted:
            continue
        statm = _read_proc(f"/proc/{name}/statm")
        if statm is None:
            continue
        parts = statm.split()
        # statm: size resident shared ...; shared = file-backed + shmem resident pages.
        anon = max(0, int(parts[1]) - int(parts[2])) * page
        totals[pgrp] = totals.get(pgrp, 0) + anon
    return totals


def _read_proc(path: str) -> bytes | None:
    # os.open/os.read rather than open(): no buffered file object per read, and a
    # process that exited between listdir and here is simply skipped.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
