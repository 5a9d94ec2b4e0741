"""The live dispatcher: the scheduling core on the asyncio clock.

Rollout workers ``await dispatcher.submit(request)``; the dispatcher journals the
request (SQLite, before acknowledging it), queues it in the same ``ClusterState`` the
simulator drives, asks the same ``Scheduler`` (the shipped learned policy by default)
whenever a decision is possible, and runs what it grants on real cores (commands, each
in its trajectory's sandbox and a cgroup of its own: :mod:`metasched.runtime.sandbox`),
GPUs (resident services or commands) and APIs (quota-aware calls with retries).
Observations come from the same encoder and masks as in training.

One event loop thread owns the state: executors run as tasks on the loop (blocking
work, such as a service's forward pass, runs in a worker thread) and report back on it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import sqlite3
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import Any

import numpy as np

from metasched.core.action_log import ActionLog
from metasched.core.actions import AHEAD, Action, ActionSpec, Grant, SandboxSpec, Trajectory
from metasched.core.cluster_config import ClusterConfig
from metasched.core.cost_model import CostModel
from metasched.core.guard import WaitGuard
from metasched.core.metrics import Recorder, Ring, RunResult
from metasched.core.observation import ObsConfig, ObservationEncoder
from metasched.core.pools import ServiceSpec
from metasched.core.scheduler import Scheduler
from metasched.core.state import ClusterState, InvalidGrant
from metasched.errors import ConfigError
from metasched.runtime.api_calls import call_api, make_client, warm_up
from metasched.runtime.backend import Backend, Command, CommandSpec
from metasched.runtime.dispatcher_config import DispatcherConfig
from metasched.runtime.gpu import (
    GpuSampler,
    LiveService,
    ServiceHost,
    command_env,
    discover_devices,
)
from metasched.runtime.journal import Journal
from metasched.runtime.journal_docs import StoredRequest, compacted, store
from metasched.runtime.launch import gpu_sandbox, launch, open_confinement
from metasched.runtime.machine import (
    MachineMonitor,
    check_workdir,
    default_workdir,
    memory_gb,
    usable_cores,
)
from metasched.runtime.outcome import Outcome
from metasched.runtime.process import Process, kill_group
from metasched.runtime.requests import DONE, FAILED, REJECTED, Request, Result, parse_request
from metasched.runtime.sandbox.config import allowed_env
from metasched.runtime.sandbox.manager import Sandbox, Sandboxes
from metasched.runtime.sandbox.rundir import RunDirectory

log = logging.getLogger("metasched.dispatch")

COMMAND_SERVICE = "@command"  # the core's service for gpu commands (no model to load)
FALLBACK = "elastic_greedy"
ACTION_ENV = "METASCHED_ACTION_ID"  # set in every command's environment (orphan check)


class _Job:
    """A request the dispatcher has accepted, with its future and timings."""

    __slots__ = ("request", "future", "queued_at", "started_at", "action", "alloc", "attempts",
                 "sandbox")

    def __init__(self, request: Request, future: asyncio.Future, queued_at: float,
                 attempts: int = 0) -> None:
        self.request = request
        self.future = future
        self.queued_at = queued_at
        self.started_at: float | None = None
        self.action: Action | None = None
        self.alloc: dict[str, Any] = {}
        self.attempts = attempts
        self.sandbox: Sandbox | None = None  # where its command runs (isolation on)


class Dispatcher:
    """Runs submitted actions on this machine under a scheduler (use ``async with``).

    Args:
        config: how to run (defaults: the shipped policy, every usable core, no GPU
            unless NVML finds one, no API endpoints, no journal).
        services: live GPU services by name (see ``metasched.runtime.gpu``).
        scheduler: a ``Scheduler`` object instead of ``config.scheduler``.
        clock: monotonic seconds (tests inject a fake clock).
        backend: where actions run (default: this machine; see
            :mod:`metasched.runtime.backend`). A backend brings its own nodes, devices
            and services: ``cores``, ``mem_gb`` and ``gpu_standin`` of ``config`` and
            ``services`` are then the backend's business.
    """

    def __init__(self, config: DispatcherConfig | None = None, *,
                 services: Mapping[str, LiveService] | None = None,
                 scheduler: Scheduler | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 backend: Backend | None = None) -> None:
        self.config = cfg = config or DispatcherConfig()
        self.backend = backend
        if backend is None:
            usable = usable_cores()
            self.cores = sorted(set(cfg.cores)) if cfg.cores is not None else usable
            if not self.cores:
                raise ConfigError("cores", "no CPU cores to run actions on")
            if not set(self.cores) <= set(usable):
                raise ConfigError("cores", f"{sorted(set(self.cores) - set(usable))} are not "
                                  f"usable here (usable: {usable})")
            self.devices, self.no_gpu_reason = discover_devices(
                standin=cfg.gpu_standin, standin_mem_gb=cfg.gpu_standin_mem_gb)
            self.host = ServiceHost(self.devices)
            for name, svc in (services or {}).items():
                self.host.register(name, svc)
            n_nodes, node_cores = 1, len(self.cores)
            node_mem = cfg.mem_gb if cfg.mem_gb is not None else memory_gb()
        else:
            if services:
                raise ValueError("with a backend, GPU services are given to the backend")
            if not backend.nodes:
                raise ConfigError("cores", f"no CPU cores to run actions on ({backend.name})")
            self.cores = []  # the backend's nodes' cores: not this process's to pin
            self.devices, self.no_gpu_reason = list(backend.devices), backend.no_gpu_reason
            self.host = backend.host
            # The core's CPU pool has nodes of one size: the smallest node's.
            n_nodes = len(backend.nodes)
            node_cores = min(len(n.cores) for n in backend.nodes)
            node_mem = min(n.mem_gb for n in backend.nodes)
        specs: dict[str, ServiceSpec] = dict(self.host.specs)
        if self.devices:
            specs[COMMAND_SERVICE] = ServiceSpec(mem_gb=0.0, restore_s=0.0, max_batch=1)
        self.cluster = ClusterConfig(
            name="local" if backend is None else backend.name, cpu_nodes=n_nodes,
            cores_per_node=node_cores, mem_gb_per_node=node_mem,
            gpu_devices=len(self.devices),
            gpu_mem_gb=min((d.mem_gb for d in self.devices), default=0.0),
            endpoints=dict(cfg.endpoints))
        self.state = ClusterState(self.cluster, specs)
        ahead = cfg.ahead_per_core
        if ahead is None:
            ahead = getattr(backend, "AHEAD_PER_CORE", 0)
        if ahead and backend is None:
            raise ConfigError("ahead_per_core", "the local backend starts each command on its "
                              "core itself (no node queue to hand commands to): must be 0")
        self.ahead_per_core = ahead
        self.state.ahead_per_node = ahead * node_cores
        self.state.task_demand.update({k: dict(v) for k, v in cfg.task_demand.items()})
        self.state.metrics = Recorder(max_actions=cfg.metrics_window)
        self.guard = WaitGuard(cfg.max_wait_s)
        self.cost = CostModel(cfg.cost_alpha, cfg.default_est_s)
        self._request_estimates = cfg.estimates == "request"
        self.workdir = (check_workdir(cfg.workdir) if cfg.workdir is not None
                        else default_workdir())
        # Last: it takes the journal's lock (a second dispatcher fails here, before it
        # could touch the first one's commands).
        self.journal = Journal(cfg.journal, fsync=cfg.fsync) if cfg.journal else None
        self._clock = clock
        self._t0 = clock()
        self._wall0 = time.time()
        try:
            self.action_log = ActionLog(cfg.trace, self.cluster, self.host.specs,
                                        started_at=self._wall0) if cfg.trace else None
        except ConfigError:
            if self.journal is not None:
                self.journal.close()
            raise
        self._scheduler_given = scheduler
        self.scheduler: Scheduler | None = None
        self.fallback_reason = ""
        self.encoder: ObservationEncoder | None = None
        self._jobs: dict[str, _Job] = {}  # by request id, until finished
        # Recovered requests whose env was not journaled, by id, until resubmitted.
        self._held: dict[str, tuple[StoredRequest, int]] = {}
        self._by_action: dict[int, _Job] = {}
        self._trajs: dict[str, Trajectory] = {}
        self._traj_live: dict[int, int] = {}  # trajectory id -> actions queued or running
        self._traj_ended: set[int] = set()
        self._traj_seen: dict[int, float] = {}
        self._free_cores = list(self.cores)
        # Cores a trajectory holds (a scheduler's ``hold``, e.g. static's sandboxes), by
        # trajectory id: out of the free pool until it closes; its actions run on them
        # (sharing them, as processes of one sandbox do) before taking free ones.
        self._held_cores: dict[int, list[int]] = {}
        self._tasks: set[asyncio.Task] = set()
        # Started commands whose task has not finished waiting for them: on close, any
        # whose task never ran is abandoned (killed and cleaned up) rather than leaked.
        self._commands: set[Process | Command] = set()
        self._next_action = 0
        self._next_traj = 0
        self._kick_pending = False
        # Journal writes waiting for the next group commit: starts by key (pid, attempt,
        # time), and finishes; a finish whose start is still waiting takes it along.
        self._starts: dict[str, tuple[int | None, int, float]] = {}
        self._finishes: list[tuple[str, str, float]] = []
        self._start_finishes: list[tuple[str, int, float, str, float]] = []
        self._to_queue: list[tuple[_Job, str]] = []  # accepted, queued once journaled
        self._flush_waiters: list[asyncio.Future] = []  # enqueue() calls awaiting a commit
        self._flush_pending = False
        self._flush_timer: asyncio.TimerHandle | None = None
        self._wake: asyncio.TimerHandle | None = None  # the next quota refill or deadline
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        # NVML readings and per-core load are this machine's: a backend's are not here.
        self.gpu_sampler = (GpuSampler(self.devices, self.host)
                            if self.devices and backend is None else None)
        self.monitor = MachineMonitor(self.cores, self.gpu_sampler)
        self.boxes: Sandboxes | None = None  # made at start
        self.run_dir: RunDirectory | None = None
        self._sandbox_wait: deque[Trajectory] = deque()  # waiting for sandbox memory
        # trajectory id -> its jobs, until its sandbox is ready
        self._awaiting_sandbox: dict[int, list[_Job]] = {}
        self._shared_wait: dict[bool, list[_Job]] = {}  # jobs until a shared sandbox opens
        # gpu commands waiting for cores: (how many, on which node, the waiter)
        self._core_waiters: deque[tuple[int, int, asyncio.Future]] = deque()
        # What commands get from this process's environment (no secret is in the list);
        # the rest comes from their request's env.
        self._base_env = allowed_env(cfg.sandbox.env_allow)
        self._http = None  # the pooled HTTP client of API calls (see start)
        self.latency_ns = Ring(200_000, "q")  # the last decisions' latencies, unboxed
        self.n_decisions = 0
        self.n_rejected = 0
        self._ticker: asyncio.Task | None = None

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Dispatcher:
        await self.start()
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        await self.close(drain=exc_type is None)

    async def start(self) -> None:
        """Load the scheduler, set up confinement, recover the journal, start sampling.
        A start that fails or is interrupted (cancelled, Ctrl-C) closes what it had
        opened, the journal's lock included, before the error goes on.

        Raises:
            ConfigError: the configured isolation cannot work here (the message says
                what is missing).
        """
        try:
            await self._start_up()
        except BaseException:
            await self.close(drain=False)
            raise

    async def _start_up(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.scheduler = self._load_scheduler()
        endpoints = self.state.api.endpoints.values()
        if endpoints:
            # One pooled client for every API call (connections are reused), made now
            # with what its first call would load: the first call must not start later
            # than the quota allows (the CA store, the transport's imports: ~0.1 s).
            self._http = make_client(
                max_keepalive=max(1, sum(ep.spec.max_concurrency for ep in endpoints)))
            await warm_up()
        if self.journal is not None:
            if self.backend is not None:  # its commands are found by id on every node
                await self.backend.kill_orphans([key for key, _, _ in self.journal.unfinished()])
            else:
                self._read_journal(self._kill_orphans)
        if self.backend is None:
            await self._start_sandboxes()
        else:  # each node's commands are confined there, as they are here
            self.boxes = await self.backend.start_sandboxes(self.config.sandbox, self._hidden())
        if self.journal is not None:
            self._read_journal(self._recover)
        self._ticker = asyncio.create_task(self._tick())
        self._kick()

    async def close(self, *, drain: bool = True) -> None:
        """Stop. With ``drain``, first wait for every accepted request to finish;
        otherwise running commands are killed and unfinished requests stay in the
        journal for the next dispatcher."""
        if self._closed:
            return
        if not drain:
            self._closed = True  # nothing new starts while closing
        if self.journal is not None:
            self.flush()  # what was accepted this turn is durable and queued
        if drain:
            futures = [j.future for j in self._jobs.values()]
            if futures:
                await asyncio.gather(*futures, return_exceptions=True)
        self._closed = True
        self.monitor.sample()  # the span since the last periodic sample
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for proc in self._commands:  # started, but cancelled before its task first ran
            proc.abandon()
        self._commands.clear()
        if self.boxes is not None:
            self.boxes.close()  # every sandbox ends, with whatever still runs in it
        if self.run_dir is not None:
            self.run_dir.remove()
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)
        if self._wake is not None:
            self._wake.cancel()
        for job in self._jobs.values():
            if not job.future.done():
                job.future.cancel()
        if self.gpu_sampler is not None:
            self.gpu_sampler.close()
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        if self.journal is not None:
            if self._flush_timer is not None:
                self._flush_timer.cancel()
            self.flush()
            self.journal.close()
        if self.action_log is not None:
            self.action_log.close()
        if self._held:
            log.warning("%d requests recovered from the journal were not resubmitted: "
                        "their env was not stored (journal_env=false), so they wait, "
                        "unfinished, for their resubmission", len(self._held))

    def _load_scheduler(self) -> Scheduler:
        from metasched.agents import make_advisor, make_scheduler
        from metasched.agents.checkpoint import resolve_scheduler

        sched = self._scheduler_given
        if sched is None:
            try:
                sched = make_scheduler(resolve_scheduler(self.config.scheduler),
                                       **self.config.scheduler_params)
            except Exception as e:  # noqa: BLE001 - any failure to load means the fallback
                return self._fall_back(f"cannot load scheduler {self.config.scheduler!r}: {e}")
        try:
            sched.reset(self.state, np.random.default_rng(0))
        except Exception as e:  # noqa: BLE001
            return self._fall_back(f"scheduler {sched.name!r} cannot run here: {e}")
        obs_cfg = getattr(sched, "obs_config", None) or ObsConfig()
        try:
            self.encoder = (getattr(sched, "encoder", None)
                            or ObservationEncoder(self.state, obs_cfg, make_advisor(obs_cfg)))
        except ValueError:
            self.encoder = None  # the machine exceeds the observation's sizes
        return sched

    def _fall_back(self, why: str) -> Scheduler:
        """Switch to the elastic_greedy heuristic, logging the reason once."""
        from metasched.agents import make_advisor, make_scheduler

        if not self.fallback_reason:
            self.fallback_reason = why
            log.warning("%s; falling back to %s", why, FALLBACK)
        sched = make_scheduler(FALLBACK)
        sched.reset(self.state, np.random.default_rng(0))
        self.scheduler = sched
        if self.encoder is None:
            try:
                obs_cfg = ObsConfig()
                self.encoder = ObservationEncoder(self.state, obs_cfg, make_advisor(obs_cfg))
            except ValueError:
                self.encoder = None
        return sched

    def _read_journal(self, read: Callable[[], None]) -> None:
        """``read()`` the journal at start; damage the open-time checks cannot see is a
        one-line ConfigError."""
        try:
            read()
        except sqlite3.DatabaseError as e:  # start() closes what was opened
            raise ConfigError("journal", f"{self.journal.path}: unreadable ({e}); "
                              f"restore it from a copy, or move it aside to start a "
                              f"new journal") from None

    def _kill_orphans(self) -> None:
        """Kill the commands a previous dispatcher left running (its scratch directories
        and cgroups go with its run directory: see :meth:`_start_sandboxes`)."""
        assert self.journal is not None
        import psutil

        for key, pid in self.journal.orphans():
            try:  # only a process that still carries this action's id is ours
                if psutil.Process(pid).environ().get(ACTION_ENV) == key:
                    kill_group(pid)
            except psutil.ZombieProcess:
                # An unreaped leader keeps its pid (and so its group id) from reuse: what
                # is left of the group is the action's.
                kill_group(pid)
            except (psutil.Error, OSError):
                pass

    def _hidden(self) -> list[str]:
        """Host paths commands must not see: the journal's files (a command that found
        it could forge the results served on resume)."""
        return ([str(self.journal.path.resolve()) + suffix
                 for suffix in ("", "-wal", "-shm", ".lock")]
                if self.journal is not None else [])

    async def _start_sandboxes(self) -> None:
        """Set up this machine's confinement (see
        :func:`metasched.runtime.launch.open_confinement`)."""
        self.run_dir, self.boxes = await open_confinement(
            self.workdir, self.config.sandbox, hide=self._hidden())

    def _recover(self) -> None:
        """Re-queue what a previous dispatcher accepted but did not finish."""
        assert self.journal is not None
        for key, text, attempts in self.journal.unfinished():
            try:
                stored = StoredRequest.parse(text)
            except ValueError:
                stored = StoredRequest(time.time(), "", None)
            if stored.env_withheld:  # runs once resubmitted with its env (see accept)
                self._held[key] = (stored, attempts)
                continue
            queued_at = stored.queued_at
            future = self._loop.create_future()
            doc = stored.request or {}
            try:
                if stored.request is None:
                    raise ConfigError(f"journal:{key}", "unreadable in the journal")
                req = self._check(parse_request(doc, f"journal:{key}"))
            except ConfigError as e:
                why = ("not replayable after a restart (an api call given as a Python "
                       "callable): resubmit it" if doc.get("kind") == "api"
                       and "http" not in doc else f"cannot run here: {e}")
                # A placeholder (not validated: it never runs) to carry the failure.
                job = _Job(Request.model_construct(kind="cpu", timeout_s=1.0, id=key),
                           future, queued_at, attempts)
                self._jobs[key] = job
                self._finish_job(job, Result(key, FAILED, why, queued_at=queued_at,
                                             finished_at=time.time(), attempts=attempts))
                continue
            self._enqueue(_Job(req, future, queued_at, attempts))

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
        if self.journal is not None and not future.done() and self._to_queue:
            waiter = self._loop.create_future()
            self._flush_waiters.append(waiter)
            await waiter
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
        loop = self._loop or asyncio.get_running_loop()
        future: asyncio.Future[Result] = loop.create_future()
        now_wall = self._wall0 + self._now()  # the dispatcher's clock, as wall time
        try:
            if self._closed or self._loop is None:
                raise ConfigError("dispatcher", "not running (use `async with Dispatcher()`)")
            submitted = (request if isinstance(request, Request)
                         else parse_request(request, call=call))
            req = self._check(submitted)
            known = self._jobs.get(req.id)
            if known is not None:
                if not _same_request(known.request, req):
                    raise ConfigError("id", _taken(req.id))
                return known.future
            if self.journal is not None:
                try:
                    doc, digest = store(req, submitted, now_wall,
                                        keep_env=self.config.journal_env)
                except ValueError as e:  # e.g. a Python object as a payload
                    raise ConfigError("payload", f"cannot be journaled: {e}") from None
                if req.id in self._held:
                    return self._resubmitted(req, digest, future)
        except ConfigError as e:
            rid = request.get("id") if isinstance(request, Mapping) else getattr(request, "id", "")
            self.n_rejected += 1
            future.set_result(Result(str(rid or ""), REJECTED, str(e), queued_at=now_wall,
                                     finished_at=now_wall))
            return future
        job = _Job(req, future, now_wall)
        if self.journal is None:
            self._enqueue(job)
            return future
        # Group commit: journaled with everything else of this loop turn, and queued
        # only once that is durable (``flush`` forces it now).
        self._jobs[req.id] = job
        self._to_queue.append((job, doc, digest))
        if not self._flush_pending:
            self._flush_pending = True
            loop.call_soon(self.flush)
        return future

    def _resubmitted(self, req: Request, digest: str, future: asyncio.Future[Result]
                     ) -> asyncio.Future[Result]:
        """A recovered request whose env was not journaled, given again: it runs now,
        with its env, as the attempt its journal row counts (ConfigError if it is not the
        request the journal holds)."""
        stored, attempts = self._held[req.id]
        if stored.digest != digest:
            raise ConfigError("id", _taken(req.id))
        del self._held[req.id]
        self._enqueue(_Job(req, future, stored.queued_at, attempts))
        return future

    @property
    def awaiting_resubmission(self) -> list[str]:
        """Ids recovered from the journal that wait for their resubmission: their env
        was not stored (``journal_env`` off), so they cannot run as they were given."""
        return list(self._held)

    def compact_journal(self, older_than_s: float, *, vacuum: bool = False) -> int:
        """Drop the output (stdout, stderr, value) and the stored request of journal
        rows finished more than ``older_than_s`` seconds ago, keeping their ids, digests
        and outcomes: a resubmitted id is still checked and answered (without its
        output). Returns how many rows were compacted (see :meth:`Journal.compact`)."""
        if self.journal is None:
            raise RuntimeError("this dispatcher has no journal")
        self.flush()
        return self.journal.compact(older_than_s, compacted, vacuum=vacuum)

    def flush(self) -> None:
        """Make every request accepted so far durable now (the journal's writes are
        otherwise grouped into one commit per loop turn), and queue them. A request
        whose id the journal already holds finished gets that result instead."""
        self._flush_pending = False
        waiters, self._flush_waiters = self._flush_waiters, []
        try:
            self._commit()
        finally:
            for w in waiters:  # enqueue() returns: its request is durable (or rejected)
                if not w.done():
                    w.set_result(None)

    def _commit(self) -> None:
        starts, self._starts = self._starts, {}
        finishes, self._finishes = self._finishes, []
        both, self._start_finishes = self._start_finishes, []
        accepted, self._to_queue = self._to_queue, []
        if not (starts or finishes or both or accepted):
            return
        fresh: list[bool] = []
        try:
            with self.journal.batch():
                for job, doc, _ in accepted:
                    fresh.append(self.journal.accept(job.request.id, doc)[0])
                skipped = self.journal.record(
                    [(key, *row) for key, row in starts.items()], finishes, both)
            if skipped:  # never expected: each job is started and finished once
                log.warning("journal: %d start/finish writes named no unfinished request",
                            skipped)
        except Exception as e:  # noqa: BLE001 - e.g. a full disk: not accepted
            for job, _, _ in accepted:
                self._jobs.pop(job.request.id, None)
                self.n_rejected += 1
                if not job.future.done():
                    job.future.set_result(Result(
                        job.request.id, REJECTED, f"journal write failed: {e}",
                        queued_at=job.queued_at, finished_at=job.queued_at))
            log.error("journal write failed: %s", e)
            return
        queued = False
        for (job, _, digest), new in zip(accepted, fresh, strict=True):
            answer = None if new else self._stored_answer(job, digest)
            if answer is None:
                self._enqueue(job)
                queued = True
            else:  # finished under an earlier dispatcher: its result stands
                self._jobs.pop(job.request.id, None)
                job.future.set_result(answer)
        if queued:
            self._schedule()  # in this callback rather than one more loop callback later

    def _stored_answer(self, job: _Job, digest: str) -> Result | None:
        """The answer to a request whose id the journal already held: its stored result
        if it finished and is the same request, a rejection if it is another request,
        None if it is unfinished (it runs)."""
        row = self.journal.row(job.request.id)
        if row is None or row[2] is None:
            return None
        try:
            same = StoredRequest.parse(row[0]).digest == digest
        except ValueError:
            same = False
        if same:
            return Result.from_json(row[2])
        self.n_rejected += 1
        return Result(job.request.id, REJECTED, str(ConfigError("id", _taken(job.request.id))),
                      queued_at=job.queued_at, finished_at=job.queued_at)

    def _journal_start(self, key: str, pid: int | None, attempt: int) -> None:
        """Journal a start (with its process group, if any) in the next group commit."""
        self._starts[key] = (pid, attempt, time.time())
        self._commit_soon()

    def _journal_finish(self, key: str, result: str) -> None:
        """Journal a result in the next group commit; a start still waiting for that
        commit goes into the same row update (one write instead of two)."""
        start = self._starts.pop(key, None)
        if start is None:
            self._finishes.append((key, result, time.time()))
        else:
            _, attempt, t0 = start
            self._start_finishes.append((key, attempt, t0, result, time.time()))
        self._commit_soon()

    def _commit_soon(self) -> None:
        """Group commit within ``journal_delay_s``: a crash before then only means the
        request runs again (its acceptance is already durable)."""
        if self._flush_timer is None and self._loop is not None:
            self._flush_timer = self._loop.call_later(self.config.journal_delay_s,
                                                      self._timed_flush)

    def _timed_flush(self) -> None:
        self._flush_timer = None
        if not self._closed:
            self.flush()

    def _check(self, req: Request) -> Request:
        """What the request asks of this dispatcher's resources (ConfigError if it can
        never run here, or if it asks more than ``limits`` allow); cpu ``max_cores``
        above the node is capped to the node when it is queued (``ClusterState.submit``,
        as in simulation). Returns the request with the defaults of ``limits`` filled in
        (memory, wall time)."""
        limits = self.config.limits
        ram_mb = self.cluster.mem_gb_per_node * 1e9 / 2**20
        defaults = limits.defaults(req.kind, req.__dict__, ram_mb)
        if defaults:
            req = req.model_copy(update=defaults)
        node = self.cluster.cores_per_node
        if req.kind == "cpu":
            if req.min_cores > node:
                raise ConfigError("min_cores", f"{req.min_cores} cores asked, this dispatcher "
                                  f"has {node}")
            if req.mem_limit_mb is not None and req.mem_limit_mb > ram_mb:
                raise ConfigError("mem_limit_mb", f"must be <= {ram_mb:.0f} (MiB: this "
                                  f"machine's memory; got {req.mem_limit_mb:g})")
        elif req.kind == "gpu":
            if not self.devices:
                raise ConfigError("kind", f"gpu request, but {self.no_gpu_reason or 'no GPU'}")
            if req.service is not None:
                if req.service not in self.host.specs:
                    known = ", ".join(sorted(self.host.specs)) or "none"
                    raise ConfigError("service", f"unknown service {req.service!r} "
                                      f"(registered: {known})")
                if self.host.specs[req.service].mem_gb > self.cluster.gpu_mem_gb:
                    raise ConfigError("service", f"{req.service} needs more memory than a "
                                      "device has")
        else:
            ep = self.state.api.endpoints.get(req.endpoint)
            if ep is None:
                known = ", ".join(sorted(self.state.api.endpoints)) or "none"
                raise ConfigError("endpoint", f"unknown endpoint {req.endpoint!r} "
                                  f"(configured: {known})")
            if req.tokens > ep.spec.tok_capacity:
                raise ConfigError("tokens", f"{req.tokens} tokens exceed what endpoint "
                                  f"{req.endpoint} allows at once ({ep.spec.tok_capacity:g})")
        if req.argv:
            self._check_sandbox(req)
        limits.check(req.__dict__ if req.kind == "cpu" or req.argv
                     else {"timeout_s": req.timeout_s})
        return req

    def _check_sandbox(self, req: Request) -> None:
        """What a command asks of its sandbox, against this machine and against the
        sandbox its trajectory already has (the first command decides)."""
        if req.workspace_template is not None:
            self.config.sandbox.template(req.workspace_template)
        mb = req.workspace_mb
        if mb is not None and mb / 1024 > self.cluster.mem_gb_per_node:
            raise ConfigError("workspace_mb", f"{mb:g} MB exceeds this node's memory "
                              f"({self.cluster.mem_gb_per_node * 1024:g} MB)")
        sb = (self.boxes.get(req.trajectory) if self.boxes is not None
              and req.trajectory is not None else None)
        if sb is None:
            return
        network = req.network if req.network is not None else self.config.sandbox.network
        if network != sb.network:
            raise ConfigError("network", f"trajectory {req.trajectory}'s sandbox was made "
                              f"with network={str(sb.network).lower()}")
        template = sb.template.name if sb.template is not None else None
        if req.workspace_template is not None and req.workspace_template != template:
            raise ConfigError("workspace_template", f"trajectory {req.trajectory}'s workspace "
                              f"was made from {template or 'nothing'}")
        if mb is not None and int(mb * (1 << 20)) != sb.size_bytes:
            raise ConfigError("workspace_mb", f"trajectory {req.trajectory}'s workspace was "
                              f"made with {sb.size_bytes / (1 << 20):g} MB")

    def _enqueue(self, job: _Job) -> None:
        req = job.request
        state = self.state
        t = self._now()
        state.advance(t)
        self._jobs[req.id] = job
        traj = None
        if req.trajectory is not None:
            traj = self._trajs.get(req.trajectory)
            if traj is None:
                traj = Trajectory(self._next_traj, req.task, 0, [], None)
                self._next_traj += 1
                traj.start_t = t
                state.open_trajectory(traj)
                self._trajs[req.trajectory] = traj
            traj.turn = max(traj.turn, req.turn + 1)
            self._traj_live[traj.id] = self._traj_live.get(traj.id, 0) + 1
            self._traj_seen[traj.id] = t
            if req.reward:
                self._traj_ended.add(traj.id)
        if req.argv and self.boxes is not None and self.boxes.isolated:
            if not self._sandbox_ready_for(job, traj):
                return  # held until its sandbox is ready (it waits for memory or starts)
        self._submit(job, traj)

    def _sandbox_ready_for(self, job: _Job, traj: Trajectory | None) -> bool:
        """Whether ``job``'s sandbox is ready; if not, the job is held (and submitted
        by :meth:`_release_awaiting` once it is, or once it failed: then the job fails at
        its start, with the reason)."""
        req = job.request
        network = req.network if req.network is not None else self.config.sandbox.network
        if traj is None:
            sb = job.sandbox = self.boxes.shared(network)
            if sb.ready.done():
                return True
            held = self._shared_wait.setdefault(network, [])
            if not held:
                sb.ready.add_done_callback(lambda _: self._release_shared(network))
            held.append(job)
            return False
        if traj.id in self._awaiting_sandbox:  # its sandbox is not ready: keep the order
            self._awaiting_sandbox[traj.id].append(job)
            return False
        sb = job.sandbox = self.boxes.get(req.trajectory)
        if sb is not None:  # ready: until it is, its trajectory's jobs are held
            return True
        # The trajectory's first command (or its first since its sandbox failed).
        mb = req.workspace_mb or self.config.sandbox.workspace_mb
        self._awaiting_sandbox[traj.id] = [job]
        if traj.sandbox is None and not self.state.open_sandbox(
                traj, SandboxSpec(mem_gb=mb / 1024, startup_s=0.0)):
            self._sandbox_wait.append(traj)  # no sandbox memory free: wait
            return False
        self._open_sandbox(traj, req)
        return False

    def _open_sandbox(self, traj: Trajectory, req: Request) -> None:
        """Make the trajectory's sandbox; its held jobs are submitted when it is ready."""
        network = req.network if req.network is not None else self.config.sandbox.network
        template = (self.config.sandbox.template(req.workspace_template)
                    if req.workspace_template is not None else None)
        sb = self.boxes.open(req.trajectory, size_mb=traj.sandbox.mem_gb * 1024,
                             template=template, network=network)
        sb.ready.add_done_callback(lambda _: self._release_awaiting(traj, sb))

    def _release_awaiting(self, traj: Trajectory, sb: Sandbox) -> None:
        jobs = self._awaiting_sandbox.pop(traj.id, [])
        if self._closed:
            return
        for job in jobs:
            job.sandbox = sb
            self._submit(job, traj)

    def _release_shared(self, network: bool) -> None:
        for job in self._shared_wait.pop(network, []):
            if not self._closed:
                self._submit(job, None)

    def _open_waiting_sandboxes(self) -> None:
        """Sandbox memory was freed: open the sandboxes of trajectories waiting for it,
        in order, while it lasts."""
        q = self._sandbox_wait
        while q:
            traj = q[0]
            jobs = self._awaiting_sandbox.get(traj.id)
            if not jobs:  # closed meanwhile
                q.popleft()
                continue
            req = jobs[0].request
            mb = req.workspace_mb or self.config.sandbox.workspace_mb
            if not self.state.open_sandbox(traj, SandboxSpec(mem_gb=mb / 1024, startup_s=0.0)):
                return
            q.popleft()
            self._open_sandbox(traj, req)

    def _submit(self, job: _Job, traj: Trajectory | None) -> None:
        """Queue an accepted job in the state: the scheduler sees it from now on."""
        req = job.request
        state = self.state
        t = self._now()
        state.advance(t)
        if self._request_estimates and req.est_s is not None:
            est = req.est_s
        else:
            est = self.cost.estimate(req.signature, req.est_s)
        spec = ActionSpec(
            kind=req.kind, name=req.name, true_s=math.nan, est_s=est, timeout_s=req.timeout_s,
            min_cores=req.min_cores, max_cores=req.max_cores,
            parallel_fraction=req.parallel_fraction,
            service=(req.service or COMMAND_SERVICE) if req.kind == "gpu" else None,
            endpoint=req.endpoint, tokens=req.tokens, reward=req.reward)
        # Submitted when it was first accepted (a re-queued request keeps its age).
        submit_t = min(t, job.queued_at - self._wall0)
        a = Action(self._next_action, spec, req.task, traj, req.turn, submit_t)
        self._next_action += 1
        job.action = a
        self._by_action[a.id] = job
        state.submit(a)
        self._kick()

    # ------------------------------------------------------------------ scheduling

    def _now(self) -> float:
        return self._clock() - self._t0

    def _kick(self) -> None:
        """Ask for a scheduling pass soon (once per loop turn, however many events)."""
        if not self._kick_pending and self._loop is not None and not self._closed:
            self._kick_pending = True
            self._loop.call_soon(self._schedule)

    def _schedule(self) -> None:
        self._kick_pending = False
        if self._closed:
            return
        state = self.state
        state.advance(self._now())
        waited = False
        while state.decision_possible():
            forced = self.guard.overdue(state)
            if not forced:
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
                forced = grants
            for g in forced:
                try:
                    self._start(g)
                except InvalidGrant as e:
                    self._fall_back(f"scheduler {self.scheduler.name!r} made an invalid "
                                    f"grant: {e}")
                    break
        if waited and WaitGuard.idle(state):
            # An idle cluster is not kept idle (the simulator's rule too): serve what can
            # start, then ask again.
            forced = self.guard.overdue(state, stalled=True)
            for g in forced:
                self._start(g)
            if forced:
                self._kick()
        # Not while a gpu command waits for cores: a node's queue, refilled at every
        # exit, would keep them from it.
        if state.ahead_per_node and not self._closed and not self._core_waiters:
            for a in state.fill_ahead():
                self._start_ahead(a)
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
        if not waits:
            return
        delay = min(waits) + 1e-6
        loop = self._loop
        at = loop.time() + delay
        h = self._wake
        if h is not None and not h.cancelled() and h.when() <= at and h.when() > loop.time():
            return
        if h is not None:
            h.cancel()
        self._wake = loop.call_at(at, self._kick)

    def _start(self, g: Grant) -> None:
        state = self.state
        resident = None
        started, _ = state.start(g)
        if g.action.spec.kind == "gpu":
            resident = set(state.gpu.devices[g.device].resident)
        now_wall = self._wall0 + state.t
        jobs = [self._by_action[a.id] for a in started]
        kind = g.action.spec.kind
        for job in jobs:
            self._mark_started(job, now_wall)
        if kind == "cpu" and self.backend is not None:
            cmd = self._start_remote(jobs[0], g.action.node, g.cores)
            work = partial(self._run_remote, jobs[0], cmd)
        elif kind == "cpu":
            cores, own = self._grant_cores(g)
            jobs[0].alloc = {"cores": cores}
            work = partial(self._run_cpu, jobs[0], own, self._start_command(jobs[0], cores))
        elif kind == "gpu":
            for job in jobs:
                job.alloc = {"device": g.device, "batch": len(jobs)}
            work = partial(self._run_gpu, jobs, g.device, resident)
        else:
            jobs[0].alloc = {"endpoint": g.action.spec.endpoint}
            work = partial(self._run_api, jobs[0])
        self._spawn(work, jobs)

    def _spawn(self, work: Callable[[], Awaitable[None]], jobs: list[_Job]) -> None:
        task = self._loop.create_task(self._guarded(work, jobs))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _mark_started(self, job: _Job, now_wall: float) -> None:
        job.started_at = now_wall
        job.attempts += 1
        # A local command's start is journaled with its pid, once it runs (_on_pid);
        # a backend's commands are found by their id after a crash (kill_orphans).
        if self.journal is not None and (job.request.argv == () or self.backend):
            self._journal_start(job.request.id, None, job.attempts)

    def _note_started(self, promoted: list[Action]) -> None:
        """Actions a node's queue started on cores just left there (a round trip ago at
        most, on the node): their results say they started now."""
        for b in promoted:
            self._by_action[b.id].started_at = self._wall0 + self.state.t

    def _start_ahead(self, a: Action) -> None:
        """Hand an action the state put in its node's queue to the backend now: the node
        starts it when the commands before it there exit. For the journal it has started
        (a crash re-queues it, and the next dispatcher kills it where it runs)."""
        job = self._by_action[a.id]
        self._mark_started(job, self._wall0 + self.state.t)
        cmd = self._start_remote(job, a.node, a.cores)
        self._spawn(partial(self._run_remote, job, cmd), [job])

    # ------------------------------------------------------------------ executors

    async def _guarded(self, work: Callable[[], Awaitable[None]], jobs: list[_Job]) -> None:
        """Run an executor; if it breaks (a bug, not an action's failure), its actions
        end failed with the error instead of waiting forever. (``work`` makes its
        coroutine only once this runs: a task cancelled before its first step leaves no
        coroutine that was never awaited.)"""
        try:
            await work()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001
            log.exception("executor failed")
            for job in jobs:
                if job.request.id in self._jobs and job.action.status in ("running", AHEAD):
                    self._complete(job, Outcome(False, f"internal error: {type(e).__name__}: "
                                                f"{e}"))

    def _grant_cores(self, g: Grant) -> tuple[list[int], list[int]]:
        """The core ids of a started cpu grant, and those of them it took from the free
        pool (returned when it ends): first the ones its trajectory holds (the state has
        already counted a new hold), then free ones, least loaded first."""
        traj = g.action.traj
        held: list[int] = []
        if traj is not None and traj.held_cores:
            held = self._held_cores.setdefault(traj.id, [])
            held.extend(self._take_cores(traj.held_cores - len(held)))
        from_held = held[:g.cores]
        own = self._take_cores(g.cores - len(from_held))
        return from_held + own, own

    def _on_pid(self, job: _Job) -> Callable[[int], None]:
        def record(pid: int) -> None:
            if self.journal is not None:
                self._journal_start(job.request.id, pid, job.attempts)
        return record

    def _start_command(self, job: _Job, cores: list[int],
                       extra_env: Mapping[str, str] | None = None,
                       sandbox: Sandbox | None = None) -> Process | Exception:
        """Start a command now, not a loop turn later in its task: the time from a freed
        core to the next start is what leaves the core idle. It runs in ``sandbox``
        (default: the job's; isolation on) or on the host, in a cgroup slot when there
        are cgroups. An exception (a bug, not the action's failure) is handed to the task
        to report."""
        req = job.request
        try:
            proc = launch(
                req.argv, cores=cores, timeout_s=req.timeout_s, env=self._base_env,
                request_env=req.env, boxes=self.boxes,
                sandbox=sandbox if sandbox is not None else job.sandbox,
                cwd_root=self.run_dir.path,
                pids_max=req.pids_max or self.config.sandbox.pids_max,
                mem_limit_mb=req.mem_limit_mb, cpu_time_s=req.cpu_time_s,
                tail_bytes=self.config.tail_bytes,
                extra_env={ACTION_ENV: req.id, **(extra_env or {})},
                on_start=self._on_pid(job))
        except Exception as e:  # noqa: BLE001
            return e
        self._commands.add(proc)
        return proc

    def _command_spec(self, req: Request, extra_env: Mapping[str, str] | None = None,
                      gpu: int | None = None) -> CommandSpec:
        # The dispatcher's allow-listed environment, as its own commands get (no secret).
        return CommandSpec(req.argv, req.timeout_s, self._base_env, req.mem_limit_mb,
                           req.cpu_time_s, self.config.tail_bytes,
                           {ACTION_ENV: req.id, **(extra_env or {})}, req.env,
                           req.pids_max or self.config.sandbox.pids_max, gpu)

    def _start_remote(self, job: _Job, node: int, n_cores: int) -> Command | Exception:
        """Start a cpu action's command on the backend's ``node`` now (see
        :meth:`_start_command`)."""
        try:
            cmd = self.backend.start_command(node, n_cores, self._command_spec(job.request),
                                             job.sandbox)
        except Exception as e:  # noqa: BLE001
            return e
        job.alloc = {"node": self.backend.nodes[node].name, "cores": cmd.cores}
        self._commands.add(cmd)
        return cmd

    async def _run_remote(self, job: _Job, cmd: Command | Exception) -> None:
        try:
            if isinstance(cmd, Exception):
                raise cmd
            out = await cmd.wait()
        finally:
            self._commands.discard(cmd)
        if "cores" in out.detail:  # the node chose them (in its queue's order)
            job.alloc["cores"] = list(out.detail["cores"])
        self._complete(job, out)

    async def _run_cpu(self, job: _Job, cores: list[int], proc: Process | Exception) -> None:
        out = await self._wait_command(proc, lambda: self._free_cores.extend(cores))
        self._complete(job, out)

    async def _wait_command(self, proc: Process | Exception,
                            release: Callable[[], None]) -> Outcome:
        """How a started command ended; ``release`` gives its cores back, whatever
        happens (an exception from the start is raised here, for the task to report)."""
        try:
            if isinstance(proc, Exception):
                raise proc
            return await proc.wait()
        finally:
            self._commands.discard(proc)
            release()

    async def _run_gpu(self, jobs: list[_Job], device: int, resident: set[str]) -> None:
        dev = self.devices[device]
        first = jobs[0].request
        try:
            if first.service is None and self.backend is not None:
                self._complete(jobs[0], await self._run_device_command(jobs[0], device))
                return
            if first.service is None:  # a command that needs a device, and cores
                cores = await self._reserve_cores(first.min_cores)
                jobs[0].alloc["cores"] = cores
                try:  # its sandbox with its GPU's device nodes (isolation on)
                    sandbox = (await gpu_sandbox(self.boxes, jobs[0].sandbox, dev.nvml_index)
                               if self.boxes is not None else None)
                except OSError as e:
                    self._unreserve_cores(cores)
                    self._complete(jobs[0], Outcome(False, f"cannot start: {e.strerror or e}",
                                                    detail={"cores": cores}))
                    return
                proc = self._start_command(jobs[0], cores, extra_env=command_env(dev),
                                           sandbox=sandbox)
                out = await self._wait_command(proc, lambda: self._unreserve_cores(cores))
                self._complete(jobs[0], out)
                return
            batch = asyncio.ensure_future(self.host.run_batch(
                first.service, dev, resident, [j.request.payload for j in jobs]))
            waiting = sorted(jobs, key=lambda j: j.request.timeout_s)
            t_start = self._clock()
            while waiting and not batch.done():
                left = waiting[0].request.timeout_s - (self._clock() - t_start)
                done, _ = await asyncio.wait({batch}, timeout=max(0.0, left))
                if done:
                    break
                # The request's timeout passed: it fails now; the device stays busy until
                # the batch really ends (a forward pass cannot be interrupted).
                job = waiting.pop(0)
                self._complete(job, Outcome(False, f"timeout after {job.request.timeout_s:g} s"))
            out = await batch
            for i, job in enumerate(jobs):
                if job not in waiting:
                    continue
                value = out.value[i] if out.ok else None
                self._complete(job, Outcome(out.ok, out.reason, value=value,
                                            detail=dict(out.detail)))
        finally:
            if not self._closed:
                self.state.advance(self._now())
                self.state.release_device(device)
                self._kick()

    async def _run_device_command(self, job: _Job, device: int) -> Outcome:
        """A gpu command on a backend, confined as on one machine: on its device's node,
        in its trajectory's sandbox there, through the node's launch path (the backend's
        ``start_command``), with ``min_cores`` cores of that node counted busy, seeing
        its device alone."""
        req = job.request
        node = self.backend.device_node(device)
        traj = self._trajs.get(req.trajectory) if req.trajectory is not None else None
        names = [n.name[:12] for n in self.backend.nodes]
        if node < 0:
            return Outcome(False, f"GPU {device}'s node has no CPU the dispatcher grants")
        if job.sandbox is not None and traj is not None and traj.node not in (-1, node):
            return Outcome(False, f"trajectory {req.trajectory}'s sandbox is on node "
                           f"{names[traj.node]}, GPU {device} on node {names[node]} (a gpu "
                           f"command runs on its GPU's node)")
        await self._reserve_cores(req.min_cores, node)
        cmd: Command | None = None
        try:
            cmd = self.backend.start_command(
                node, req.min_cores, self._command_spec(req, command_env(self.devices[device]),
                                                        self.devices[device].nvml_index),
                job.sandbox)
            job.alloc.update(node=self.backend.nodes[node].name, cores=cmd.cores)
            self._commands.add(cmd)
            out = await cmd.wait()
            if "cores" in out.detail:  # the node chose them (in its queue's order)
                job.alloc["cores"] = list(out.detail["cores"])
            return out
        finally:
            if cmd is not None:
                self._commands.discard(cmd)
            self._unreserve_cores([], node, req.min_cores)

    async def _reserve_cores(self, k: int, node: int = 0) -> list[int]:
        """``k`` free cores of ``node`` for a gpu command, counted busy in the CPU pool
        (the scheduler does not grant them meanwhile); waits until that many are free.
        Their ids on this machine (on a backend's node: [], the backend picks them)."""
        if not self.state.reserve_cores(node, k):
            waiter = self._loop.create_future()
            self._core_waiters.append((k, node, waiter))
            return await waiter  # reserved for it by _serve_core_waiters
        return self._take_cores(k) if self.backend is None else []

    def _take_cores(self, k: int) -> list[int]:
        cores = self.monitor.least_loaded(self._free_cores, k)
        for c in cores:
            self._free_cores.remove(c)
        return cores

    def _unreserve_cores(self, cores: list[int], node: int = 0, k: int | None = None) -> None:
        """Give back a gpu command's reserved cores (``k`` of ``node``; default: the ids
        ``cores`` of this machine)."""
        self._free_cores.extend(cores)
        if not self._closed:
            self.state.advance(self._now())
            self._note_started(self.state.unreserve_cores(node, len(cores) if k is None else k))
            self._serve_core_waiters()
            self._kick()

    def _serve_core_waiters(self) -> None:
        """Cores were freed: gpu commands waiting for cores take them first, in order."""
        q = self._core_waiters
        while q:
            k, node, waiter = q[0]
            if waiter.done():
                q.popleft()
                continue
            if not self.state.reserve_cores(node, k):
                return
            q.popleft()
            waiter.set_result(self._take_cores(k) if self.backend is None else [])

    async def _run_api(self, job: _Job) -> None:
        req = job.request
        out = await call_api(req.http if req.call is None else req.call,
                             timeout_s=req.timeout_s, retry=self.config.retry,
                             before_retry=lambda: self._quota_for_retry(req),
                             client=self._http)
        self._complete(job, out)

    async def _quota_for_retry(self, req: Request) -> None:
        """A retry is a new request against the endpoint's quota: wait for it."""
        ep = self.state.api.endpoints[req.endpoint]
        while True:
            self.state.advance(self._now())
            t = self.state.t
            wait = ep.ready_in(req.tokens, t)
            if wait <= 0.0:
                ep.charge(req.tokens, t)
                self.state.metrics.request(t)
                self.state.version += 1
                return
            await asyncio.sleep(wait)

    def _complete(self, job: _Job, out: Outcome) -> None:
        """Record a finished action in the state, the cost model and the journal."""
        state = self.state
        state.advance(self._now())
        a = job.action
        was_ahead = a.status == AHEAD  # its result came first: no run time of its own here
        self._note_started(state.finish(a, out.ok, out.reason))
        if self.action_log is not None:
            self.action_log.record(a, batch=job.alloc.get("batch", 1),
                                   setup_s=float(out.detail.get("restore_s", 0.0)),
                                   exit_code=out.exit_code, core_ids=job.alloc.get("cores"),
                                   trajectory=job.request.trajectory)
        if out.ok and a.start_t == a.start_t and not was_ahead:
            self.cost.learn(a, state.t - a.start_t - float(out.detail.get("restore_s", 0.0)))
        finished_at = self._wall0 + state.t
        traj = a.traj
        if traj is not None:
            self._traj_live[traj.id] -= 1
            self._traj_seen[traj.id] = state.t
            if self._traj_live[traj.id] == 0 and traj.id in self._traj_ended:
                self._close_trajectory(traj)
        try:
            if a.spec.kind != "gpu":
                if a.spec.kind == "cpu" and self._core_waiters:
                    self._serve_core_waiters()
                # Now, not a loop turn later, and before the result is built and
                # journaled: the time from an exit to the next start is what leaves a
                # freed core idle.
                self._schedule()
        finally:
            attempts = out.attempts if a.spec.kind == "api" else job.attempts
            self._finish_job(job, Result(
                job.request.id, DONE if out.ok else FAILED, out.reason, out.exit_code,
                out.value, out.stdout, out.stderr, job.queued_at, job.started_at,
                finished_at, job.alloc, attempts))
        if a.spec.kind == "gpu":
            self._kick()  # the device frees after the whole batch has been recorded

    def _finish_job(self, job: _Job, result: Result) -> None:
        if self.journal is not None:
            self._journal_finish(result.id, result.to_json())
        self._jobs.pop(result.id, None)
        if job.action is not None:
            self._by_action.pop(job.action.id, None)
        if not job.future.done():
            job.future.set_result(result)

    def _close_trajectory(self, traj: Trajectory) -> None:
        """The trajectory is over: its held cores, sandbox memory and sandbox (its
        workspace, and whatever still runs in it) are released."""
        self.state.close_trajectory(traj)
        self._free_cores.extend(self._held_cores.pop(traj.id, ()))
        if self.action_log is not None:
            self.action_log.forget(traj.id)
        self._traj_live.pop(traj.id, None)
        self._traj_ended.discard(traj.id)
        self._traj_seen.pop(traj.id, None)
        for name, tr in list(self._trajs.items()):
            if tr is traj:
                del self._trajs[name]
                if self.boxes is not None:
                    self.boxes.close_trajectory(name)
        if traj.sandbox is not None and self._sandbox_wait:
            self._open_waiting_sandboxes()

    def close_trajectory(self, name: str) -> None:
        """Close trajectory ``name`` as its reward action would: once nothing of it is
        queued or running (now, if nothing is), its workspace is removed and its
        sandbox memory returns to the pool. A later request naming it starts anew."""
        traj = self._trajs.get(name)
        if traj is None:
            return
        self._traj_ended.add(traj.id)
        if self._traj_live.get(traj.id, 0) == 0:
            self._close_trajectory(traj)
            self._kick()

    async def _tick(self) -> None:
        """Sample the machine; close trajectories idle too long."""
        interval = self.config.sample_interval_s
        while True:
            await asyncio.sleep(interval)
            self.monitor.sample()
            t = self._now()
            idle = self.config.trajectory_idle_s
            for traj in list(self._trajs.values()):
                if (self._traj_live.get(traj.id, 0) == 0
                        and t - self._traj_seen.get(traj.id, t) > idle):
                    self._close_trajectory(traj)
                    self._kick()

    # ------------------------------------------------------------------ reading

    def observe(self) -> dict[str, np.ndarray]:
        """The policy's observation of the live state now (same encoder as the env)."""
        if self.encoder is None:
            raise RuntimeError("the machine exceeds the observation's sizes")
        self.state.advance(self._now())
        return self.encoder.observe(self.state)

    def stats(self) -> dict[str, Any]:
        """Counters, decision latency percentiles (µs) and measured utilisation."""
        s = self.state
        lat = self.latency_ns.array(float) / 1e3
        pct = ({f"p{q}": float(np.percentile(lat, q)) for q in (50, 90, 99)} if lat.size
               else {})
        return {"scheduler": self.scheduler.name if self.scheduler else None,
                "fallback": self.fallback_reason, "submitted": s.n_submitted,
                "done": s.n_done, "failed": s.n_failed, "rejected": self.n_rejected,
                "queued": s.n_pending, "running": s.n_running,
                # Pipelining: cpu commands handed to each node ahead of its free cores
                # (in its queue there: neither queued here nor running).
                "queued_at_node": [len(q) for q in s.ahead],
                "ahead_per_core": self.ahead_per_core,
                "decisions": self.n_decisions, "grants": s.n_grants,
                "guard_fired": self.guard.fired, "decision_latency_us": pct,
                "awaiting_resubmission": len(self._held),
                "measured_utilisation": self.monitor.summary() if self.backend is None else {},
                "confinement": self.boxes.describe() if self.boxes is not None else None,
                # Whether a trajectory's commands share one working directory (its
                # sandbox's workspace); without isolation each has a scratch one.
                "trajectory_workspaces": self.boxes is not None and self.boxes.isolated}

    def run_result(self) -> RunResult:
        """What this dispatcher measured, in the simulator's form (for the same
        tables and plots as evaluation)."""
        s = self.state
        s.advance(self._now())
        counters = {"decisions": self.n_decisions, "grants": s.n_grants,
                    "submitted": s.n_submitted, "completed": s.n_done, "failed": s.n_failed,
                    "pending": s.n_pending + s.n_running, "gpu_restores": s.gpu.restores,
                    "gpu_evictions": s.gpu.evictions, "guard_fired": self.guard.fired}
        eps = s.api.endpoints.values()
        return RunResult.from_recorder(
            s.metrics, {"cpu": float(s.cpu.total), "gpu": float(s.gpu.total),
                        "api": float(s.api.total)},
            sum(e.spec.rpm / 60.0 for e in eps), sum(e.spec.req_capacity for e in eps), s.t,
            counters)

    def status(self) -> dict[str, Any]:
        """:meth:`stats` plus the pools as they are now: cores (busy, free), GPU devices
        (busy, resident services), API endpoints (quota, calls in flight, what the
        windows admit), the queue by kind, and the utilisation granted so far."""
        s = self.state
        s.advance(self._now())
        cpu = s.cpu
        devices = [{"index": d.index, "mem_gb": d.mem_gb, "busy": d.busy,
                    "resident": sorted(d.resident)} for d in s.gpu.devices]
        endpoints = {name: {"rpm": ep.spec.rpm, "tpm": ep.spec.tpm,
                            "max_concurrency": ep.spec.max_concurrency,
                            "in_flight": ep.in_flight, "requests_available": ep.req,
                            "tokens_available": None if ep.spec.tpm is None else ep.tok,
                            "requests": ep.requests}
                     for name, ep in s.api.endpoints.items()}
        granted = self.run_result().utilisation()
        return {**self.stats(),
                "queue": {kind: len(q) for kind, q in s.pending.items()},
                "pools": {"cpu": {"cores": list(self.cores), "busy": cpu.busy,
                                  "free": sum(cpu.free), "held": cpu.held,
                                  "mem_gb": cpu.mem_gb[0], "mem_gb_free": cpu.mem_free[0]},
                          "gpu": {"devices": devices, "reason": self.no_gpu_reason},
                          "api": endpoints},
                "granted_utilisation": {k: float(v) for k, v in granted.items()},
                "limits": self.config.limits.to_dict(),
                "uptime_s": s.t}

    def find(self, rid: str) -> tuple[str, Result | None] | None:
        """Where request ``rid`` stands: ``("queued", None)`` or ``("running", None)``
        while it is this dispatcher's, ``("finished", result)`` once the journal holds
        its result (a finished request is not kept in memory: without a journal it is
        unknown here), None if it is unknown."""
        job = self._jobs.get(rid)
        if job is not None:
            return ("queued" if job.started_at is None else "running"), None
        if rid in self._held:
            return "queued", None
        if self.journal is None:
            return None
        self.flush()  # a result waiting for its group commit is read back too
        row = self.journal.row(rid)
        if row is None:
            return None
        if row[2] is None:
            return "queued", None
        return "finished", Result.from_json(row[2])


def _taken(rid: str) -> str:
    """Why a request is rejected whose id belongs to another request."""
    return (f"{rid!r} was accepted before with a different request; give this one another "
            f"id (or, to start over, use a new journal)")


def _same_request(a: Request, b: Request) -> bool:
    """Whether two requests under one id are the same (payloads that cannot be
    compared, e.g. arrays, are taken as equal)."""
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return True


__all__ = ["COMMAND_SERVICE", "Dispatcher", "DispatcherConfig"]
