"""Admission: what a dispatcher accepts. A request is checked against the machines and
the limits (with their defaults filled in), its id against those accepted before (ids
are idempotency keys), and a request recovered from the journal is queued again or, if
its env was not stored, held until it is resubmitted. An accepted request is queued
(:func:`enqueue`) once durable, and handed to the core's state (:func:`submit`) once its
sandbox is ready."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from metasched.core.actions import Action, ActionSpec, Trajectory
from metasched.core.cost_model import CostModel
from metasched.errors import ConfigError
from metasched.runtime.dispatch.jobs import COMMAND_SERVICE, Job
from metasched.runtime.dispatch.journal_writer import JournalWriter
from metasched.runtime.dispatch.sandbox_gate import SandboxGate
from metasched.runtime.dispatch.shared import Shared
from metasched.runtime.dispatch.sharing import Sharing
from metasched.runtime.dispatch.trajectories import Trajectories
from metasched.runtime.gpu import GpuHost, LiveDevice
from metasched.runtime.journal import Journal
from metasched.runtime.journal_rows import StoredRequest, store
from metasched.runtime.requests import (
    CANCELLED,
    FAILED,
    REJECTED,
    Request,
    Result,
    parse_request,
)


class AdmissionHost(Shared, Protocol):
    """What admission asks of its dispatcher
    (the :class:`~.dispatcher.Dispatcher`)."""

    cost: CostModel
    devices: list[LiveDevice]
    gate: SandboxGate
    given_estimates: bool
    host: GpuHost
    journal: Journal | None
    n_rejected: int
    no_gpu_reason: str
    sandboxes: Any  # the backend's sandboxes (made at start)
    sharing: Sharing
    trajectories: Trajectories
    writer: JournalWriter | None

    def enqueue_job(self, job: Job) -> None: ...

    def submit_job(self, job: Job, traj: Trajectory | None) -> None: ...

    def finish_job(self, job: Job, result: Result) -> None: ...

log = logging.getLogger("metasched.dispatch")
# The reason of a recovered request finished unrun because its caller could not come back.
RESTART_REASON = ("restart: the dispatcher restarted after this request's caller had "
                  "gone with its connection (on_restart: cancel)")


class Admission:
    """Accepts requests for dispatcher ``d`` (see :meth:`Dispatcher.accept`)."""

    def __init__(self, d: AdmissionHost) -> None:
        self.d = d
        # Recovered requests whose env was not journaled, by id, until resubmitted.
        self.held: dict[str, tuple[StoredRequest, int]] = {}

    def accept(self, request: Request | Mapping[str, Any], *,
               call: Callable[[], Any] | None = None) -> asyncio.Future[Result]:
        """See :meth:`Dispatcher.accept`."""
        d = self.d
        future: asyncio.Future[Result] = d.loop.future()
        now_wall = d.loop.wall0 + d.loop.now()  # the dispatcher's clock, as wall time
        try:
            if not d.loop.running:
                raise ConfigError("dispatcher", "not running (use `async with Dispatcher()`)")
            submitted = (request if isinstance(request, Request)
                         else parse_request(request, call=call))
            req = self.check(submitted)
            known = d.jobs.get(req.id)
            if known is not None:
                if not same_request(known.request, req):
                    raise ConfigError("id", taken(req.id))
                return known.future
            if d.writer is not None:
                try:
                    doc, digest = store(req, submitted, now_wall,
                                        keep_env=d.config.journal_env)
                except ValueError as e:  # e.g. a Python object as a payload
                    raise ConfigError("payload", f"cannot be journaled: {e}") from None
                if req.id in self.held:
                    return self._resubmitted(req, digest, future)
        except ConfigError as e:
            rid = request.get("id") if isinstance(request, Mapping) else getattr(request, "id", "")
            d.n_rejected += 1
            future.set_result(Result(str(rid or ""), REJECTED, str(e), queued_at=now_wall,
                                     finished_at=now_wall))
            return future
        job = Job(req, future, now_wall)
        if d.writer is None:
            d.enqueue_job(job)
            return future
        # Group commit: journaled with everything else of this loop turn, and queued
        # only once that is durable (``flush`` forces it now).
        d.jobs.add(job)
        d.writer.add(job, doc, digest)
        return future

    def _resubmitted(self, req: Request, digest: str, future: asyncio.Future[Result]
                     ) -> asyncio.Future[Result]:
        """A recovered request whose env was not journaled, given again: it runs now,
        with its env, as the attempt its journal row counts (ConfigError if it is not the
        request the journal holds)."""
        stored, attempts = self.held[req.id]
        if stored.digest != digest:
            raise ConfigError("id", taken(req.id))
        del self.held[req.id]
        self.d.enqueue_job(Job(req, future, stored.queued_at, attempts))
        return future

    def recover(self, left: list[tuple[str, str, int]]) -> None:
        """Finish or re-queue what a previous dispatcher accepted but did not finish, by
        each request's ``on_restart``: ``cancel`` (its caller waited on a connection
        that died with that dispatcher) is finished ``cancelled``; ``run`` is queued
        again, its trajectory ending once its recovered actions have (a sandbox does
        not survive a crash: a later request naming it opens it anew). A row this
        version cannot run (written by an older one, or damaged) is finished
        ``failed`` with the reason, and reported once, never fatal. ``left``: the
        journal's unfinished rows as this dispatcher found them at its start (rows it
        wrote itself are its own); ids accepted here since, or finished, are left
        alone."""
        d = self.d
        skipped: list[str] = []
        cancelled = 0
        trajectories: set[str] = set()
        for key, text, attempts in left:
            if d.jobs.get(key) is not None or d.journal.status(key) == "finished":
                continue
            try:
                stored = StoredRequest.parse(text)
            except (ValueError, TypeError):
                stored = StoredRequest(time.time(), "", None)
            if stored.env_withheld:  # runs once resubmitted with its env (see accept)
                self.held[key] = (stored, attempts)
                continue
            queued_at = stored.queued_at
            doc = stored.request or {}
            if doc.get("on_restart") == "cancel":
                self._finish_recovered(key, queued_at, attempts, CANCELLED, RESTART_REASON)
                cancelled += 1
                continue
            try:
                if stored.request is None:
                    raise ConfigError(f"journal:{key[:40]}", "unreadable in the journal")
                req = self.check(parse_request(doc, f"journal:{key[:40]}"))
            except ConfigError as e:
                why = ("not replayable after a restart (an api call given as a Python "
                       "callable): resubmit it" if doc.get("kind") == "api"
                       and "http" not in doc else f"cannot run here: {e}")
                self._finish_recovered(key, queued_at, attempts, FAILED, why)
                skipped.append(why)
                continue
            d.enqueue_job(Job(req, d.loop.future(), queued_at, attempts))
            if req.trajectory is not None:
                trajectories.add(req.trajectory)
        for name in trajectories:
            d.trajectories.end(name)
        if cancelled:
            log.info("journal: %d requests whose callers could not come back were "
                     "cancelled (on_restart: cancel)", cancelled)
        if skipped:
            log.warning("journal: %d requests could not be recovered, finished failed "
                        "(first: %s)", len(skipped), skipped[0][:300])

    def _finish_recovered(self, key: str, queued_at: float, attempts: int, status: str,
                          why: str) -> None:
        """Finish a recovered row that will not run, with ``why``."""
        d = self.d
        # A placeholder (not validated: it never runs) to carry the result.
        job = Job(Request.model_construct(kind="cpu", timeout_s=1.0, id=key),
                  d.loop.future(), queued_at, attempts)
        d.jobs.add(job)
        d.finish_job(job, Result(key, status, why, queued_at=queued_at,
                                  finished_at=time.time(), attempts=attempts))

    def check(self, req: Request) -> Request:
        """What the request asks of this dispatcher's resources (ConfigError if it can
        never run here, or if it asks more than ``limits`` allow); cpu ``max_cores``
        above the node is capped to the node when it is queued (``ClusterState.submit``,
        as in simulation). Returns the request with the defaults of ``limits`` filled in
        (memory, wall time)."""
        d = self.d
        limits = d.config.limits
        ram_mb = d.cluster.mem_gb_per_node * 1e9 / 2**20
        defaults = limits.defaults(req.kind, req.__dict__, ram_mb)
        if defaults:
            req = req.model_copy(update=defaults)
        node = d.cluster.cores_per_node
        if req.kind == "cpu":
            if req.min_cores > node:
                raise ConfigError("min_cores", f"{req.min_cores} cores asked, this dispatcher "
                                  f"has {node}")
            if req.mem_limit_mb is not None and req.mem_limit_mb > ram_mb:
                raise ConfigError("mem_limit_mb", f"must be <= {ram_mb:.0f} (MiB: this "
                                  f"machine's memory; got {req.mem_limit_mb:g})")
        elif req.kind == "gpu":
            if not d.devices:
                raise ConfigError("kind", f"gpu request, but {d.no_gpu_reason or 'no GPU'}")
            if req.service is not None:
                if req.service not in d.host.specs:
                    known = ", ".join(sorted(d.host.specs)) or "none"
                    raise ConfigError("service", f"unknown service {req.service!r} "
                                      f"(registered: {known})")
                if d.host.specs[req.service].mem_gb > d.cluster.gpu_mem_gb:
                    raise ConfigError("service", f"{req.service} needs more memory than a "
                                      "device has")
        else:
            ep = d.state.api.endpoints.get(req.endpoint)
            if ep is None:
                known = ", ".join(sorted(d.state.api.endpoints)) or "none"
                raise ConfigError("endpoint", f"unknown endpoint {req.endpoint!r} "
                                  f"(configured: {known})")
            if req.tokens > ep.spec.tok_capacity:
                raise ConfigError("tokens", f"{req.tokens} tokens exceed what endpoint "
                                  f"{req.endpoint} allows at once ({ep.spec.tok_capacity:g})")
        if req.argv:
            d.gate.check(req)
        limits.check(req.__dict__ if req.kind == "cpu" or req.argv
                     else {"timeout_s": req.timeout_s})
        return req


def enqueue(d: AdmissionHost, job: Job) -> None:
    """An accepted job, durable: its trajectory lives on, and it is queued once its
    sandbox is ready (see :mod:`.sandbox_gate`)."""
    req = job.request
    t = d.loop.now()
    d.state.advance(t)
    d.jobs.add(job)
    traj = d.trajectories.arrived(req, t)
    if req.argv and d.sandboxes is not None and d.sandboxes.isolated:
        if not d.gate.ready_for(job, traj):
            return  # held until its sandbox is ready (it waits for memory or starts)
    d.submit_job(job, traj)


def submit(d: AdmissionHost, job: Job, traj: Trajectory | None) -> None:
    """Queue an accepted job in the state: the scheduler sees it from now on."""
    req = job.request
    state = d.state
    t = d.loop.now()
    state.advance(t)
    if d.given_estimates and req.est_s is not None:
        est = req.est_s
    else:
        est = d.cost.estimate(req.signature, req.est_s)
    spec = ActionSpec(
        kind=req.kind, name=req.name, true_s=math.nan, est_s=est, timeout_s=req.timeout_s,
        min_cores=req.min_cores, max_cores=req.max_cores,
        parallel_fraction=req.parallel_fraction,
        service=(req.service or COMMAND_SERVICE) if req.kind == "gpu" else None,
        endpoint=req.endpoint, tokens=req.tokens, reward=req.reward,
        start_by_s=d.sharing.start_by(job))
    # Submitted when it was first accepted (a re-queued request keeps its age).
    submit_t = min(t, job.queued_at - d.loop.wall0)
    a = d.jobs.new_action(job, lambda aid: Action(aid, spec, req.task, traj, req.turn,
                                                   submit_t))
    state.submit(a)
    d.loop.kick()


def taken(rid: str) -> str:
    """Why a request is rejected whose id belongs to another request."""
    return (f"{rid!r} was accepted before with a different request; give this one another "
            f"id (or, to start over, use a new journal)")


def same_request(a: Request, b: Request) -> bool:
    """Whether two requests under one id are the same (payloads that cannot be
    compared, e.g. arrays, are taken as equal)."""
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return True


__all__ = ["Admission", "enqueue", "same_request", "submit", "taken"]
