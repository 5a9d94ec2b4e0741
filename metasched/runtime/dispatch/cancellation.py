"""Cancellation: a request its caller no longer wants (it cancelled it, or its HTTP
client went away) ends now, recorded as ``cancelled`` in its result (the journal's row
is finished with it: recovery does not run it again), the trace (``measured.status``)
and the counters.

- Accepted, not yet journaled: it is journaled first (its id stays taken), then dropped.
- Held for its trajectory's sandbox, or queued: dropped; it never ran.
- Running (a command: cpu, or a gpu command): its every process is killed (its group,
  and its cgroup slot with whatever left the group); it ends ``cancelled`` once dead.
- An api call or a gpu service batch that runs is not interrupted (a call sent cannot be
  unsent, a forward pass not stopped): it runs to its end (``running`` is answered).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Protocol

from metasched.core.actions import PENDING
from metasched.core.trace_writer import TraceWriter
from metasched.runtime.dispatch.journal_writer import JournalWriter
from metasched.runtime.dispatch.sandbox_gate import SandboxGate
from metasched.runtime.dispatch.shared import Shared
from metasched.runtime.dispatch.trajectories import Trajectories
from metasched.runtime.requests import CANCELLED, FAILED, Result

if TYPE_CHECKING:
    from metasched.runtime.dispatch.jobs import Job

__all__ = ["Cancellation", "CancelState"]

# What a cancel did: ``cancelled`` (it ended now, never having run), ``cancelling`` (it
# runs and is being killed: its result follows), ``finished`` (it had ended already),
# ``running`` (it runs and cannot be interrupted), ``unknown`` (no such request here).
CancelState = Literal["cancelled", "cancelling", "finished", "running", "unknown"]

REASON = "cancelled"


class CancelHost(Shared, Protocol):
    """What cancellation asks of its dispatcher
    (the :class:`~.dispatcher.Dispatcher`)."""

    gate: SandboxGate
    trace_writer: TraceWriter | None
    trajectories: Trajectories
    writer: JournalWriter | None

    def find(self, rid: str) -> tuple[str, Result | None] | None: ...

    def finish_job(self, job: Job, result: Result) -> None: ...


class Cancellation:
    """Cancels dispatcher ``d``'s requests (see the module docstring)."""

    def __init__(self, d: CancelHost) -> None:
        self.d = d
        self.killing: set[str] = set()  # ids whose command was killed: their end is ours
        self.n = 0  # requests that ended cancelled

    def cancel(self, rid: str) -> CancelState:
        """Cancel request ``rid`` (see the module docstring and :data:`CancelState`)."""
        d = self.d
        job = d.jobs.get(rid)
        if job is None:
            return "finished" if d.find(rid) is not None else "unknown"
        if job.future.done():
            return "finished"
        if job.action is None and d.writer is not None and any(
                j is job for j, _, _ in d.writer.to_queue):
            d.writer.flush()  # durable first: its id is then known to stay cancelled
            if job.future.done():
                return "finished"
        a = job.action
        if a is None:
            return self._drop_held(job)
        if a.status == PENDING:
            d.state.advance(d.loop.now())
            d.state.withdraw(a, REASON)
            if d.trace_writer is not None:
                # It never ran: no work to replay (a microsecond, the schema's least).
                d.trace_writer.record(a, trajectory=job.request.trajectory, duration_s=0.0,
                                      prompt=None if a.traj is None else a.traj.prompt)
            self._ended(job, a.traj)
            d.loop.kick()
            return "cancelled"
        proc = getattr(job, "process", None)
        if proc is None or not hasattr(proc, "cancel"):
            return "running"
        if rid not in self.killing:
            self.killing.add(rid)
            proc.cancel()
        return "cancelling"

    def _drop_held(self, job: Job) -> CancelState:
        """A job held until its trajectory's sandbox is ready: it leaves the gate's
        lists, never having been queued."""
        if not self.d.gate.drop_held(job):
            return "running"  # not held here: being handed on (cannot happen on one loop)
        name = job.request.trajectory
        self._ended(job, self.d.trajectories.get(name) if name is not None else None)
        return "cancelled"

    def _ended(self, job: Job, traj) -> None:
        d = self.d
        if traj is not None:
            d.trajectories.finished(traj, d.loop.now())
        now = d.loop.wall0 + d.loop.now()
        d.finish_job(job, Result(job.request.id, CANCELLED, REASON,
                                  queued_at=job.queued_at, started_at=job.started_at,
                                  finished_at=now, attempts=job.attempts))

    def settle(self, result: Result) -> None:
        """A finished request's result, before it is journaled: one whose command was
        killed at its caller's word is ``cancelled`` (unless it ended otherwise first)."""
        if result.status == CANCELLED:
            self.n += 1
        elif result.id in self.killing:
            self.killing.discard(result.id)
            if result.status == FAILED and result.reason == REASON:
                result.status = CANCELLED
                self.n += 1
