"""What every backend's executors share: starting a grant (:meth:`Executors.start`),
GPU service batches, API calls, cores reserved for gpu commands, and the guard that
fails an executor's actions if it breaks. Commands are the backend's:
:class:`~metasched.runtime.dispatch.executors.local.LocalExecutors`,
:class:`~metasched.runtime.dispatch.executors.nodes.NodeExecutors`."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Protocol

from metasched.core.actions import AHEAD, Action, Grant
from metasched.runtime.api_calls import call_api
from metasched.runtime.dispatch.jobs import Job
from metasched.runtime.dispatch.journal_writer import JournalWriter
from metasched.runtime.dispatch.shared import Shared
from metasched.runtime.gpu import GpuHost, LiveDevice
from metasched.runtime.outcome import Outcome
from metasched.runtime.requests import Request


class ExecutorHost(Shared, Protocol):
    """What the executors ask of their dispatcher
    (the :class:`~.dispatcher.Dispatcher`)."""

    devices: list[LiveDevice]
    host: GpuHost
    http: Any  # the pooled HTTP client of API calls (made at start)
    writer: JournalWriter | None

    def complete(self, job: Job, out: Outcome) -> None: ...

    def note_started(self, promoted: list[Action]) -> None: ...


log = logging.getLogger("metasched.dispatch")


class Executors:
    """Runs dispatcher ``d``'s grants. Subclasses run commands (cpu, and gpu commands:
    a gpu request without a service): :meth:`start_cpu`, :meth:`run_gpu_command`,
    :meth:`reserved_ids`, :meth:`release_held` and, with ahead queues,
    :meth:`start_ahead`."""

    # Whether a command's start is journaled with its process group once it runs (the
    # next dispatcher finds it by that), rather than at its grant.
    PIDS_JOURNALED = False
    # Whether commands can start time-shared on given (busy) cores (start_shared).
    SHARES = False

    def __init__(self, d: ExecutorHost) -> None:
        self.d = d
        # Started commands whose task has not finished waiting for them: on close, any
        # whose task never ran is abandoned (killed and cleaned up) rather than leaked.
        self.commands: set[Any] = set()
        self.tasks: set[asyncio.Task] = set()
        # gpu commands waiting for cores: (how many, on which node, the waiter)
        self.core_waiters: deque[tuple[int, int, asyncio.Future]] = deque()

    # ------------------------------------------------------------ what a backend adds

    @classmethod
    def check_ahead(cls, ahead: int) -> None:
        """ConfigError if ``ahead`` commands per core cannot be handed to nodes."""

    def start_cpu(self, job: Job, g: Grant) -> Callable[[], Awaitable[None]] | None:
        """Start a granted cpu command now; what waits for it, as its task's work (None:
        the command completes its job itself when it ends)."""
        raise NotImplementedError

    async def run_gpu_command(self, job: Job, device: int) -> None:
        """Run a gpu command on ``device``, with cores, and complete its job."""
        raise NotImplementedError

    def reserved_ids(self, k: int) -> list[int]:
        """The ids of ``k`` cores just reserved in the CPU pool ([]: the backend's to
        pick)."""
        raise NotImplementedError

    def release_held(self, traj_id: int) -> None:
        """A trajectory closed: the cores it held return to the free ones."""

    def start_shared(self, job: Job, cores: list[int], release: Callable[[], None]) -> None:
        """Start a cpu command time-shared on core ids ``cores`` (already busy: it
        takes none of them) and its task; ``release`` once it has ended."""
        raise NotImplementedError

    def start_ahead(self, a: Action) -> None:
        """Hand an action the state put in its node's queue to the backend now."""
        raise NotImplementedError

    def free(self, cores: list[int]) -> None:
        """Core ids of this machine return to the free ones."""

    # ------------------------------------------------------------ granting

    def start(self, g: Grant) -> None:
        """Start grant ``g`` (taken in the state now) and its executor's task."""
        d = self.d
        state = d.state
        resident = None
        started, _ = state.start(g)
        if g.action.spec.kind == "gpu":
            resident = set(state.gpu.devices[g.device].resident)
        now_wall = d.loop.wall0 + state.t
        jobs = [d.jobs.of_action(a.id) for a in started]
        kind = g.action.spec.kind
        for job in jobs:
            self.mark_started(job, now_wall)
        if kind == "cpu":
            work = self.start_cpu(jobs[0], g)
        elif kind == "gpu":
            for job in jobs:
                job.alloc = {"device": g.device, "batch": len(jobs)}
            work = partial(self._run_gpu, jobs, g.device, resident)
        else:
            jobs[0].alloc = {"endpoint": g.action.spec.endpoint}
            work = partial(self._run_api, jobs[0])
        if work is not None:  # None: the command calls back when it ends (no task)
            self.spawn(work, jobs)

    def spawn(self, work: Callable[[], Awaitable[None]], jobs: list[Job]) -> None:
        task = self.d.loop.task(self._guarded(work, jobs))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def mark_started(self, job: Job, now_wall: float) -> None:
        job.started_at = now_wall
        job.attempts += 1
        # A local command's start is journaled with its pid, once it runs (on_start);
        # a backend's commands are found by their id after a crash (kill_orphans).
        if self.d.writer is not None and (job.request.argv == () or not self.PIDS_JOURNALED):
            self.d.writer.start(job.request.id, None, job.attempts)

    async def _guarded(self, work: Callable[[], Awaitable[None]], jobs: list[Job]) -> None:
        """Run an executor; if it breaks (a bug, not an action's failure), its actions
        end failed with the error instead of waiting forever. (``work`` makes its
        coroutine only once this runs: a task cancelled before its first step leaves no
        coroutine that was never awaited.)"""
        try:
            await work()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001
            self.broke(jobs, e)

    def broke(self, jobs: list[Job], e: Exception) -> None:
        """An executor broke with ``e`` (a bug): its actions still running end failed."""
        log.exception("executor failed", exc_info=e)
        for job in jobs:
            if (self.d.jobs.get(job.request.id) is not None
                    and job.action.status in ("running", AHEAD)):
                self.d.complete(job, Outcome(False, f"internal error: "
                                              f"{type(e).__name__}: {e}"))

    # ------------------------------------------------------------ gpu

    async def _run_gpu(self, jobs: list[Job], device: int, resident: set[str]) -> None:
        d = self.d
        dev = d.devices[device]
        first = jobs[0].request
        try:
            if first.service is None:  # a command that needs a device, and cores
                await self.run_gpu_command(jobs[0], device)
                return
            batch = asyncio.ensure_future(d.host.run_batch(
                first.service, dev, resident, [j.request.payload for j in jobs]))
            waiting = sorted(jobs, key=lambda j: j.request.timeout_s)
            t_start = d.loop.monotonic()
            while waiting and not batch.done():
                left = waiting[0].request.timeout_s - (d.loop.monotonic() - t_start)
                done, _ = await asyncio.wait({batch}, timeout=max(0.0, left))
                if done:
                    break
                # The request's timeout passed: it fails now; the device stays busy until
                # the batch really ends (a forward pass cannot be interrupted).
                job = waiting.pop(0)
                d.complete(job, Outcome(False, f"timeout after {job.request.timeout_s:g} s"))
            out = await batch
            for i, job in enumerate(jobs):
                if job not in waiting:
                    continue
                value = out.value[i] if out.ok else None
                d.complete(job, Outcome(out.ok, out.reason, value=value,
                                         detail=dict(out.detail)))
        finally:
            if not d.loop.closed:
                d.state.advance(d.loop.now())
                d.state.release_device(device)
                d.loop.kick()

    async def reserve_cores(self, k: int, node: int = 0) -> list[int]:
        """``k`` free cores of ``node`` for a gpu command, counted busy in the CPU pool
        (the scheduler does not grant them meanwhile); waits until that many are free.
        Their ids (see :meth:`reserved_ids`)."""
        if not self.d.state.reserve_cores(node, k):
            waiter = self.d.loop.future()
            self.core_waiters.append((k, node, waiter))
            return await waiter  # reserved for it by serve_core_waiters
        return self.reserved_ids(k)

    def unreserve_cores(self, cores: list[int], node: int = 0, k: int | None = None) -> None:
        """Give back a gpu command's reserved cores (``k`` of ``node``; default: the ids
        ``cores`` of this machine)."""
        d = self.d
        self.free(cores)
        if not d.loop.closed:
            d.state.advance(d.loop.now())
            d.note_started(d.state.unreserve_cores(node, len(cores) if k is None else k))
            self.serve_core_waiters()
            d.loop.kick()

    def serve_core_waiters(self) -> None:
        """Cores were freed: gpu commands waiting for cores take them first, in order."""
        q = self.core_waiters
        while q:
            k, node, waiter = q[0]
            if waiter.done():
                q.popleft()
                continue
            if not self.d.state.reserve_cores(node, k):
                return
            q.popleft()
            waiter.set_result(self.reserved_ids(k))

    # ------------------------------------------------------------ api

    async def _run_api(self, job: Job) -> None:
        req = job.request
        out = await call_api(req.http if req.call is None else req.call,
                             timeout_s=req.timeout_s, retry=self.d.config.retry,
                             before_retry=lambda: self._quota_for_retry(req),
                             client=self.d.http)
        self.d.complete(job, out)

    async def _quota_for_retry(self, req: Request) -> None:
        """A retry is a new request against the endpoint's quota: wait for it."""
        state = self.d.state
        ep = state.api.endpoints[req.endpoint]
        while True:
            state.advance(self.d.loop.now())
            t = state.t
            wait = ep.ready_in(req.tokens, t)
            if wait <= 0.0:
                ep.charge(req.tokens, t)
                state.metrics.request(t)
                state.version += 1
                return
            await asyncio.sleep(wait)

    # ------------------------------------------------------------ closing

    async def close(self) -> None:
        """Cancel the executors' tasks; abandon commands started whose task never ran."""
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
        for proc in self.commands:  # started, but cancelled before its task first ran
            proc.abandon()
        self.commands.clear()


__all__ = ["Executors"]
