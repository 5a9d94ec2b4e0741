"""Completion: a finished action is recorded in the state (its resources return),
the trace, the cost model (its measured duration) and its trajectory; the scheduler is
asked again at once, then the result is journaled and answered."""

from __future__ import annotations

from typing import Protocol

from metasched.core.actions import AHEAD, Action
from metasched.core.cost_model import CostModel
from metasched.core.trace_writer import TraceWriter
from metasched.runtime.dispatch.cancellation import Cancellation
from metasched.runtime.dispatch.executors.base import Executors
from metasched.runtime.dispatch.jobs import Job
from metasched.runtime.dispatch.journal_writer import JournalWriter
from metasched.runtime.dispatch.shared import Shared
from metasched.runtime.dispatch.trajectories import Trajectories
from metasched.runtime.outcome import Outcome
from metasched.runtime.requests import DONE, FAILED, Result


class CompletionHost(Shared, Protocol):
    """What completion asks of its dispatcher
    (the :class:`~.dispatcher.Dispatcher`)."""

    cancellation: Cancellation
    cost: CostModel
    executors: Executors
    trace_writer: TraceWriter | None
    trajectories: Trajectories
    writer: JournalWriter | None

    def note_started(self, promoted: list[Action]) -> None: ...

    def finish_job(self, job: Job, result: Result) -> None: ...


def complete(d: CompletionHost, job: Job, out: Outcome) -> None:
    """Record a finished action in the state, the cost model and the journal, and
    schedule what its resources now allow (before its result is built)."""
    state = d.state
    state.advance(d.loop.now())
    a = job.action
    was_ahead = a.status == AHEAD  # its result came first: no run time of its own here
    d.note_started(state.finish(a, out.ok, out.reason))
    if d.trace_writer is not None:
        d.trace_writer.record(a, batch=job.alloc.get("batch", 1),
                        setup_s=float(out.detail.get("restore_s", 0.0)),
                        exit_code=out.exit_code, core_ids=job.alloc.get("cores"),
                        trajectory=job.request.trajectory,
                        prompt=None if a.traj is None else a.traj.prompt)
    if out.ok and a.start_t == a.start_t and not was_ahead:
        d.cost.learn(a, state.t - a.start_t - float(out.detail.get("restore_s", 0.0)))
    finished_at = d.loop.wall0 + state.t
    if a.traj is not None:
        d.trajectories.finished(a.traj, state.t)
    try:
        if a.spec.kind != "gpu":
            if a.spec.kind == "cpu" and d.executors.core_waiters:
                d.executors.serve_core_waiters()
            # Now (the turn's first exit), not a loop turn later, and before the result
            # is built and journaled: the time from an exit to the next start is what
            # leaves a freed core idle. The turn's later exits share one pass after it.
            d.loop.pass_now()
    finally:
        attempts = out.attempts if a.spec.kind == "api" else job.attempts
        d.finish_job(job, Result(
            job.request.id, DONE if out.ok else FAILED, out.reason, out.exit_code,
            out.value, out.stdout, out.stderr, job.queued_at, job.started_at,
            finished_at, job.alloc, attempts))
    if a.spec.kind == "gpu":
        d.loop.kick()  # the device frees after the whole batch has been recorded


def finish_job(d: CompletionHost, job: Job, result: Result) -> None:
    """Journal ``result``, forget ``job`` and answer its future."""
    d.cancellation.settle(result)
    if d.writer is not None:
        d.writer.finish(result.id, result.to_json())
    d.jobs.forget(job)
    if not job.future.done():
        job.future.set_result(result)


__all__ = ["complete", "finish_job"]
