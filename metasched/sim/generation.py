"""The LLM's generation as a pool: inference replicas with continuous batching.

With a profile's ``generation:`` set, every LLM turn of a trajectory is a request to a
pool of replicas instead of a fixed gap: ``prompt`` tokens of context (the task's prompt
and every earlier turn's output and tool output) and ``out`` tokens to generate (the
profile's generation time at its ``tokens_per_s``, so a profile's grouped structure
carries over to tokens). A replica runs its batch one decode step at a time
(:class:`~metasched.core.engine.EngineModel`), admits waiting requests between steps
(their uncached prompt tokens prefilled first), and preempts the lowest-priority
sequence when its KV cache would overflow, as vLLM does. Which waiting request joins a
batch is the pool's order (:data:`ORDERS`): the request's priority, stamped when it is
submitted as a vLLM request's ``priority`` is, lower first, ties by arrival (FCFS).

Replica affinity (``affinity: true``) keeps a trajectory on the replica that served its
last turn, whose prefix cache holds its context; without it any replica with room takes
the queue's head (its prefix cache hits only by chance).

The simulation is event-driven: between two events a replica's batch is fixed, so the
steps until the first sequence finishes (or the KV cache fills) are one event, and an
arrival that a busy replica could admit cuts that event short at the end of the step in
progress.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from metasched.core.engine import EngineModel
from metasched.core.schema import Count, Flag, Number, Strict
from metasched.sim.dists import AnyDist, PositiveDist

__all__ = ["ORDERS", "GenRequest", "GenerationConfig", "GenerationPool"]

ORDERS = ("fifo", "oracle", "least_slack", "predicted")


class GenerationConfig(Strict):
    """A profile's ``generation:`` (the module docstring): the pool and its tokens.

    Attributes:
        replicas: inference replicas (data-parallel engines), each with ``engine``.
        engine: a replica's costs.
        tokens_per_s: output tokens per second of the profile's ``generation_s`` (the
            rate at which the profile's generation times were derived from tokens).
        prompt_tokens: the first turn's prompt, tokens (one draw per prompt group).
        tool_output_tokens: a tool action's output, tokens (each added to the context).
        order: which waiting request is admitted first: ``fifo`` (today's practice),
            ``oracle`` (longest true remaining work first), ``least_slack`` (least
            slack against the step's critical path, on the true remaining work), or
            ``predicted`` (longest remaining first by the run's predictor's median).
        affinity: keep a trajectory on one replica (its prefix cache).
        priority_preemption: a waiting request that finds the batch full preempts the
            running one of lowest priority when its own is higher (vLLM V0's priority
            policy did; V1 preempts only when a running sequence needs room). Only
            with an order other than ``fifo``.
        overprovision: responses launched per prompt group beyond its size (RollPacker's
            over-provisioning, :mod:`metasched.sim.overprovision`): the first ``size`` to
            finish are kept, the rest aborted. 0: off.
    """

    replicas: Count(1) = 1
    engine: EngineModel = EngineModel()
    tokens_per_s: Number(gt=0.0) = 50.0
    prompt_tokens: PositiveDist
    tool_output_tokens: AnyDist
    order: Literal[ORDERS] = "fifo"  # type: ignore[valid-type]
    affinity: Flag = False
    priority_preemption: Flag = False
    overprovision: Count(0) = 0


@dataclass(slots=True, eq=False)
class GenRequest:
    """One LLM turn: ``prompt`` context tokens, ``out`` to generate. The pool fills in
    when it ran and, for calibration, what the batch was over its decode steps."""

    traj: Any
    turn: int
    prompt: int
    out: int
    submit_t: float
    priority: float = 0.0
    seq: int = 0
    done: int = 0  # tokens generated so far
    replica: int = -1
    start_t: float = math.nan  # first admitted
    end_t: float = math.nan
    cached: int = 0  # prompt tokens found in the prefix cache at the first admission
    preempted: int = 0
    swapped: bool = False
    run_s: float = 0.0  # time in a batch (admitted, not preempted)
    admitted_t: float = math.nan  # this admission's time
    # Over its time in batches: decode steps, sum of batch sizes and of batch context
    # over them, prefills and their uncached tokens, swapped-in tokens (what its run
    # time is linear in, through the engine model).
    steps: int = 0
    sum_n: float = 0.0
    sum_ctx: float = 0.0
    prefills: int = 0
    prefill_tokens: float = 0.0
    swap_tokens: float = 0.0
    aborted: bool = False  # its trajectory was aborted (over-provisioning)

    @property
    def ctx(self) -> int:
        """Tokens of KV cache it holds (or needs) now."""
        return self.prompt + self.done

    def record(self) -> dict[str, Any]:
        """What the trace's ``generation`` line holds."""
        return {"trajectory": self.traj.id, "turn": self.turn, "prompt_tokens": self.prompt,
                "output_tokens": self.out, "cached_tokens": self.cached,
                "replica": self.replica, "priority": self.priority,
                "queue_s": self.end_t - self.submit_t - self.run_s, "run_s": self.run_s,
                "preempted": self.preempted, "steps": self.steps, "sum_batch": self.sum_n,
                "sum_context": self.sum_ctx, "prefills": self.prefills,
                "prefill_tokens": self.prefill_tokens, "swap_tokens": self.swap_tokens}


@dataclass(slots=True)
class _Replica:
    index: int
    running: list[GenRequest] = field(default_factory=list)
    ctx: int = 0  # KV tokens of the running sequences
    cache: OrderedDict = field(default_factory=OrderedDict)  # trajectory -> tokens, LRU
    cached: int = 0
    waiting: list = field(default_factory=list)  # its own queue (affinity)
    busy: bool = False
    version: int = 0
    t0: float = 0.0  # the current segment: its start, set-up (prefill, swap), steps
    setup_s: float = 0.0
    k: int = 0
    n: int = 0
    ctx0: int = 0
    prefill_tokens: float = 0.0
    swap_tokens: float = 0.0


class GenerationPool:
    """Replicas serving LLM turns (the module docstring).

    Args:
        config: the profile's ``generation:``.
        push: schedules ``(t, payload)`` on the simulator's clock; the payload comes
            back to :meth:`on_event`.
        finished: called with each request when its last token is out.
        priority: the order's key of a request when it is submitted (lower first);
            None: FIFO.
    """

    def __init__(self, config: GenerationConfig, push: Callable[[float, object], None],
                 finished: Callable[[GenRequest], None],
                 priority: Callable[[GenRequest], float] | None = None) -> None:
        self.config = config
        self.engine = config.engine
        self._push = push
        self._finished = finished
        self._priority = priority
        self.replicas = [_Replica(i) for i in range(config.replicas)]
        self._waiting: list = []  # the shared queue (no affinity)
        self._home: dict[int, int] = {}  # trajectory id -> its replica (affinity)
        self._seq = 0
        self.n_requests = self.n_preemptions = 0
        self.prompt_tokens = self.cached_tokens = 0
        self.queue_s = self.run_s = 0.0  # summed over finished requests

    # ------------------------------------------------------------------ requests

    def submit(self, req: GenRequest, t: float) -> None:
        """Queue ``req`` at ``t`` and let a replica that can take it do so."""
        self._seq += 1
        req.seq, req.submit_t = self._seq, t
        if self._priority is not None:
            req.priority = self._priority(req)
        self.n_requests += 1
        self.prompt_tokens += req.prompt
        if self.config.affinity:
            home = self._home.get(req.traj.id)
            if home is None:
                home = min(self.replicas, key=lambda r: (len(r.running) + len(r.waiting),
                                                         r.index)).index
                self._home[req.traj.id] = home
            heapq.heappush(self.replicas[home].waiting, (req.priority, req.seq, req))
            self._wake(self.replicas[home], t)
            return
        heapq.heappush(self._waiting, (req.priority, req.seq, req))
        free = [r for r in self.replicas if len(r.running) < self.engine.max_seqs]
        if free:
            self._wake(min(free, key=lambda r: (r.busy, len(r.running), r.index)), t)
        elif self.config.priority_preemption and self._priority is not None:
            # the replica whose lowest-priority sequence this request would preempt
            low = max((max((q.priority, q.seq) for q in r.running), r.index)
                       for r in self.replicas)
            if low[0] > (req.priority, req.seq):
                self._wake(self.replicas[low[1]], t)

    def order_by(self, priority: Callable[[GenRequest], float] | None) -> None:
        """Stamp requests submitted from now on with ``priority`` (None: FIFO); those
        waiting keep theirs, as an engine's do."""
        self._priority = priority

    def abort(self, traj_id: int, t: float) -> None:
        """Drop a trajectory's requests at ``t`` (an aborted response): a waiting one
        leaves its queue; a running one leaves its batch at the end of the step in
        progress, its KV cache freed, and never finishes."""
        for queue in (self._waiting, *(r.waiting for r in self.replicas)):
            kept = [x for x in queue if x[2].traj.id != traj_id]
            if len(kept) != len(queue):
                queue[:] = kept
                heapq.heapify(queue)
        for r in self.replicas:
            for q in r.running:
                if q.traj.id == traj_id and not q.aborted:
                    q.aborted = True
                    self._wake(r, t)
        self.forget(traj_id)

    def forget(self, traj_id: int) -> None:
        """A trajectory has ended: its replica binding and cached prefix go."""
        self._home.pop(traj_id, None)
        for r in self.replicas:
            tokens = r.cache.pop(traj_id, None)
            if tokens is not None:
                r.cached -= tokens

    def _queue(self, r: _Replica) -> list:
        return r.waiting if self.config.affinity else self._waiting

    def _wake(self, r: _Replica, t: float) -> None:
        """``r`` should admit at its next step boundary: now if idle, else the end of
        the step in progress (cutting its planned segment short)."""
        if not r.busy:
            self._boundary(r, t)
            return
        e = self.engine
        elapsed = t - r.t0 - r.setup_s
        k = 1 if elapsed < 0 else e.steps_within(r.n, r.ctx0, elapsed) + 1
        if k < r.k:
            r.k = k
            r.version += 1
            self._push(r.t0 + r.setup_s + e.steps_s(r.n, r.ctx0, k), (r.index, r.version))

    # ------------------------------------------------------------------ events

    def on_event(self, payload: object, t: float) -> None:
        """A replica's segment has ended (stale payloads are ignored)."""
        i, version = payload  # type: ignore[misc]
        r = self.replicas[i]
        if version == r.version and r.busy:
            self._boundary(r, t)

    def _boundary(self, r: _Replica, t: float) -> None:
        e = self.engine
        if r.busy:  # the segment's steps are done
            k, n = r.k, r.n
            sum_ctx = k * r.ctx0 + n * k * (k - 1) / 2.0
            done = []
            for q in r.running:
                q.done += k
                q.steps += k
                q.sum_n += n * k
                q.sum_ctx += sum_ctx
                if r.prefill_tokens > 0:
                    q.prefills += 1
                    q.prefill_tokens += r.prefill_tokens
                q.swap_tokens += r.swap_tokens
                if q.done >= q.out:
                    done.append(q)
            r.ctx += n * k
            r.busy = False
            for q in [q for q in r.running if q.aborted]:
                r.running.remove(q)
                r.ctx -= q.ctx
            for q in (q for q in done if not q.aborted):
                r.running.remove(q)
                r.ctx -= q.ctx
                q.end_t = t
                q.run_s += t - q.admitted_t
                self._cache(r, q.traj.id, q.ctx)
                self.queue_s += t - q.submit_t - q.run_s
                self.run_s += q.run_s
                self._finished(q)
        self._preempt(r, t)
        setup_tokens, swap_tokens = self._admit(r, t)
        if not r.running:
            return
        n = len(r.running)
        k = min(q.out - q.done for q in r.running)
        k = max(1, min(k, (e.kv_tokens - r.ctx) // n))
        r.busy, r.version = True, r.version + 1
        r.t0, r.k, r.n, r.ctx0 = t, k, n, r.ctx
        r.prefill_tokens, r.swap_tokens = setup_tokens, swap_tokens
        r.setup_s = e.prefill_s(setup_tokens) + 2.0 * e.swap_per_token_s * swap_tokens
        self._push(t + r.setup_s + e.steps_s(n, r.ctx, k), (r.index, r.version))

    def _cache(self, r: _Replica, traj_id: int, tokens: int) -> None:
        old = r.cache.pop(traj_id, 0)
        r.cache[traj_id] = tokens
        r.cached += tokens - old
        self._evict(r)

    def _evict(self, r: _Replica) -> None:
        """Drop least recently used prefixes until running and cached fit."""
        while r.cache and r.ctx + r.cached > self.engine.kv_tokens:
            _, tokens = r.cache.popitem(last=False)
            r.cached -= tokens

    def _preempt(self, r: _Replica, t: float) -> None:
        """Make room for the next step: preempt the lowest-priority sequences (latest
        arrival among equals) while the batch's growth would overflow the KV cache."""
        while len(r.running) > 1 and r.ctx + len(r.running) > self.engine.kv_tokens:
            self._preempt_one(r, max(r.running, key=lambda x: (x.priority, x.seq)), t)
        self._evict(r)

    def _preempt_one(self, r: _Replica, q: GenRequest, t: float) -> None:
        r.running.remove(q)
        r.ctx -= q.ctx
        q.run_s += t - q.admitted_t
        q.preempted += 1
        q.swapped = self.engine.preemption == "swap"
        self.n_preemptions += 1
        heapq.heappush(self._queue(r), (q.priority, q.seq, q))

    def _admit(self, r: _Replica, t: float) -> tuple[float, float]:
        """Admit waiting requests in order while the batch and the KV cache have room;
        returns the prompt tokens to prefill and the tokens to swap in."""
        e, queue = self.engine, self._queue(r)
        prefill = swap = 0.0
        preempting = self.config.priority_preemption and self._priority is not None
        while queue:
            q = queue[0][2]
            full = len(r.running) >= e.max_seqs or (
                r.running and r.ctx + q.ctx + len(r.running) + 1 > e.kv_tokens)
            if full:
                low = max(r.running, key=lambda x: (x.priority, x.seq)) if preempting else None
                if low is None or (low.priority, low.seq) <= (q.priority, q.seq):
                    break  # the head waits for room (as vLLM's scheduler does)
                self._preempt_one(r, low, t)  # a lower priority gives way (vLLM V0's)
                continue
            hit = r.cache.get(q.traj.id, 0)
            heapq.heappop(queue)
            if hit:
                del r.cache[q.traj.id]
                r.cached -= hit
            if q.swapped:
                swap += q.ctx
                q.swapped = False
            else:
                reuse = min(hit, q.ctx)
                prefill += q.ctx - reuse
                if math.isnan(q.start_t):
                    q.cached = min(hit, q.prompt)
                    self.cached_tokens += q.cached
            if math.isnan(q.start_t):
                q.start_t = t
            q.replica, q.admitted_t = r.index, t
            r.running.append(q)
            r.ctx += q.ctx
            self._evict(r)
        return prefill, swap

    def summary(self) -> dict[str, float]:
        """Requests served, preemptions, the share of prompt tokens the prefix cache held,
        and the finished requests' total time queued (preempted included) and in batches."""
        return {"requests": self.n_requests, "preemptions": self.n_preemptions,
                "prefix_hit_share": self.cached_tokens / self.prompt_tokens
                if self.prompt_tokens else 0.0, "queue_s": self.queue_s, "run_s": self.run_s}
