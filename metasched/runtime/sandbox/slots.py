"""The cgroup slots of the dispatcher's commands: taken from a sandbox's pool (or the
host commands' one) and configured for each command, killed and reused once empty, dropped
when they will not empty or their sandbox is gone."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Sequence

from metasched.runtime.sandbox.cgroups import CgroupTree, Slot
from metasched.runtime.sandbox.handles import Sandbox

log = logging.getLogger("metasched.dispatch")

_MB = 1 << 20
_SLOT_EMPTY_WAIT_S = 5.0  # how long a killed slot may take to empty before it is dropped


class SlotKeeping:
    """The slots part of :class:`~metasched.runtime.sandbox.manager.Sandboxes`, which
    holds the state it uses: ``tree`` (None: no cgroups), ``_host_slots`` (free slots of
    commands run on the host), ``_stuck`` (slots that would not empty: removed at
    close) and ``_loop``."""

    tree: CgroupTree | None
    _host_slots: list[Slot]
    _stuck: list[Slot]
    _loop: asyncio.AbstractEventLoop | None

    # --- slots of commands run on the host (isolation off) ------------------------------

    def host_slot(self, cores: Sequence[int], mem_limit_mb: float | None,
                  pids_max: int | None) -> Slot | None:
        """A slot for a command started on the host (it is moved in after its start:
        the caller pins it by affinity first); None without cgroups.

        Raises:
            OSError: the kernel refused a value.
        """
        slot = self._take_slot(self._host_slots)
        if slot is not None:
            try:
                slot.configure(cores, _bytes(mem_limit_mb), pids_max)
            except BaseException:
                self._host_slots.append(slot)
                raise
        return slot

    def release_host_slot(self, slot: Slot) -> None:
        """Kill what is left in ``slot`` and reuse it once empty."""
        self._release(slot, lambda s: s is not None and self._host_slots.append(s))

    # --- slots --------------------------------------------------------------------------

    def _release(self, slot: Slot | None, then: Callable[[Slot | None], None],
                 left_s: float = _SLOT_EMPTY_WAIT_S) -> None:
        """Kill the slot's processes; call ``then(slot)`` once it is empty, or
        ``then(None)`` if it does not empty in time (it is dropped)."""
        if slot is None:
            then(None)
            return
        if slot.empty():
            then(slot)
            return
        slot.kill()
        if left_s > 0 and self._loop is not None and not self._loop.is_closed():
            self._loop.call_later(0.005, self._release, slot, then, left_s - 0.005)
            return
        log.warning("a command's cgroup still holds processes %g s after it was killed; "
                    "not reused", _SLOT_EMPTY_WAIT_S)
        self._stuck.append(slot)
        then(None)

    def _take_slot(self, pool: list[Slot]) -> Slot | None:
        if self.tree is None:
            return None
        if pool:
            return pool.pop()
        return self.tree.new_slot()

    def _give_slot(self, sb: Sandbox | None, slot: Slot) -> None:
        if sb is None:
            self._host_slots.append(slot)
        elif sb.closed:
            self._drop_slot(slot)
        else:
            sb.free_slots.append(slot)

    def _confine_box(self, sb: Sandbox) -> None:
        """Configure a gVisor sandbox's slot (its whole container: gVisor's kernel runs
        every command's threads) for the commands running in it: the union of their
        cores (every core of this process while none runs), their memory limits on top
        of what the container holds now (no limit where a command has none, or while
        none runs), and no pids limit (gVisor's own threads count there)."""
        slot = sb.box_slot
        if slot is None:
            return
        cores = sorted({c for cs, _ in sb.grants.values() for c in cs}) or sorted(
            os.sched_getaffinity(0))
        mems = [m for _, m in sb.grants.values()]
        mem = None if any(m == 0 for m in mems) or not mems else sum(mems)
        try:
            slot.configure(cores, mem, None)
        except OSError as e:  # e.g. a limit below what it holds now: the last one stays
            log.debug("gVisor sandbox %d: cannot set its cgroup: %s", sb.sid, e)

    def _drop_slot(self, slot: Slot) -> None:
        if not slot.remove():
            self._stuck.append(slot)

def _bytes(mb: float | None) -> int | None:
    return None if mb is None else int(mb * _MB)
