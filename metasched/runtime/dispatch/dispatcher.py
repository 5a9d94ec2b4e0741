"""The live dispatcher: the scheduling core on the asyncio clock.

Rollout workers ``await dispatcher.submit(request)``; the dispatcher journals the
request (SQLite, before acknowledging it), queues it in the same ``ClusterState`` the
simulator drives, asks the same ``Scheduler`` (the shipped learned policy by default)
whenever a decision is possible, and runs what it grants on its backend's machines
(commands, each in its trajectory's sandbox and a cgroup of its own:
:mod:`metasched.runtime.sandbox`), GPUs (resident services or commands) and APIs
(quota-aware calls with retries). Observations come from the same encoder and masks as
in training.

One event loop thread owns the state: executors run as tasks on the loop (blocking
work, such as a service's forward pass, runs in a worker thread) and report back on it.
:class:`Dispatcher` holds the loop and the wiring; the rest of the package holds one
concern each (see ``metasched/runtime/dispatch/__init__.py``).
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from metasched.core.actions import Action
from metasched.core.cluster_config import ClusterConfig
from metasched.core.cost_model import CostModel
from metasched.core.decision import DecisionStep
from metasched.core.guard import WaitGuard
from metasched.core.metrics import Recorder, Ring, RunResult
from metasched.core.observation import ObservationEncoder
from metasched.core.pools import ServiceSpec
from metasched.core.predictor import Predictor
from metasched.core.scheduler import Scheduler
from metasched.core.state import ClusterState, InvalidGrant
from metasched.core.trace_writer import TraceWriter
from metasched.errors import ConfigError, one_of
from metasched.runtime.api_calls import make_client, warm_up
from metasched.runtime.backend import Backend
from metasched.runtime.dispatch import admission, completion, status
from metasched.runtime.dispatch.cancellation import Cancellation, CancelState
from metasched.runtime.dispatch.config import DispatcherConfig
from metasched.runtime.dispatch.jobs import COMMAND_SERVICE, JobTable
from metasched.runtime.dispatch.journal_writer import JournalWriter
from metasched.runtime.dispatch.kernels import Kernels
from metasched.runtime.dispatch.local import LocalBackend
from metasched.runtime.dispatch.loop import DispatchLoop
from metasched.runtime.dispatch.policy import fall_back, load_scheduler
from metasched.runtime.dispatch.sandbox_gate import SandboxGate
from metasched.runtime.dispatch.sharing import Sharing
from metasched.runtime.dispatch.trajectories import Trajectories, fit_predictor
from metasched.runtime.gpu import LiveService
from metasched.runtime.journal import Journal
from metasched.runtime.machine import check_workdir, default_workdir
from metasched.runtime.requests import Request, Result
from metasched.runtime.sandbox.config import allowed_env

log = logging.getLogger("metasched.dispatch")


class Dispatcher:
    """Runs submitted actions under a scheduler (use ``async with``).

    Args:
        config: how to run (defaults: the shipped policy, every usable core, no GPU
            unless NVML finds one, no API endpoints, no journal).
        services: live GPU services by name (see ``metasched.runtime.gpu``).
        scheduler: a ``Scheduler`` object instead of ``config.scheduler``.
        predictor: a fitted remaining-work predictor (``metasched.core.predictor``)
            instead of one fitted on ``config.predictor``'s trace: the dispatcher
            updates its online state as its own (give it a fresh copy).
        clock: monotonic seconds (tests inject a fake clock).
        backend: where actions run (default: this machine, a :class:`LocalBackend` the
            dispatcher makes from ``config`` and ``services``, and closes; see
            :mod:`metasched.runtime.backend`). A backend given brings its own nodes,
            devices and services: ``cores``, ``mem_gb`` and ``gpu_standin`` of
            ``config`` and ``services`` are then the backend's business, and so is
            closing it.
    """

    def __init__(self, config: DispatcherConfig | None = None, *,
                 services: Mapping[str, LiveService] | None = None,
                 scheduler: Scheduler | None = None,
                 predictor: Predictor | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 backend: Backend | None = None) -> None:
        self.config = cfg = config or DispatcherConfig()
        # A backend this dispatcher makes (this machine) is its own to open and close.
        self._owns_backend = backend is None
        if backend is None:
            backend = LocalBackend(cfg, services)
        elif services:
            raise ValueError("with a backend, GPU services are given to the backend")
        elif not backend.nodes:
            raise ConfigError("cores", f"no CPU cores to run actions on ({backend.name})")
        self.backend = backend
        self.cores = list(backend.cores)  # ids this process pins commands to ([]: none)
        self.devices, self.no_gpu_reason = list(backend.devices), backend.no_gpu_reason
        self.host = backend.host
        # The core's CPU pool has nodes of one size: the smallest node's.
        node_cores = min(len(n.cores) for n in backend.nodes)
        node_mem = min(n.mem_gb for n in backend.nodes)
        specs: dict[str, ServiceSpec] = dict(self.host.specs)
        if self.devices:
            specs[COMMAND_SERVICE] = ServiceSpec(mem_gb=0.0, restore_s=0.0, max_batch=1)
        self.cluster = ClusterConfig(
            name=backend.name, cpu_nodes=len(backend.nodes),
            cores_per_node=node_cores, mem_gb_per_node=node_mem,
            gpu_devices=len(self.devices),
            gpu_mem_gb=min((d.mem_gb for d in self.devices), default=0.0),
            endpoints=dict(cfg.endpoints))
        self.state = ClusterState(self.cluster, specs)
        ahead = cfg.ahead_per_core
        if ahead is None:
            ahead = getattr(backend, "AHEAD_PER_CORE", 0)
        if not isinstance(ahead, int) or isinstance(ahead, bool) or ahead < 0:
            raise ConfigError("ahead_per_core", f"must be a whole number >= 0, got {ahead!r}")
        backend.EXECUTORS.check_ahead(ahead)
        self.ahead_per_core = ahead
        self.state.ahead_per_node = ahead * node_cores
        self.state.task_demand.update({k: dict(v) for k, v in cfg.task_demand.items()})
        self.state.metrics = Recorder(max_actions=cfg.metrics_window)
        self.guard = WaitGuard(cfg.max_wait_s)
        if predictor is not None and cfg.predictor:
            raise ConfigError("predictor", "a trace to fit on or a fitted predictor, not both")
        if predictor is None and cfg.predictor:
            if cfg.trace and Path(cfg.trace).resolve() == Path(cfg.predictor).resolve():
                raise ConfigError("predictor", "fit it on another trace than the one this "
                                  f"run records to ({cfg.trace}): its figures would be read "
                                  "off its own training data")
            predictor = fit_predictor(cfg.predictor)
        self.cost = CostModel(cfg.cost_alpha, cfg.default_est_s, predictor=predictor)
        self.state.predictor = self.cost.predictor
        one_of(cfg.estimates, ("online", "given"), "estimates")
        self.given_estimates = cfg.estimates == "given"
        self.workdir = (check_workdir(cfg.workdir) if cfg.workdir is not None
                        else default_workdir())
        # Last: it takes the journal's lock (a second dispatcher fails here, before it
        # could touch the first one's commands).
        self.journal = Journal(cfg.journal, fsync=cfg.fsync) if cfg.journal else None
        self.loop = DispatchLoop(clock, self.schedule)  # the clock, the pass's wake-ups
        try:
            self.trace_writer = TraceWriter(cfg.trace, self.cluster, self.host.specs,
                                            started_at=self.loop.wall0) if cfg.trace else None
        except ConfigError:
            if self.journal is not None:
                self.journal.close()
            raise
        self._scheduler_given = scheduler
        self.scheduler: Scheduler | None = None
        self.fallback_reason = ""
        self.encoder: ObservationEncoder | None = None
        self.jobs = JobTable()  # accepted and not finished
        self.writer = JournalWriter(self, self.journal) if self.journal is not None else None
        self.admission = admission.Admission(self)
        self.trajectories = Trajectories(self)
        self.gate = SandboxGate(self)
        self.cancellation = Cancellation(self)
        self.kernels = Kernels(self)  # /run_jupyter's, one per trajectory
        self.sharing = Sharing(self)  # deadlines and idle cores (time-sharing)
        self.sandboxes: Any = None  # the backend's sandboxes, made at start
        # What commands get from this process's environment (no secret is in the list);
        # the rest comes from their request's env.
        self.base_env = allowed_env(cfg.sandbox.env_allow)
        self.http: Any = None  # the pooled HTTP client of API calls (made at start)
        self.latency_ns = Ring(200_000, "q")  # the last decisions' latencies, unboxed
        self.n_decisions = 0
        self.n_rejected = 0
        self._ticker: asyncio.Task | None = None
        self._left: list[tuple[str, str, int]] | None = None  # the journal's, until recovered
        if self._owns_backend:  # its run directory's place; NVML is held from now on
            backend.open(self.workdir)
        self.executors = backend.EXECUTORS(self, backend)
        self.step = DecisionStep(self.state, self.guard, self.executors.start)

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Dispatcher:
        await self.start()
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        await self.close(drain=exc_type is None)

    async def start(self, *, recover: bool = True) -> None:
        """Load the scheduler, set up sandboxes, recover the journal (unless
        ``recover`` is false: then :meth:`recover` does, later), start sampling.
        A start that fails or is interrupted (cancelled, Ctrl-C) closes what it had
        opened, the journal's lock included, before the error goes on.

        Raises:
            ConfigError: the configured isolation cannot work here (the message says
                what is missing).
        """
        try:
            await self._start_up(recover)
        except BaseException:
            await self.close(drain=False)
            raise

    def recover(self) -> None:
        """Take up what a previous dispatcher on this journal left unfinished (see
        :meth:`Admission.recover`): after ``start(recover=False)``, once the caller is
        ready (a service that has probed its languages, so that its own start does
        not wait behind recovered work). Ids accepted since stay with their jobs."""
        if self.journal is None or self._left is None:
            return
        left, self._left = self._left, None
        try:
            self.admission.recover(left)
        except sqlite3.DatabaseError as e:
            self._unreadable(e)
        self.loop.kick()

    async def _start_up(self, recover: bool) -> None:
        self.loop.bind()
        self.scheduler = load_scheduler(self, self._scheduler_given)
        endpoints = self.state.api.endpoints.values()
        if endpoints:
            # One pooled client for every API call (connections are reused), made now
            # with what its first call would load: the first call must not start later
            # than the quota allows (the CA store, the transport's imports: ~0.1 s).
            self.http = make_client(
                max_keepalive=max(1, sum(ep.spec.max_concurrency for ep in endpoints)))
            await warm_up()
        if self.journal is not None:
            try:  # the commands a previous dispatcher on this journal left running
                await self.backend.kill_orphans(self.journal)
            except sqlite3.DatabaseError as e:
                self._unreadable(e)
        # Each node's commands are confined there (this machine's here).
        self.sandboxes = await self.backend.start_sandboxes(self.config.sandbox, self._hidden())
        if self.journal is not None:
            try:  # what the previous dispatcher left, before this one accepts anything
                self._left = self.journal.unfinished()
            except sqlite3.DatabaseError as e:
                self._unreadable(e)
        if recover:
            self.recover()
        self._ticker = asyncio.create_task(self._tick())
        self.sharing.start()
        self.loop.kick()

    def _unreadable(self, e: sqlite3.DatabaseError) -> None:
        """The journal is damaged in a way the open-time checks cannot see: a one-line
        ConfigError (start() closes what was opened)."""
        raise ConfigError("journal", f"{self.journal.path}: unreadable ({e}); "
                          f"restore it from a copy, or move it aside to start a "
                          f"new journal") from None

    def _hidden(self) -> list[str]:
        """Host paths commands must not see: the journal's files (a command that found
        it could forge the results served on resume)."""
        return ([str(self.journal.path.resolve()) + suffix
                 for suffix in ("", "-wal", "-shm", ".lock")]
                if self.journal is not None else [])

    async def close(self, *, drain: bool = True) -> None:
        """Stop. With ``drain``, first wait for every accepted request to finish;
        otherwise running commands are killed and unfinished requests stay in the
        journal for the next dispatcher."""
        if self.loop.closed:
            return
        if not drain:
            self.loop.closed = True  # nothing new starts while closing
        if self.writer is not None:
            self.writer.flush()  # what was accepted this turn is durable and queued
        if drain:
            futures = [j.future for j in self.jobs]
            if futures:
                await asyncio.gather(*futures, return_exceptions=True)
        self.loop.closed = True
        self.backend.sample()  # the span since the last periodic sample
        await self.kernels.close()
        await self.sharing.close()
        await self.executors.close()
        if self.sandboxes is not None:
            self.sandboxes.close()  # every sandbox ends, with whatever still runs in it
        if self._owns_backend:  # its run directory; NVML
            await self.backend.close()
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)
        self.loop.stop()
        for job in self.jobs:
            if not job.future.done():
                job.future.cancel()
        if self.http is not None:
            await self.http.aclose()
            self.http = None
        if self.writer is not None:
            self.writer.close()
        if self.trace_writer is not None:
            self.trace_writer.close()
        if self.admission.held:
            log.warning("%d requests recovered from the journal were not resubmitted: "
                        "their env was not stored (journal_env=false), so they wait, "
                        "unfinished, for their resubmission", len(self.admission.held))

    def _fall_back(self, why: str) -> Scheduler:
        """Switch to the elastic_greedy heuristic, logging the reason once."""
        return fall_back(self, why)

    # ------------------------------------------------------------------ submitting

    async def submit(self, request: Request | Mapping[str, Any], *,
                     call: Callable[[], Any] | None = None) -> Result:
        """Run one action and return its result (see :class:`Result`).

        ``request`` is a :class:`Request` or its JSON form; ``call`` is an api request's
        async callable. Bad input is not raised: it comes back as a ``rejected`` result
        with the reason, and the dispatcher goes on serving others."""
        return await self.accept(request, call=call)

    async def enqueue(self, request: Request | Mapping[str, Any], *,
                      call: Callable[[], Any] | None = None) -> asyncio.Future[Result]:
        """Accept ``request`` and return once it is durable (journaled and committed):
        the acknowledgement a caller that may crash should wait for. Returns the future
        of its result; a rejected request's future is already done."""
        future = self.accept(request, call=call)
        if self.writer is not None and not future.done():
            await self.writer.durable()
        return future

    def accept(self, request: Request | Mapping[str, Any], *,
               call: Callable[[], Any] | None = None) -> asyncio.Future[Result]:
        """Accept ``request`` and return the future of its result. Requests accepted in
        one loop turn arrive together: with a journal they are journaled in one commit
        at the end of the turn and queued once it is done (``await enqueue()`` waits for
        that); the scheduler then sees them all at once, as the simulator does actions
        that arrive at the same instant. A request whose id was accepted before gets
        that request's future (or its stored result): ids are idempotency keys. The
        same id with a different request is rejected (it would be answered with the
        other's result)."""
        return self.admission.accept(request, call=call)

    @property
    def awaiting_resubmission(self) -> list[str]:
        """Ids recovered from the journal that wait for their resubmission: their env
        was not stored (``journal_env`` off), so they cannot run as they were given."""
        return list(self.admission.held)

    def compact_journal(self, older_than_s: float, *, vacuum: bool = False) -> int:
        """Drop the output (stdout, stderr, value) and the stored request of journal
        rows finished more than ``older_than_s`` seconds ago, keeping their ids, digests
        and outcomes: a resubmitted id is still checked and answered (without its
        output). Returns how many rows were compacted (see :meth:`Journal.compact`)."""
        if self.writer is None:
            raise RuntimeError("this dispatcher has no journal")
        return self.writer.compact(older_than_s, vacuum=vacuum)

    def flush(self) -> None:
        """Make every request accepted so far durable now (the journal's writes are
        otherwise grouped into one commit per loop turn), and queue them. A request
        whose id the journal already holds finished gets that result instead."""
        if self.writer is not None:
            self.writer.flush()

    enqueue_job = admission.enqueue
    submit_job = admission.submit

    # ------------------------------------------------------------------ scheduling

    def schedule(self) -> None:
        """A scheduling pass now: commands at their latest start, then the scheduler's
        grants while a decision is possible, the idle rule, the nodes' queues ahead, and
        the next wake-up (a part that frees resources runs one at once; others ask for one
        with ``loop.kick()``)."""
        self.loop.pass_started()
        if self.loop.closed:
            return
        state = self.state
        executors = self.executors
        state.advance(self.loop.now())
        step = self.step  # the core's decision step (the guard's grants start there)
        self.sharing.serve()  # commands at their latest start first (core.deadlines)
        waited = False
        while step.ready():
            sched = self.scheduler
            t0 = time.perf_counter_ns()
            try:
                grants = sched.decide(state)
            except Exception as e:  # noqa: BLE001 - a failing policy must not stop dispatch
                self._fall_back(f"scheduler {sched.name!r} failed to decide: "
                                f"{type(e).__name__}: {e}")
                continue
            self.latency_ns.append(time.perf_counter_ns() - t0)
            self.n_decisions += 1
            if not grants:
                waited = True
                break
            for g in grants:
                try:
                    executors.start(g)
                except InvalidGrant as e:
                    self._fall_back(f"scheduler {self.scheduler.name!r} made an invalid "
                                    f"grant: {e}")
                    break
        # An idle cluster is not kept idle (the simulator's rule too): serve what can
        # start, then ask again.
        if waited and step.serve_idle():
            self.loop.kick()
        # Not while a gpu command waits for cores: a node's queue, refilled at every
        # exit, would keep them from it.
        if state.ahead_per_node and not self.loop.closed and not executors.core_waiters:
            for a in state.fill_ahead():
                executors.start_ahead(a)
        self._arm_timers()

    def _arm_timers(self) -> None:
        """Look again when API quota windows have room or the guard's deadline comes."""
        state = self.state
        waits = []
        if state.pending["api"]:
            waits.extend(state.api_wakeups().values())
        deadline = self.guard.next_deadline(state)
        if deadline is not None:
            waits.append(max(0.0, deadline - state.t))
        due = self.sharing.next_due()
        if due is not None:
            waits.append(max(0.0, due - state.t))
        if not waits:
            return
        self.loop.wake_in(min(waits) + 1e-6)

    def note_started(self, promoted: list[Action]) -> None:
        """Actions a node's queue started on cores just left there (a round trip ago at
        most, on the node): their results say they started now."""
        for b in promoted:
            self.jobs.of_action(b.id).started_at = self.loop.wall(self.state.t)

    # ------------------------------------------------------------------ completing

    complete = completion.complete
    finish_job = completion.finish_job

    def cancel(self, rid: str) -> CancelState:
        """Cancel request ``rid``: dropped if it waits, its command killed if it runs;
        its result says ``cancelled`` (see :mod:`.cancellation`). Returns what was done:
        ``cancelled``, ``cancelling`` (killed; its result follows), ``finished``,
        ``running`` (an api call or gpu batch: runs to its end) or ``unknown``."""
        return self.cancellation.cancel(rid)

    def close_trajectory(self, name: str) -> None:
        """Close trajectory ``name`` as its reward action would: once nothing of it is
        queued or running (now, if nothing is), its workspace is removed and its
        sandbox memory returns to the pool. A later request naming it starts anew."""
        self.trajectories.end(name)

    async def _tick(self) -> None:
        """Sample the machine; close trajectories idle too long."""
        interval = self.config.sample_interval_s
        while True:
            await asyncio.sleep(interval)
            self.backend.sample()
            self.trajectories.close_idle(self.loop.now(), self.config.trajectory_idle_s)

    # ------------------------------------------------------------------ reading

    def observe(self) -> dict[str, np.ndarray]:
        """The policy's observation of the live state now (same encoder as the env)."""
        if self.encoder is None:
            raise RuntimeError("the machine exceeds the observation's sizes")
        self.state.advance(self.loop.now())
        return self.encoder.observe(self.state)

    def stats(self) -> dict[str, Any]:
        """Counters, decision latency percentiles (µs) and measured utilisation."""
        return status.stats(self)

    def run_result(self) -> RunResult:
        """What this dispatcher measured, in the simulator's form (for the same
        tables and plots as evaluation)."""
        return status.run_result(self)

    def status(self) -> dict[str, Any]:
        """:meth:`stats` plus the pools as they are now: cores (busy, free), GPU devices
        (busy, resident services), API endpoints (quota, calls in flight, what the
        windows admit), the queue by kind, and the utilisation granted so far."""
        return status.status(self)

    def find(self, rid: str) -> tuple[str, Result | None] | None:
        """Where request ``rid`` stands: ``("queued", None)`` or ``("running", None)``
        while it is this dispatcher's, ``("finished", result)`` once the journal holds
        its result (a finished request is not kept in memory: without a journal it is
        unknown here), None if it is unknown."""
        return status.find(self, rid)


__all__ = ["COMMAND_SERVICE", "Dispatcher", "DispatcherConfig"]
