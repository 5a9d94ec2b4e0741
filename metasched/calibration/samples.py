"""Reading a recorded trace into what calibration fits: per action type, the measured
durations and allocations; per task, turns per trajectory and generation gaps; the RL
steps; the cluster.

A recorded trace is a stream of ``action`` lines with ``measured`` objects (written by
:class:`metasched.core.trace_writer.TraceWriter`, live or simulated). Lines without
``measured`` (and ``trajectory`` lines) carry no measurements and are counted, not used.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from metasched.core.engine import GenerationLine
from metasched.errors import ConfigError
from metasched.sim.trace import TraceHeader, scan_trace

PathLike = str | os.PathLike
Stages = tuple[tuple[tuple[str, ...], ...], ...]  # a turn's stages of chains of names


def mode(counts: dict) -> Any:
    """The most frequent value of a ``value -> count`` dict (ties: the larger ``str``)."""
    return max(counts.items(), key=lambda kv: (kv[1], str(kv[0])))[0]


@dataclass
class TypeSamples:
    """Every recorded run of one action type (``task``, ``name``; the reward apart)."""

    task: str
    name: str
    kind: str
    reward: bool
    run_s: list[float] = field(default_factory=list)  # start to finish
    setup_s: list[float] = field(default_factory=list)  # before it ran (gpu restore)
    est_s: list[float] = field(default_factory=list)
    cores: list[int] = field(default_factory=list)
    batch: list[int] = field(default_factory=list)
    timed_out: list[bool] = field(default_factory=list)
    failed: int = 0  # failed otherwise than by its timeout
    timeouts_s: dict[float, int] = field(default_factory=dict)  # declared timeout: count
    core_range: tuple[int, int] = (1, 1)  # widest declared [min, max]
    declared_pf: dict[float, int] = field(default_factory=dict)
    services: dict[str, int] = field(default_factory=dict)
    endpoints: dict[str, int] = field(default_factory=dict)
    tokens: list[int] = field(default_factory=list)
    traj: list[str | None] = field(default_factory=list)  # per run: its trajectory's key

    @property
    def n(self) -> int:
        return len(self.run_s)

    def arrays(self) -> dict[str, np.ndarray]:
        return {"run_s": np.asarray(self.run_s, float), "setup_s": np.asarray(self.setup_s, float),
                "est_s": np.asarray(self.est_s, float), "cores": np.asarray(self.cores, int),
                "batch": np.asarray(self.batch, int),
                "timed_out": np.asarray(self.timed_out, bool)}


@dataclass
class TrajectoryRecord:
    task: str
    tools: int = 0  # tool actions (all but the reward)
    ended: bool = False  # its reward action was recorded
    first_s: float = np.inf  # first submission
    last_s: float = 0.0  # last finish
    step: int | None = None
    groups: int = 0  # agent turns: groups of tool actions with one turn number
    prompt: str | None = None  # the prompt it answered (GRPO siblings share it)
    tool_s: float = 0.0  # its tool actions' run time, summed
    gap_s: list[float] = field(default_factory=list)  # its generation gaps
    # The turn being read: its number and its actions as (submission, name, gap, finish).
    turn: int | None = None
    pending: list[tuple[float, str, float | None, float]] = field(default_factory=list)


@dataclass
class TraceSamples:
    """What :func:`read_samples` gathers from a trace."""

    path: str
    header: TraceHeader | None = None
    types: dict[tuple[str, str, bool], TypeSamples] = field(default_factory=dict)
    trajectories: dict[str, TrajectoryRecord] = field(default_factory=dict)
    gaps: dict[str, list[float]] = field(default_factory=dict)  # task -> generation gaps
    # task -> what its agent turns submitted: the multiset of action names -> the stages
    # (by submission; a stage: chains of actions submitted together) it came in -> count;
    # and the gap before each turn's first action.
    turn_groups: dict[str, dict[tuple[str, ...], dict[Stages, int]]] = \
        field(default_factory=dict)
    turn_gaps: dict[str, list[float]] = field(default_factory=dict)
    # When a live service started again on this trace (a later cluster line's
    # ``started_at``, seconds from the first's): from then its API quotas were full.
    restarts_s: list[float] = field(default_factory=list)
    generations: list[GenerationLine] = field(default_factory=list)  # LLM turns served
    n_lines: int = 0
    n_actions: int = 0  # action lines with measurements
    n_unmeasured: int = 0  # trajectory lines and action lines without measurements
    n_loose: int = 0  # measured actions of no trajectory

    def steps(self) -> list[list[TrajectoryRecord]]:
        """The finished trajectories grouped into RL steps: by their recorded ``step``
        where the clock knew it, else by the synchronous-step barrier (a trajectory
        that starts after every earlier one has finished starts a new step)."""
        done = [t for t in self.trajectories.values() if t.ended]
        if done and all(t.step is not None for t in done):
            by: dict[int, list[TrajectoryRecord]] = {}
            for t in done:
                by.setdefault(t.step, []).append(t)
            return [by[s] for s in sorted(by)]
        out: list[list[TrajectoryRecord]] = []
        end = -np.inf
        for t in sorted(done, key=lambda t: t.first_s):
            if not out or t.first_s >= end:
                out.append([])
            out[-1].append(t)
            end = max(end, t.last_s)
        return out


def _end_turn(out: TraceSamples, tr: TrajectoryRecord) -> None:
    """Count the turn ``tr`` was reading (its actions: one request's steps, or calls
    made together) as a group of its task."""
    # By submission: the order the agent issued them.
    acts = sorted(tr.pending, key=lambda a: (a[0], a[3], a[1]))
    # A stage: actions submitted before every earlier one of the turn had finished (made
    # together); the next stage starts once the agent has had all their answers. Inside a
    # stage, an action submitted after one of the stage's actions had finished follows it
    # (a chain: a program's run after its own write), the latest such one that no other
    # follows; an action submitted before any had finished starts a chain of its own.
    stages: list[list[list[str]]] = []
    done = -np.inf
    open_: list[tuple[float, int]] = []  # the stage's chains' last finishes, chain index
    for arrival, name, _, finish in acts:
        if not stages or arrival >= done:
            stages.append([])
            open_ = []
        chains = stages[-1]
        ended = [(f, c) for f, c in open_ if f <= arrival]
        if ended:
            f, c = max(ended)
            open_.remove((f, c))
            chains[c].append(name)
        else:
            c = len(chains)
            chains.append([name])
        open_.append((finish, c))
        done = max(done, finish)
    # Chains submitted together in any order are one group: a stage's chains sorted.
    order = tuple(tuple(sorted(tuple(c) for c in s)) for s in stages)
    key = tuple(sorted(name for _, name, _, _ in acts))
    orders = out.turn_groups.setdefault(tr.task, {}).setdefault(key, {})
    orders[order] = orders.get(order, 0) + 1
    if acts[0][2] is not None:  # the generation before the turn (none before the first)
        out.turn_gaps.setdefault(tr.task, []).append(acts[0][2])
    tr.groups += 1
    tr.turn, tr.pending = None, []


def read_samples(path: PathLike, progress: Callable[[int], None] | None = None) -> TraceSamples:
    """Gather a trace's measurements (streamed: nothing but the samples is kept).

    Args:
        path: a JSONL trace.
        progress: called with the number of lines read so far, every 10,000 lines.

    Raises:
        ConfigError: the trace is malformed (one line naming file, line and field), or
            has no measured actions.
    """
    out = TraceSamples(str(path))
    # A trajectory's name may come back after its reward closed it (a client that names
    # trajectories per step, runs appended to one trace): the dispatcher then holds a new
    # trajectory, and so does this reading. name -> (the key of its latest trajectory,
    # how many it has had).
    latest: dict[str, tuple[str, int]] = {}
    for item in scan_trace(path):
        out.n_lines += 1
        if progress is not None and out.n_lines % 10_000 == 0:
            progress(out.n_lines)
        if item.header is not None:
            h, first = item.header, out.header
            if first is None:
                out.header = h
            elif h.started_at is not None and first.started_at is not None:
                out.restarts_s.append(h.started_at - first.started_at)
            continue
        if item.generation is not None:
            out.generations.append(item.generation)
            continue
        if item.action is None or item.measured is None:
            out.n_unmeasured += 1
            continue
        ia, m = item.action, item.measured
        if m.status == "cancelled":  # cut short by its caller: no measure of its type
            out.n_unmeasured += 1
            continue
        spec = ia.spec
        key = (ia.task, spec.name, spec.reward)
        ts = out.types.get(key)
        if ts is None:
            ts = out.types[key] = TypeSamples(ia.task, spec.name, spec.kind, spec.reward)
        elif ts.kind != spec.kind:
            raise ConfigError(f"{path}:{item.lineno}: action.kind",
                              f"{ia.task}/{spec.name} was {ts.kind} on an earlier line (got "
                              f"{spec.kind}); give actions of another kind another name")
        out.n_actions += 1
        ts.run_s.append(m.run_s)
        ts.setup_s.append(m.setup_s)
        ts.est_s.append(spec.est_s)
        ts.cores.append(m.cores if m.cores is not None else spec.min_cores)
        ts.batch.append(m.batch)
        ts.timed_out.append(m.status == "timeout")
        ts.failed += m.status == "failed"
        ts.timeouts_s[spec.timeout_s] = ts.timeouts_s.get(spec.timeout_s, 0) + 1
        if spec.kind == "cpu":
            lo, hi = ts.core_range
            ts.core_range = ((spec.min_cores, spec.max_cores) if ts.n == 1
                             else (min(lo, spec.min_cores), max(hi, spec.max_cores)))
            pf = spec.parallel_fraction
            ts.declared_pf[pf] = ts.declared_pf.get(pf, 0) + 1
        elif spec.kind == "gpu":
            ts.services[spec.service] = ts.services.get(spec.service, 0) + 1
        else:
            ts.endpoints[spec.endpoint] = ts.endpoints.get(spec.endpoint, 0) + 1
            ts.tokens.append(spec.tokens)
        if m.trajectory is None:
            out.n_loose += 1
            ts.traj.append(None)
            continue
        key, uses = latest.get(m.trajectory, (m.trajectory, 0))
        tr = out.trajectories.get(key)
        if tr is None or tr.ended:
            key = m.trajectory if uses == 0 else f"{m.trajectory}#{uses}"
            latest[m.trajectory] = (key, uses + 1)
            tr = out.trajectories[key] = TrajectoryRecord(ia.task)
        ts.traj.append(key)
        if m.prompt is not None:
            tr.prompt = m.prompt
        if m.gap_s is not None:
            tr.gap_s.append(m.gap_s)
        if not spec.reward:
            tr.tool_s += m.run_s
        tr.first_s = min(tr.first_s, ia.arrival_s)
        tr.last_s = max(tr.last_s, ia.arrival_s + m.queue_s + m.run_s)
        if m.step is not None:
            tr.step = m.step
        # Without a turn number each action is a turn of its own.
        turn = m.turn if m.turn is not None else -1 - tr.tools
        if tr.turn is not None and (spec.reward or turn != tr.turn):
            _end_turn(out, tr)
        if spec.reward:
            tr.ended = True
        else:
            tr.tools += 1
            tr.turn = turn
            tr.pending.append((ia.arrival_s, spec.name, m.gap_s,
                               ia.arrival_s + m.queue_s + m.run_s))
        if m.gap_s is not None:
            out.gaps.setdefault(ia.task, []).append(m.gap_s)
    if out.n_actions == 0:
        raise ConfigError(str(path), "no measured actions: calibration needs a recorded trace "
                          "(metasched-dispatch trace=..., or the simulator's trace_writer)")
    return out


__all__ = ["TraceSamples", "TrajectoryRecord", "TypeSamples", "mode", "read_samples"]
