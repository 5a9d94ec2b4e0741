"""Completion: a finished action is recorded in the state (its resources return),
the trace, the cost model (its measured duration) and its trajectory; the scheduler is
asked again at once, then the result is journaled and answered."""

from __future__ import annotations

from typing import TYPE_CHECKING

from metasched.core.actions import AHEAD
from metasched.runtime.dispatch.jobs import Job
from metasched.runtime.outcome import Outcome
from metasched.runtime.requests import DONE, FAILED, Result

if TYPE_CHECKING:
    from metasched.runtime.dispatch.dispatcher import Dispatcher


def complete(d: Dispatcher, job: Job, out: Outcome) -> None:
    """Record a finished action in the state, the cost model and the journal, and
    schedule what its resources now allow (before its result is built)."""
    state = d.state
    state.advance(d._now())
    a = job.action
    was_ahead = a.status == AHEAD  # its result came first: no run time of its own here
    d._note_started(state.finish(a, out.ok, out.reason))
    if d.trace_writer is not None:
        d.trace_writer.record(a, batch=job.alloc.get("batch", 1),
                        setup_s=float(out.detail.get("restore_s", 0.0)),
                        exit_code=out.exit_code, core_ids=job.alloc.get("cores"),
                        trajectory=job.request.trajectory,
                        prompt=None if a.traj is None else a.traj.prompt)
    if out.ok and a.start_t == a.start_t and not was_ahead:
        d.cost.learn(a, state.t - a.start_t - float(out.detail.get("restore_s", 0.0)))
    finished_at = d._wall0 + state.t
    if a.traj is not None:
        d.trajectories.finished(a.traj, state.t)
    try:
        if a.spec.kind != "gpu":
            if a.spec.kind == "cpu" and d.executors.core_waiters:
                d.executors.serve_core_waiters()
            # Now, not a loop turn later, and before the result is built and
            # journaled: the time from an exit to the next start is what leaves a
            # freed core idle.
            d._schedule()
    finally:
        attempts = out.attempts if a.spec.kind == "api" else job.attempts
        d._finish_job(job, Result(
            job.request.id, DONE if out.ok else FAILED, out.reason, out.exit_code,
            out.value, out.stdout, out.stderr, job.queued_at, job.started_at,
            finished_at, job.alloc, attempts))
    if a.spec.kind == "gpu":
        d._kick()  # the device frees after the whole batch has been recorded


def finish_job(d: Dispatcher, job: Job, result: Result) -> None:
    """Journal ``result``, forget ``job`` and answer its future."""
    d.cancellation.settle(result)
    if d.writer is not None:
        d.writer.finish(result.id, result.to_json())
    d._jobs.pop(result.id, None)
    if job.action is not None:
        d._by_action.pop(job.action.id, None)
    if not job.future.done():
        job.future.set_result(result)


__all__ = ["complete", "finish_job"]
