"""Finished actions as a JSONL trace: what either clock measured, streamed to a file.

Every finished action becomes one ``{"type": "action", ...}`` line of the trace schema
(``metasched.sim.trace``; ``docs/concepts/traces.md``), with a ``measured`` object beside it:
the trajectory and turn it belonged to, its queue wait and run time, how it ended, its
allocation (cores, core ids, device, batch, setup time) and the generation gap before it
(its submission minus the previous action's finish in the same trajectory). A first
``{"type": "cluster", ...}`` line records the resources (cluster and GPU services) the
actions ran on; a live clock appending to an existing trace writes one again when it
starts (a service started anew, its quotas full). ``workload.trace=`` replays such a
file (the actions arrive at their recorded times); ``metasched-calibrate`` fits a
workload profile to it.

The simulator and the live dispatcher write the same lines through one
:class:`TraceWriter`, so a calibration fitted on a simulated trace is fitted by the code
that reads live ones. Writing is streamed: one line per action, buffered and flushed at
least every ``flush_s``; what is kept in memory is one float per live trajectory.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from metasched.core.actions import Action
from metasched.core.cluster_config import ClusterConfig
from metasched.core.pools import ServiceSpec
from metasched.errors import ConfigError

PathLike = str | os.PathLike

# What ``measured.status`` says: the action finished, failed, was killed at its timeout,
# or was cancelled by its caller (dropped from the queue, or killed while it ran).
DONE, FAILED, TIMEOUT, CANCELLED = "done", "failed", "timeout", "cancelled"


def cluster_doc(cluster: ClusterConfig) -> dict[str, Any]:
    """``cluster`` in the ``configs/cluster/*.yaml`` form (``parse_cluster`` reads it)."""
    endpoints = {}
    for name, e in cluster.endpoints.items():
        ep: dict[str, Any] = {"rpm": float(e.rpm), "max_concurrency": int(e.max_concurrency)}
        if e.tpm is not None:
            ep["tpm"] = float(e.tpm)
        if e.window_s != 60.0:
            ep["window_s"] = float(e.window_s)
        endpoints[name] = ep
    return {"name": cluster.name,
            "cpu": {"nodes": int(cluster.cpu_nodes), "cores_per_node": int(cluster.cores_per_node),
                    "mem_gb_per_node": float(cluster.mem_gb_per_node)},
            "gpu": {"devices": int(cluster.gpu_devices), "mem_gb": float(cluster.gpu_mem_gb)},
            "api": {"endpoints": endpoints}}


def services_doc(services: dict[str, ServiceSpec]) -> dict[str, Any]:
    """GPU services in the ``services:`` form of a workload profile."""
    return {name: {"mem_gb": float(s.mem_gb), "restore_s": float(s.restore_s),
                   "max_batch": int(s.max_batch), "batch_marginal": float(s.batch_marginal)}
            for name, s in services.items()}


def status_of(ok: bool, reason: str) -> str:
    """``measured.status`` of an action that ended ``ok`` or failed with ``reason``."""
    if ok:
        return DONE
    if reason == CANCELLED:
        return CANCELLED
    return TIMEOUT if reason.startswith("timeout") else FAILED


class TraceWriter:
    """Appends finished actions to a JSONL trace (see the module docstring).

    Args:
        path: the trace file. An existing file is appended to (a resumed dispatcher
            keeps what the last one wrote); its first line's ``started_at`` stays the
            origin of every ``arrival_s``.
        cluster, services: the resources, written as the first line of a new file.
        started_at: the wall-clock time (Unix seconds) that the clock's 0 stands for
            (None: the simulator's clock, whose 0 is the run's start).
        flush_s: the longest a written line waits in the buffer.
    """

    def __init__(self, path: PathLike, cluster: ClusterConfig,
                 services: dict[str, ServiceSpec] | None = None, *,
                 started_at: float | None = None, flush_s: float = 1.0) -> None:
        self.path = Path(path)
        self._offset = 0.0  # added to the clock's times: seconds since the trace's origin
        origin = _origin(self.path)
        if origin is not None and started_at is not None:
            self._offset = started_at - origin
        try:
            new = not self.path.exists() or self.path.stat().st_size == 0
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - see close()
        except OSError as e:
            raise ConfigError("trace", f"{self.path}: cannot write there "
                              f"({e.strerror or type(e).__name__})") from None
        self._flush_s = flush_s
        self._flushed = time.monotonic()
        self._last_end: dict[int, float] = {}  # live trajectory id -> its last finish
        self.n_written = 0
        # A new file starts with the resources; a live clock appending to an existing
        # one (a restarted service) writes them again, with its own start: what ran
        # after that line ran on a fresh service, whose API quotas started full.
        if new or started_at is not None:
            head: dict[str, Any] = {"type": "cluster", **cluster_doc(cluster),
                                    "services": services_doc(services or {})}
            if started_at is not None:
                head["started_at"] = float(started_at)
            self._write(head)

    def record(self, a: Action, *, step: int | None = None, batch: int = 1, setup_s: float = 0.0,
               exit_code: int | None = None, core_ids: list[int] | None = None,
               trajectory: str | None = None, duration_s: float | None = None,
               prompt: str | None = None) -> None:
        """Write ``a``, which has just finished (``end_t``, ``status`` and ``reason`` set).

        Args:
            step: the RL step of its trajectory, where the clock knows it.
            batch: requests in the GPU batch it ran in.
            setup_s: time before it ran that its allocation cost (a GPU service restore).
            exit_code: a command's exit status.
            core_ids: the cores a live CPU action was pinned to.
            trajectory: the trajectory's name (default: its id in the state).
            duration_s: its true base duration where the clock knows it (the simulator);
                otherwise it is derived from what was measured (below).
            prompt: the prompt its trajectory answers (GRPO siblings share one), where
                the clock knows it.
        """
        spec = a.spec
        start = a.start_t if a.start_t == a.start_t else a.end_t
        run_s = max(0.0, a.end_t - start)
        work_s = max(0.0, run_s - setup_s)
        if duration_s is None or not duration_s == duration_s:
            # One-core seconds under the declared Amdahl fraction (cpu), the batch's
            # time (gpu), the call's latency (api): what replay runs again.
            duration_s = work_s * spec.speedup(a.cores) if spec.kind == "cpu" else work_s
        act: dict[str, Any] = {"kind": spec.kind, "name": spec.name,
                               "duration_s": _positive(duration_s),
                               "est_s": _positive(spec.est_s),
                               "timeout_s": float(spec.timeout_s)}
        if spec.kind == "cpu":
            act.update(min_cores=int(spec.min_cores), max_cores=int(spec.max_cores),
                       parallel_fraction=float(spec.parallel_fraction))
        elif spec.kind == "gpu":
            act["service"] = spec.service
        else:
            act.update(endpoint=spec.endpoint, tokens=int(spec.tokens))
        if spec.reward:
            act["reward"] = True
        m: dict[str, Any] = {"queue_s": max(0.0, start - a.submit_t), "run_s": run_s,
                             "status": status_of(a.status == "done", a.reason)}
        if a.status != "done" and a.reason:
            m["reason"] = a.reason
        if exit_code is not None:
            m["exit_code"] = int(exit_code)
        if spec.kind == "cpu":
            m["cores"] = int(a.cores)
            if core_ids is not None:
                m["core_ids"] = [int(c) for c in core_ids]
        elif spec.kind == "gpu":
            m.update(device=int(a.device), batch=int(batch), setup_s=float(setup_s))
        traj = a.traj
        if traj is not None:
            m["trajectory"] = trajectory if trajectory is not None else str(traj.id)
            m["turn"] = int(a.turn)
            if prompt is not None:
                m["prompt"] = str(prompt)
            if step is not None:
                m["step"] = int(step)
            prev = self._last_end.get(traj.id)
            if prev is not None:
                m["gap_s"] = max(0.0, a.submit_t - prev)
            if spec.reward:
                self._last_end.pop(traj.id, None)
            else:
                self._last_end[traj.id] = a.end_t
        self._write({"type": "action", "arrival_s": max(0.0, a.submit_t + self._offset),
                     "task": a.task, "action": act, "measured": m})
        self.n_written += 1

    def record_generation(self, line: dict[str, Any]) -> None:
        """Write one finished LLM turn as a ``generation`` line (the fields of
        :class:`~metasched.core.engine.GenerationLine`)."""
        self._write({"type": "generation", **line})

    def forget(self, trajectory_id: int) -> None:
        """Drop a trajectory that closed without its reward action (its last finish)."""
        self._last_end.pop(trajectory_id, None)

    def _write(self, obj: dict[str, Any]) -> None:
        self._file.write(json.dumps(obj, separators=(",", ":"), allow_nan=False) + "\n")
        now = time.monotonic()
        if now - self._flushed >= self._flush_s:
            self._file.flush()
            self._flushed = now

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _positive(x: float) -> float:
    """A duration the trace schema accepts (> 0): a run measured as 0 s on a coarse
    clock is written as a microsecond."""
    x = float(x)
    return x if x > 1e-6 and math.isfinite(x) else 1e-6


def _origin(path: Path) -> float | None:
    """``started_at`` of an existing trace's first line, if it has one."""
    try:
        with open(path, encoding="utf-8") as f:
            first = f.readline()
        head = json.loads(first)
    except (OSError, ValueError):
        return None
    v = head.get("started_at") if isinstance(head, dict) else None
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


__all__ = ["TraceWriter", "cluster_doc", "services_doc", "status_of"]
