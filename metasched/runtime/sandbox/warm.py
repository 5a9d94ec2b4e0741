"""Warm gVisor sandboxes: containers started ahead, containers wiped and reused, and a
cap on containers starting at once on the node.

A part of :class:`~metasched.runtime.sandbox.manager.Sandboxes` (which holds the state it
uses), for ``isolation: gvisor`` only. The *common kinds* of sandbox are those without
network or template: a trajectory's (``workspace_mb``, or the size its first command
asks) and a trajectory-less command's (``scratch_mb``).

- **Started ahead** (``sandbox.gvisor_warm: N``): ``N`` sandboxes of each of the two
  default sizes are kept started, or kept idle once wiped. Each is a whole sandbox
  already (its own user id, workspace and container); taking one gives it its owner and
  starts another.
- **Reused** (``sandbox.gvisor_reuse``, on by default): a sandbox of a common kind
  whose trajectory is closed, or whose trajectory-less command ended, is wiped
  (:func:`.gvisor_exec.wipe`, forked by the sandbox's exec server as the sandbox's
  user: every process killed, ``/workspace``, ``/tmp`` and ``/dev/shm`` emptied,
  checked) instead of closed, and serves the next sandbox of its kind asked
  for: one waiting for its container's start is given it (and its start dropped), or
  it waits idle for the next one asked. A sandbox whose wipe fails is closed. Idle
  ones beyond ``gvisor_warm`` are closed after :data:`IDLE_S` unused. The pool is so
  sized by demand: it grows while sandboxes are asked faster than wiped ones come
  back, and shrinks when they are not asked.
- **Capped starts** (``sandbox.gvisor_starts``): at most that many containers start at
  once on the node; the others wait their turn, in order. While a sandbox of the same
  kind is being wiped (and will serve the first one waiting), a sandbox of that kind
  waits rather than start: a burst of stateless requests costs a few container starts,
  not one each.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import Any

from metasched.runtime.sandbox.handles import Sandbox, Started
from metasched.runtime.sandbox.slots import _MB

log = logging.getLogger("metasched.dispatch")

IDLE_S = 30.0  # an idle wiped sandbox beyond gvisor_warm is closed after this


def _kind(sb: Sandbox) -> int | None:
    """``sb``'s common kind (its size), None where it is not one (network, a template,
    a GPU's)."""
    if sb.network or sb.template is not None or sb.parent is not None:
        return None
    return sb.size_bytes


