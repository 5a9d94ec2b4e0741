"""What a dispatcher reports: counters and decision latencies (:func:`stats`), the
pools as they are now (:func:`status`), its measurements in the simulator's form
(:func:`run_result`) and where one request stands (:func:`find`)."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from metasched.core import renamed
from metasched.core.guard import WaitGuard
from metasched.core.metrics import Ring, RunResult
from metasched.core.scheduler import Scheduler
from metasched.runtime.backend import Backend
from metasched.runtime.dispatch.admission import Admission
from metasched.runtime.dispatch.cancellation import Cancellation
from metasched.runtime.dispatch.journal_writer import JournalWriter
from metasched.runtime.dispatch.shared import Shared
from metasched.runtime.dispatch.sharing import Sharing
from metasched.runtime.journal import Journal
from metasched.runtime.requests import Result


class StatusHost(Shared, Protocol):
    """What stats and status read of their dispatcher
    (the :class:`~.dispatcher.Dispatcher`)."""

    admission: Admission
    ahead_per_core: int
    backend: Backend
    cancellation: Cancellation
    cores: list[int]
    fallback_reason: str
    guard: WaitGuard
    journal: Journal | None
    latency_ns: Ring
    n_decisions: int
    n_rejected: int
    no_gpu_reason: str
    sandboxes: Any  # the backend's sandboxes (made at start)
    scheduler: Scheduler | None
    sharing: Sharing
    writer: JournalWriter | None


def stats(d: StatusHost) -> dict[str, Any]:
    """See :meth:`Dispatcher.stats`."""
    s = d.state
    lat = d.latency_ns.array(float) / 1e3
    pct = ({f"p{q}": float(np.percentile(lat, q)) for q in (50, 90, 99)} if lat.size
           else {})
    return renamed.metrics({"scheduler": d.scheduler.name if d.scheduler else None,
            "fallback": d.fallback_reason, "submitted": s.n_submitted,
            "done": s.n_done, "failed": s.n_failed, "rejected": d.n_rejected,
            # Ended at their caller's word (counted in failed too, as the state counts).
            "cancelled": d.cancellation.n,
            "queued": s.n_pending, "running": s.n_running,
            # Handing ahead: cpu commands handed to each node ahead of its free cores
            # (in its queue there: neither queued here nor running).
            "ahead_at_node": [len(q) for q in s.ahead],
            "ahead_per_core": d.ahead_per_core,
            "decisions": d.n_decisions, "grants": s.n_grants,
            "guard_fired": d.guard.fired, "decision_latency_us": pct,
            "awaiting_resubmission": len(d.admission.held),
            "measured_utilisation": d.backend.measured_utilisation(),
            "sandboxes": d.sandboxes.describe() if d.sandboxes is not None else None,
            # Whether a trajectory's commands share one working directory (its
            # sandbox's workspace); without isolation each has a scratch one.
            "trajectory_workspaces": d.sandboxes is not None and d.sandboxes.isolated,
            # Commands started time-shared (at their latest start, or on idle cores)
            # and refused at their latest start (metasched.runtime.dispatch.sharing).
            **d.sharing.stats()})


def run_result(d: StatusHost) -> RunResult:
    """See :meth:`Dispatcher.run_result`."""
    s = d.state
    s.advance(d.loop.now())
    counters = {"decisions": d.n_decisions, "grants": s.n_grants,
                "submitted": s.n_submitted, "completed": s.n_done, "failed": s.n_failed,
                "pending": s.n_pending + s.n_running, "gpu_restores": s.gpu.restores,
                "gpu_evictions": s.gpu.evictions, "guard_fired": d.guard.fired}
    eps = s.api.endpoints.values()
    return RunResult.from_recorder(
        s.metrics, {"cpu": float(s.cpu.total), "gpu": float(s.gpu.total),
                    "api": float(s.api.total)},
        sum(e.spec.rpm / 60.0 for e in eps), sum(e.spec.req_capacity for e in eps), s.t,
        counters)


def status(d: StatusHost) -> dict[str, Any]:
    """See :meth:`Dispatcher.status`."""
    s = d.state
    s.advance(d.loop.now())
    cpu = s.cpu
    devices = [{"index": dev.index, "mem_gb": dev.mem_gb, "busy": dev.busy,
                "resident": sorted(dev.resident)} for dev in s.gpu.devices]
    endpoints = {name: {"rpm": ep.spec.rpm, "tpm": ep.spec.tpm,
                        "max_concurrency": ep.spec.max_concurrency,
                        "in_flight": ep.in_flight, "requests_available": ep.req,
                        "tokens_available": None if ep.spec.tpm is None else ep.tok,
                        "requests": ep.requests}
                 for name, ep in s.api.endpoints.items()}
    granted = run_result(d).utilisation()
    return {**stats(d),
            "queue": {kind: len(q) for kind, q in s.pending.items()},
            "pools": {"cpu": {"cores": list(d.cores), "busy": cpu.busy,
                              "free": sum(cpu.free), "held": cpu.held,
                              "mem_gb": cpu.mem_gb[0], "mem_gb_free": cpu.mem_free[0]},
                      "gpu": {"devices": devices, "reason": d.no_gpu_reason},
                      "api": endpoints},
            "granted_utilisation": {k: float(v) for k, v in granted.items()},
            "limits": d.config.limits.to_dict(),
            "uptime_s": s.t}


def find(d: StatusHost, rid: str) -> tuple[str, Result | None] | None:
    """See :meth:`Dispatcher.find`."""
    job = d.jobs.get(rid)
    if job is not None:
        return ("queued" if job.started_at is None else "running"), None
    if rid in d.admission.held:
        return "queued", None
    if d.writer is None:
        return None
    d.writer.flush()  # a result waiting for its group commit is read back too
    row = d.journal.row(rid)
    if row is None:
        return None
    if row[2] is None:
        return "queued", None
    return "finished", Result.from_json(row[2])


__all__ = ["find", "run_result", "stats", "status"]
