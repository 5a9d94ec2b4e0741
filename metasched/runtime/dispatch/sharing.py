"""Deadlines and time-sharing on the live clock: no caller times out on a silent
dispatcher, and no granted core that sits idle keeps a command waiting.

- **Deadlines.** A request's ``deadline_s`` (or ``deadlines.default_s``) is when its
  caller stops waiting; a cpu command still queued when only its ``timeout_s`` and
  ``deadlines.margin_s`` are left before then (its latest start, the core's
  :mod:`metasched.core.deadlines`) starts on free cores if there are any, else
  time-shared: on the cores with the fewest commands already sharing them, beside the
  commands granted them (its cpuset overlaps theirs; the kernel's fair scheduler
  divides the cores among all of them, as on any oversubscribed host). Its wall-clock
  limit then ends it, with its result or a "time limit", before the deadline. With
  ``deadlines.on_deadline: refuse`` it is failed then instead (``deadline: ...``).
  Commands on a backend's nodes (Ray) do not time-share: there a command at its latest
  start waits its turn, unless refused.
  A command recovered from the journal after a restart has ``deadlines.recovered_s``
  from the restart to start, and is refused then (its caller's connection has gone).
  A trajectory's first command waiting for sandbox memory at its latest
  start gets its sandbox then, the memory overcommitted (a workspace's size caps what
  it may hold; what it holds is mostly far less), as a host runs more sandboxes than
  their caps add up to.
- **Idle grants.** While commands wait for cores, the CPU time of each running command
  (its cgroup's ``cpu.stat``) is read every ``idle_after_s / 2``; a core on which every
  command has run ``idle_after_s`` and used under ``idle_cpu`` of its cores' time in the
  last reading is idle, and the oldest waiting command is started time-shared on it. A
  lent core's commands share it if they wake up. Needs cgroup v2 accounting (any v2
  directory the dispatcher can write, controllers or not); without it nothing is lent.

The core's state counts a time-shared command as running without cores of the pool
(``Action.shared``), so the scheduler's view stays what it grants.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any, Protocol

from metasched.core.actions import PENDING, Action
from metasched.core.deadlines import DeadlineRule, serve_due
from metasched.runtime.dispatch.executors.base import Executors
from metasched.runtime.dispatch.jobs import Job
from metasched.runtime.dispatch.sandbox_gate import SandboxGate
from metasched.runtime.dispatch.shared import Shared
from metasched.runtime.outcome import Outcome


class SharingHost(Shared, Protocol):
    """What the deadline rule and core lending ask of their dispatcher
    (the :class:`~.dispatcher.Dispatcher`)."""

    cores: list[int]
    executors: Executors
    gate: SandboxGate

    def complete(self, job: Job, out: Outcome) -> None: ...


log = logging.getLogger("metasched.dispatch")

DEADLINE_REASON = "deadline:"  # the start of a refused command's reason


class _Watch:
    """A running command whose CPU use is measured."""

    __slots__ = ("proc", "cores", "started", "cpu", "at", "idle")

    def __init__(self, proc: Any, cores: list[int], now: float) -> None:
        self.proc = proc
        self.cores = cores
        self.started = now
        self.cpu: float | None = None  # CPU seconds at ``at`` (None: not read yet)
        self.at = now
        self.idle = False


class Sharing:
    """Dispatcher ``d``'s deadline rule and core lending (see the module docstring)."""

    def __init__(self, d: SharingHost) -> None:
        self.d = d
        self.cfg = d.config.deadlines
        self.rule = DeadlineRule()
        self.sharers: dict[int, int] = {}  # core id -> time-shared commands on it
        self.watched: dict[str, _Watch] = {}  # request id -> its running command
        self.n_shared = 0  # started time-shared at their latest start
        self.n_lent = 0  # started time-shared on idle cores
        self.n_refused = 0
        self._probe: asyncio.Task | None = None
        self.n_overcommitted = 0  # sandboxes opened past the memory pool at a deadline
        self._box_due = math.inf  # when the next sandbox waiter is due (state time)
        self._box_seen = 0  # trajectories waiting for memory at the last walk

    # ------------------------------------------------------------ deadlines

    def start_by(self, job: Job) -> float | None:
        """The latest start of ``job`` after its acceptance (None: no deadline)."""
        req = job.request
        if req.kind != "cpu":
            return None  # only commands time-share
        if self.recovered(job):  # from the restart on
            due = self.cfg.recovered_s
            return None if due is None else self.d.loop.wall0 - job.queued_at + due
        deadline = req.deadline_s if req.deadline_s is not None else self.cfg.default_s
        if deadline is None:
            return None
        return deadline - req.timeout_s - self.cfg.margin_s

    def recovered(self, job: Job) -> bool:
        """Whether ``job`` was recovered from the journal (accepted before this start)."""
        return job.queued_at < self.d.loop.wall0

    def serve(self) -> None:
        """Act on the commands whose latest start has come (before the scheduler is
        asked, as in simulation), and on the sandboxes they wait for."""
        if self.rule.next_due(self.d.state) is not None:
            serve_due(self.d.state, self.rule, self.d.executors.start, self._due)
        waiting = self.d.gate.wait
        if len(waiting) and (len(waiting) != self._box_seen or self.d.state.t >= self._box_due):
            self._open_due_sandboxes()

    def next_due(self) -> float | None:
        """When the next queued command reaches its latest start (state time)."""
        due = self.rule.next_due(self.d.state)
        if len(self.d.gate.wait) and self._box_due < math.inf:
            due = self._box_due if due is None else min(due, self._box_due)
        return due

    def _open_due_sandboxes(self) -> None:
        """Open the sandboxes of trajectories waiting for memory whose first command
        has reached its latest start (memory overcommitted); note when the next is due."""
        d = self.d
        gate, state = d.gate, d.state
        now = state.t
        nxt = math.inf
        for traj in list(gate.wait):
            jobs = gate.awaiting.get(traj.id)
            start_by = self.start_by(jobs[0]) if jobs else None
            if start_by is None:
                continue
            due = jobs[0].queued_at - d.loop.wall0 + start_by
            if due > now:
                nxt = min(nxt, due)
                continue
            gate.open_overcommitted(traj)
            self.n_overcommitted += 1
        self._box_due, self._box_seen = nxt, len(gate.wait)

    def _due(self, a: Action, node: int) -> None:
        d = self.d
        if self.cfg.on_deadline == "refuse" or self.recovered(d.jobs.of_action(a.id)):
            # A loop turn later: failing it completes it, which schedules again.
            d.loop.call_soon(self._refuse, a)
            return
        if not d.executors.SHARES:
            return  # a backend that cannot time-share (Ray's nodes): it waits its turn
        self.n_shared += 1
        self.share(a, node, self.least_shared(a.spec.min_cores))

    def _refuse(self, a: Action) -> None:
        d = self.d
        if d.loop.closed or a.status != PENDING:
            return  # started meanwhile, or gone
        job = d.jobs.of_action(a.id)
        d.state.advance(d.loop.now())
        d.state.start_shared(a, max(a.node, 0))
        self.n_refused += 1
        waited = d.loop.wall0 + d.state.t - job.queued_at
        why = (f"not started within {self.cfg.recovered_s:g} s of the restart that "
               f"recovered it (deadlines.recovered_s)" if self.recovered(job) else
               f"not started after {waited:.1f} s in the queue, with "
               f"{job.request.timeout_s:g} s to run before its caller's deadline")
        d.complete(job, Outcome(False, f"{DEADLINE_REASON} {why}"))

    def least_shared(self, k: int) -> list[int]:
        """``k`` core ids with the fewest time-shared commands (lowest id on ties)."""
        return sorted(self.d.cores, key=lambda c: (self.sharers.get(c, 0), c))[:k]

    def share(self, a: Action, node: int, cores: list[int]) -> None:
        """Start pending ``a`` time-shared on ``cores`` (of ``node``)."""
        d = self.d
        d.state.start_shared(a, node)
        for c in cores:
            self.sharers[c] = self.sharers.get(c, 0) + 1
        job = d.jobs.of_action(a.id)
        d.executors.mark_started(job, d.loop.wall0 + d.state.t)
        d.executors.start_shared(job, cores, lambda: self._unshare(cores))

    def _unshare(self, cores: list[int]) -> None:
        for c in cores:
            self.sharers[c] -= 1

    # ------------------------------------------------------------ idle grants

    def started(self, job: Job, proc: Any, cores: list[int]) -> None:
        """A command started on ``cores``: its CPU use is measured from now on (one
        that could not start is not)."""
        if isinstance(proc, Exception):
            return
        self.watched[job.request.id] = _Watch(proc, cores, self.d.loop.monotonic())

    def ended(self, job: Job) -> None:
        self.watched.pop(job.request.id, None)

    def start(self) -> None:
        """Start measuring (with the dispatcher's loop)."""
        if self.cfg.idle_share and self.d.executors.SHARES:
            self._probe = asyncio.create_task(self._measure())

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            await asyncio.gather(self._probe, return_exceptions=True)
            self._probe = None

    async def _measure(self) -> None:
        period = self.cfg.idle_after_s / 2
        while True:
            await asyncio.sleep(period)
            if self.d.loop.closed:
                return
            try:
                self.lend()
            except Exception:  # noqa: BLE001 - a failed reading must not stop dispatch
                log.exception("measuring commands' CPU use failed")

    def lend(self) -> int:
        """Read the running commands' CPU use; start waiting commands time-shared on
        idle cores (oldest first). Returns how many started."""
        d = self.d
        state = d.state
        if not state.pending["cpu"]:
            for w in self.watched.values():
                w.cpu = None  # measured afresh once commands wait
            return 0
        now = d.loop.monotonic()
        busy_cores: set[int] = set()
        for w in self.watched.values():
            cpu = w.proc.cpu_seconds()
            if cpu is None or w.cpu is None or now - w.at <= 0:
                w.idle = False
            else:
                used = (cpu - w.cpu) / ((now - w.at) * max(1, len(w.cores)))
                w.idle = now - w.started >= self.cfg.idle_after_s and used < self.cfg.idle_cpu
            w.cpu, w.at = cpu, now
            if not w.idle:
                busy_cores.update(w.cores)
        idle = [c for w in self.watched.values() if w.idle for c in w.cores
                if c not in busy_cores]
        idle = sorted(set(idle), key=lambda c: (self.sharers.get(c, 0), c))
        n = 0
        state.advance(d.loop.now())
        for a in list(state.pending["cpu"].values()):
            k = a.spec.min_cores
            if k > len(idle) or (a.node >= 0 and a.node != 0):
                continue
            cores, idle = idle[:k], idle[k:]
            self.n_lent += 1
            self.share(a, 0, cores)
            for c in cores:  # what it does there is measured before lending it again
                busy_cores.add(c)
            n += 1
            if not idle:
                break
        if n:
            d.loop.kick()
        return n

    def stats(self) -> dict[str, Any]:
        """Counters for ``Dispatcher.stats``."""
        return {"deadline_shared": self.n_shared, "deadline_refused": self.n_refused,
                "idle_lent": self.n_lent, "deadline_sandboxes": self.n_overcommitted}


__all__ = ["DEADLINE_REASON", "Sharing"]