class WarmPool:
    """The warm-sandbox part of :class:`~metasched.runtime.sandbox.manager.Sandboxes`."""

    config: Any
    gvisor: Any
    uids: Any
    _loop: asyncio.AbstractEventLoop | None
    _warm: dict[int, list[Sandbox]]
    _sandboxes: dict[str, Sandbox]
    # (set up by _pool_init)
    _idle: dict[int, list[Sandbox]]  # wiped sandboxes by kind, ready
    _wiping: dict[int, int]  # sandboxes being wiped, by kind
    _starting: int  # containers starting now
    _turns: list[tuple[Sandbox, Callable[[], None]]]  # starts waiting for a turn

    def _new(self, key: str, size_mb: float, template: Any, network: bool) -> Sandbox: ...
    def close_sandbox(self, sb: Sandbox) -> None: ...
    def start(self, sb: Sandbox | None, **kw: Any) -> Started: ...
    def on_exit(self, started: Started, handler: Callable[[dict[str, Any]], None]) -> None: ...
    def finished(self, sb: Sandbox | None, started: Started) -> None: ...

    def _pool_init(self) -> None:
        self._idle, self._wiping, self._turns, self._starting = {}, {}, [], 0

    # --- started ahead ------------------------------------------------------------------

    def _warm_sizes(self) -> list[int]:
        return sorted({int(self.config.workspace_mb * _MB), int(self.config.scratch_mb * _MB)})

    def _warm_fill(self) -> None:
        """Start sandboxes until each kind has ``gvisor_warm`` started or idle (on the
        attached loop)."""
        if self.gvisor is None or self._loop is None or not self.config.gvisor_warm:
            return
        for size in self._warm_sizes():
            pool = self._warm.setdefault(size, [])
            while len(pool) + len(self._idle.get(size, ())) < self.config.gvisor_warm:
                pool.append(self._new("", size / _MB, None, False))

    def _warm_take(self, size_mb: float, template: Any, network: bool) -> Sandbox | None:
        """A wiped or warm sandbox of this kind (ready, or being started), another
        started in its place; None where there is none."""
        if template is not None or network:
            return None
        size = int(size_mb * _MB)
        idle = self._idle.get(size, [])
        while idle:
            sb = idle.pop()
            if not sb.closed:
                return sb
        pool = self._warm.get(size, [])
        while pool:
            sb = pool.pop(0)
            if sb.closed or (sb.ready.done() and sb.ready.exception() is not None):
                continue  # it failed: the next one, or one made now
            if self._loop is not None:
                self._loop.call_soon(self._warm_fill)
            return sb
        return None

    # --- capped starts ------------------------------------------------------------------

    def _start_turn(self, sb: Sandbox, start: Callable[[], None]) -> None:
        """Start ``sb``'s container now, or in its turn (the module docstring)."""
        self._turns.append((sb, start))
        self._next_turns()

    def _next_turns(self) -> None:
        """Start the sandboxes whose turn it is."""
        if self._starting >= self.config.gvisor_starts or not self._turns:
            return
        keep: list[tuple[Sandbox, Callable[[], None]]] = []
        for n, (sb, start) in enumerate(self._turns):
            if self._starting >= self.config.gvisor_starts:
                keep += self._turns[n:]
                break
            if sb.closed:
                continue
            kind = _kind(sb)
            if kind is not None and self._wiping.get(kind):
                keep.append((sb, start))  # a wiped one is coming
                continue
            sb.starting = True
            self._starting += 1
            start()
        self._turns = keep

    def _start_ended(self, sb: Sandbox) -> None:
        """``sb``'s start ended (ready, failed or closed): the next one's turn."""
        if not sb.starting:
            return
        sb.starting = False
        self._starting -= 1
        self._next_turns()

    # --- reused -------------------------------------------------------------------------

    def _reusable(self, sb: Sandbox) -> bool:
        """Whether ``sb`` (its commands ended or ending) may be wiped for another."""
        return (self.gvisor is not None and bool(self.config.gvisor_reuse)
                and _kind(sb) is not None and not sb.closed and sb.ready.done()
                and sb.ready.exception() is None)

    def _recycle(self, sb: Sandbox) -> None:
        """Wipe ``sb`` (nothing runs in it) for the next sandbox of its kind."""
        if self._sandboxes.get(sb.key) is sb:
            del self._sandboxes[sb.key]
        sb.key, sb.throwaway = "", True  # (its wipe runs as its user)
        kind = _kind(sb)
        assert kind is not None
        self._wiping[kind] = self._wiping.get(kind, 0) + 1
        null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        try:
            started = self.start(sb, argv=["(wipe)"], env={b"PATH": b"/usr/bin:/bin"},
                                 cores=sorted(os.sched_getaffinity(0)), mem_limit_mb=None,
                                 pids_max=16, out_w=null, err_w=null, wait=False, wipe=True)
        except OSError as e:
            log.debug("gVisor sandbox %d: cannot wipe it: %s", sb.sid, e)
            self._wiped(sb, kind, False)
            return
        finally:
            os.close(null)
        done: list[bool] = []

        def ended(status: int) -> None:
            if done:
                return
            done.append(True)
            if status != 0:
                log.debug("gVisor sandbox %d: its wipe failed (status %d)", sb.sid, status)
            self.finished(sb, started)
            self._wiped(sb, kind, status == 0)

        self.on_exit(started, lambda ev: ended(ev.get("status", -1)))
        assert started.spawned is not None
        started.spawned.add_done_callback(
            lambda f: f.exception() is not None and ended(-1))

    def _wiped(self, sb: Sandbox, kind: int, ok: bool) -> None:
        """``sb``'s wipe ended: it serves the first sandbox of its kind waiting for a
        start, or waits idle; closed if the wipe failed."""
        self._wiping[kind] -= 1
        sb.throwaway = False
        if not ok or sb.closed:
            self.close_sandbox(sb)
            self._next_turns()
            return
        for n, (waiting, _) in enumerate(self._turns):
            if not waiting.closed and _kind(waiting) == kind:
                del self._turns[n]
                self._bind(waiting, sb)
                self._next_turns()
                return
        assert self._loop is not None
        sb.idle_since = self._loop.time()
        self._idle.setdefault(kind, []).append(sb)
        self._loop.call_later(IDLE_S, self._trim)
        self._next_turns()

    def _bind(self, waiting: Sandbox, box: Sandbox) -> None:
        """Make ``waiting`` (not started) the handle of wiped ``box``, whose own handle
        is dropped (nothing else refers to it)."""
        self.uids.give(waiting.uid)  # (it takes the box's)
        waiting.sid, waiting.uid, waiting.box_slot = box.sid, box.uid, box.box_slot
        waiting.free_slots, waiting.seeded, waiting.init_pid = (
            box.free_slots, box.seeded, box.init_pid)
        box.closed, box.retired, box.box_slot, box.free_slots = True, True, None, []
        waiting.ready.set_result(None)

    def _trim(self) -> None:
        """Close the idle sandboxes unused for :data:`IDLE_S` beyond ``gvisor_warm``."""
        assert self._loop is not None
        now = self._loop.time()
        for idle in self._idle.values():
            idle.sort(key=lambda s: s.idle_since)
            while (len(idle) > self.config.gvisor_warm
                   and now - idle[0].idle_since >= IDLE_S - 1e-3):
                self.close_sandbox(idle.pop(0))

    def _pool_close(self) -> None:
        """The end: idle sandboxes are closed with the server."""
        for idle in self._idle.values():
            for sb in idle:
                sb.closed = True
        self._idle.clear()
        self._turns.clear()
