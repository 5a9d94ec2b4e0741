"""Look-ahead policy improvement over ``rate_greedy``: how much a better decision buys.

At a decision point the teacher lists a few candidate decisions: ``rate_greedy``'s own
grants, the next-best GPU grants by its own score (another service, device or batch
size), *holding* the GPU (serving nothing there until the next event, e.g. to fill a
batch or avoid a restore, which a work-conserving rule never does), and, for CPU and API
queues, starting another queued action first (the oldest, or the one of the trajectory
furthest behind). Each candidate is applied to forks of the simulator (``copy.deepcopy``;
specs are immutable and shared), the forks continue under ``rate_greedy`` for
``horizon_s`` simulated seconds, and the candidate with the lowest cost is applied: the
actions' time in system over the horizon (mean ACT's numerator) plus, for each action
still unfinished at the horizon, its estimated remaining run time.

Two variants:

- *privileged* (``privileged=True``): a fork keeps the instance's true durations and
  future arrivals: one future, the real one. An upper bound on what one-step look-ahead
  over ``rate_greedy`` can buy, and a teacher for a student that sees estimates only.
- *estimates only*: each fork re-draws what a scheduler does not know before rolling
  out: the true durations of queued actions (``est_s * exp(sigma z)``, sigma the
  profile's estimate error), the end times of running CPU and API actions (given what
  they have run so far), the unsubmitted turns of live trajectories and every later RL
  step (fresh samples of the profile). GPU batches in flight and generations in
  progress keep their true end (seconds away). ``n_futures`` draws, the same for every
  candidate (common random numbers).

``run`` drives a simulator to the end and returns its ``RunResult``; ``stats`` counts
the decisions looked at and those that differ from ``rate_greedy``'s.
"""

from __future__ import annotations

import copy
import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from metasched.agents.rate_greedy import RateGreedyScheduler, best_prefix
from metasched.core.actions import RUNNING, Action, Grant
from metasched.core.metrics import Recorder, RunResult
from metasched.sim.sampling import sample_trajectory, sample_workload
from metasched.sim.simulator import END, Simulator


@dataclass
class Candidate:
    """One decision: grants to apply now, then (``hold``) wait for the next event. A
    fork of a candidate with ``gpu_hold_s`` > 0 starts no GPU batch for that long (the
    real run holds until the next event and decides again: receding horizon)."""

    label: str
    grants: list[Grant]
    hold: bool = False
    gpu_hold_s: float = 0.0


@dataclass
class LookaheadStats:
    """What the teacher did over a run."""

    decisions: int = 0  # decision points
    looked: int = 0  # decision points with more than one candidate
    changed: int = 0  # ... where the chosen candidate is not rate_greedy's
    by_label: dict[str, int] = field(default_factory=dict)  # chosen candidates by label
    rollouts: int = 0


def fork(sim: Simulator) -> tuple[Simulator, dict[int, Any]]:
    """A copy of ``sim`` that can run on without touching it, and the copy's memo
    (``memo[id(obj)]`` is the copy of ``obj``). The workload instance and configs are
    shared (never mutated); the copy records its finished actions in a fresh recorder."""
    sim.guard.next_deadline(sim.state)  # drop the guard's index of started actions
    st = sim.state
    memo: dict[int, Any] = {id(sim.instance): sim.instance, id(sim.workload): sim.workload,
                            id(sim.cluster): sim.cluster, id(st.cluster): st.cluster,
                            id(st.metrics): Recorder(st.metrics.dt)}
    return copy.deepcopy(sim, memo), memo


def _translate(g: Grant, memo: dict[int, Any]) -> Grant:
    return replace(g, action=memo[id(g.action)], batch=tuple(memo[id(b)] for b in g.batch))


def _fitting(state, grants: list[Grant]) -> list[Grant]:
    """``grants`` less the CPU grants that the ones before them leave no room for."""
    free = list(state.cpu.free)
    out = []
    for g in grants:
        a = g.action
        if a.spec.kind == "cpu":
            node = a.node if a.node >= 0 else g.node
            held = a.traj.held_cores if a.traj is not None else 0
            new_held = max(held, g.hold)
            need = new_held - held + max(0, g.cores - new_held)
            if need > free[node]:
                continue
            free[node] -= need
        out.append(g)
    return out


class LookaheadTeacher:
    """One-step look-ahead over ``rate_greedy`` (see the module docstring).

    Args:
        horizon_s: simulated seconds each fork runs on under ``rate_greedy``.
        privileged: forks keep the true future (else they re-draw what is unknown).
        n_futures: forks per candidate (estimates only; privileged uses one).
        kinds: the pools whose decisions get alternatives (``"gpu"``, ``"cpu"``, ``"api"``).
        n_alternatives: GPU grants other than ``rate_greedy``'s, best by its score first.
        holds_s: GPU holds tried besides "until the next event": a fork starts no GPU
            batch for this many seconds.
        look_every: look ahead at every this-many-th decision that has alternatives
            (``rate_greedy``'s decision at the others): a cheaper, partial teacher.
        seed: the generator of the estimates-only draws.
        params: ``rate_greedy``'s parameters.
    """

    def __init__(self, horizon_s: float = 60.0, privileged: bool = True, n_futures: int = 2,
                 kinds: tuple[str, ...] = ("gpu",), n_alternatives: int = 3,
                 holds_s: tuple[float, ...] = (), look_every: int = 1, seed: int = 0,
                 params: dict[str, Any] | None = None) -> None:
        if not horizon_s > 0:
            raise ValueError(f"horizon_s must be > 0 (got {horizon_s})")
        if n_futures < 1:
            raise ValueError(f"n_futures must be >= 1 (got {n_futures})")
        unknown = set(kinds) - {"cpu", "gpu", "api"}
        if unknown:
            raise ValueError(f"kinds must be among cpu, gpu, api (got {sorted(unknown)})")
        self.horizon_s = horizon_s
        self.privileged = privileged
        self.n_futures = 1 if privileged else n_futures
        self.kinds = tuple(kinds)
        self.n_alternatives = n_alternatives
        if any(not h > 0 for h in holds_s):
            raise ValueError(f"holds_s must be > 0 (got {holds_s})")
        self.holds_s = tuple(holds_s)
        if look_every < 1:
            raise ValueError(f"look_every must be >= 1 (got {look_every})")
        self.look_every = look_every
        self._offered = 0
        self.params = dict(params or {})
        self.rng = np.random.default_rng(seed)
        self.stats = LookaheadStats()
        self._futures: list[Any] = []
        self._seeds: list[int] = [0] * self.n_futures

    # ------------------------------------------------------------------ driving

    def run(self, sim: Simulator,
            progress: Callable[[float], None] | None = None) -> RunResult:
        """Drive ``sim`` to its end, deciding by look-ahead; its result. ``progress``: a
        callable given the simulated time after each decision (a progress bar)."""
        self.stats = LookaheadStats()
        self._offered = 0
        if not self.privileged:  # later RL steps of each future, drawn once
            self._futures = [sample_workload(sim.workload, np.random.default_rng(
                self.rng.integers(2**63))) for _ in range(self.n_futures)]
        base = RateGreedyScheduler(**self.params)
        base.reset(sim.state, sim.scheduler_rng())
        while sim.next_decision():
            sim.n_decisions += 1
            self.stats.decisions += 1
            cands = self.candidates(sim, base.decide(sim.state))
            best = cands[0]
            if len(cands) > 1:
                self._offered += 1
            if len(cands) > 1 and (self._offered - 1) % self.look_every == 0:
                self.stats.looked += 1
                # one draw per future, the same for every candidate (common random numbers)
                self._seeds = [int(x) for x in self.rng.integers(2**63, size=self.n_futures)]
                costs = [self.cost(sim, c) for c in cands]
                best = cands[int(np.argmin(costs))]  # ties: rate_greedy's (listed first)
                if best is not cands[0]:
                    self.stats.changed += 1
            self.stats.by_label[best.label] = self.stats.by_label.get(best.label, 0) + 1
            self._apply(sim, best)
            if progress is not None:
                progress(sim.state.t)
        return sim.result()

    @staticmethod
    def _apply(sim: Simulator, c: Candidate) -> None:
        for g in c.grants:
            sim.apply(g)
        if c.hold or not c.grants:
            sim.wait()

    # ------------------------------------------------------------------ candidates

    def candidates(self, sim: Simulator, grants: list[Grant]) -> list[Candidate]:
        """``rate_greedy``'s decision first, then the alternatives worth a look."""
        out = [Candidate("rate_greedy", grants)]
        state = sim.state
        if "gpu" in self.kinds and state.pending["gpu"] and any(
                not d.busy for d in state.gpu.devices):
            out += self._gpu_alternatives(sim, grants)
        for kind in ("cpu", "api"):
            if kind in self.kinds:
                out += self._swap_alternatives(sim, grants, kind)
        return out

    def _gpu_alternatives(self, sim: Simulator, grants: list[Grant]) -> list[Candidate]:
        state = sim.state
        gpu = state.gpu
        other = [g for g in grants if g.action.spec.kind != "gpu"]
        mine = [g for g in grants if g.action.spec.kind == "gpu"]
        out = []
        if mine:
            out.append(Candidate("hold", other, hold=True))
        out += [Candidate(f"hold:{h:g}s", other, hold=True, gpu_hold_s=h) for h in self.holds_s]
        queues: dict[str, list[Action]] = {}
        for a in state.pending["gpu"].values():
            queues.setdefault(a.spec.service, []).append(a)
        scored = []  # (-rate, label, grant)
        for s, q in queues.items():
            q.sort(key=lambda a: (a.spec.est_s, a.id))
            svc = gpu.services[s]
            for dev in gpu.devices:
                if dev.busy or svc.mem_gb > dev.mem_gb:
                    continue
                setup = 0.0 if s in dev.resident else svc.restore_s
                b, batch_s = best_prefix(q, svc, setup)
                sizes = {b, min(svc.max_batch, len(q))}
                for n in sorted(sizes):
                    t = q[n - 1].spec.est_s * (1.0 + svc.batch_marginal * (n - 1))
                    rate = n / (setup + t) if setup + t > 0 else math.inf
                    g = Grant(q[0], device=dev.index, batch=tuple(q[1:n]))
                    scored.append((-rate, f"gpu:{s}@{dev.index}x{n}", g))
        scored.sort(key=lambda x: x[0])
        first = mine[0] if mine else None
        for _, label, g in scored:
            if len(out) >= self.n_alternatives + (1 if mine else 0):
                break
            if first is not None and g.device == first.device and g.action is first.action \
                    and len(g.batch) == len(first.batch):
                continue  # rate_greedy's own
            out.append(Candidate(label, [*other, g]))
        return out

    def _swap_alternatives(self, sim: Simulator, grants: list[Grant],
                           kind: str) -> list[Candidate]:
        """rate_greedy's grants with its first ``kind`` grant given instead to the oldest
        queued action, or to the one of the trajectory furthest behind (fewest turns);
        for CPU also that grant with every core it can use, that no grant before it
        takes (later grants on the node that no longer fit are dropped)."""
        state = sim.state
        idx = next((i for i, g in enumerate(grants) if g.action.spec.kind == kind), None)
        if idx is None:
            return []
        first = grants[idx]
        granted = {g.action.id for g in grants}
        pending = [a for a in state.pending[kind].values() if a.id not in granted]
        if kind == "cpu":
            node = first.action.node if first.action.node >= 0 else first.node
            pending = [a for a in pending if a.node in (-1, node)
                       and a.spec.min_cores - (a.traj.held_cores if a.traj else 0)
                       <= first.cores - (first.action.traj.held_cores if first.action.traj
                                         else 0)]
        else:
            pending = [a for a in pending if a.spec.endpoint == first.action.spec.endpoint
                       and a.spec.tokens <= first.action.spec.tokens]
        out = []
        if kind == "cpu":  # the same action on every core it can use that is free now
            a = first.action
            node = a.node if a.node >= 0 else first.node
            held = a.traj.held_cores if a.traj is not None else 0
            room = state.cpu.free[node] + held - sum(
                g.cores for g in grants[:idx] if g.action.spec.kind == "cpu"
                and (g.action.node if g.action.node >= 0 else g.node) == node)
            more = min(a.spec.max_cores, room)
            if more > first.cores:
                out.append(Candidate("cpu:more", _fitting(state, [
                    *grants[:idx], replace(first, cores=more), *grants[idx + 1:]])))
        if not pending:
            return out
        picks = {"oldest": min(pending, key=lambda a: (a.submit_t, a.id)),
                 "behind": min(pending, key=lambda a: (a.traj.turn if a.traj else 0,
                                                       a.submit_t, a.id))}
        seen: set[int] = set()
        for label, a in picks.items():
            if a.id in seen:
                continue
            seen.add(a.id)
            if kind == "cpu":
                g = Grant(a, cores=a.spec.min_cores, node=first.action.node
                          if first.action.node >= 0 else first.node)
            else:
                g = Grant(a)
            swapped = [*grants[:idx], g, *grants[idx + 1:]]
            out.append(Candidate(f"{kind}:{label}", swapped))
        return out

    # ------------------------------------------------------------------ rollouts

    def cost(self, sim: Simulator, c: Candidate) -> float:
        """Mean over futures of the candidate's cost (see the module docstring)."""
        total = 0.0
        for f in range(self.n_futures):
            total += self._rollout(sim, c, f)
        return total / self.n_futures

    def _rollout(self, sim: Simulator, c: Candidate, future: int) -> float:
        self.stats.rollouts += 1
        child, memo = fork(sim)
        if not self.privileged:
            self._redraw(child, future)
        state = child.state
        t_end = state.t + self.horizon_s
        snap: list[float] = []
        advance = state.advance

        def advance_to(t: float) -> None:  # integrate exactly up to the horizon
            if state.t < t_end <= t:
                advance(t_end)
                snap.append(state.in_system_s)
            advance(t)

        state.advance = advance_to
        start = state.in_system_s
        self._apply(child, Candidate(c.label, [_translate(g, memo) for g in c.grants], c.hold))
        base = RateGreedyScheduler(**self.params)
        base.reset(state, child.scheduler_rng())
        hold_until = state.t + c.gpu_hold_s
        while state.t < t_end and child.next_decision():
            grants = base.decide(state)
            if state.t < hold_until:
                grants = [g for g in grants if g.action.spec.kind != "gpu"]
            self._apply(child, Candidate("rate_greedy", grants))
        if not snap:  # the run ended before the horizon: nothing is left in the system
            return state.in_system_s - start
        left = 0.0
        for kind in ("cpu", "gpu", "api"):
            left += sum(a.spec.est_s for a in state.pending[kind].values())
        for _, etype, _, obj in child._heap:
            if etype == END and obj.status == RUNNING:
                left += max(0.0, obj.start_t + obj.spec.est_run_s(max(obj.cores, 1)) - t_end)
        return snap[0] - start + left

    def _redraw(self, child: Simulator, future: int) -> None:
        """Replace what a scheduler does not know with draws from the estimates (future
        ``future``'s draws: the same for every candidate's fork)."""
        rng = np.random.default_rng(self._seeds[future])
        sigma = child.workload.estimate_error
        state = child.state
        now = state.t

        def draw(est: float) -> float:
            return est * math.exp(sigma * rng.standard_normal()) if sigma else est

        for kind in ("cpu", "gpu", "api"):
            for a in state.pending[kind].values():
                a.spec = replace(a.spec, true_s=draw(a.spec.est_s))
        heap = child._heap
        for i, (_t, etype, seq, obj) in enumerate(heap):
            if etype == END and obj.status == RUNNING and obj.spec.kind != "gpu":
                run = draw(obj.spec.est_s)
                if obj.spec.kind == "cpu":
                    run = child._launch_s + run / obj.spec.speedup(obj.cores)
                end = obj.start_t + min(run, obj.spec.timeout_s)
                if end <= now:  # it has run longer than the draw: as long again, at most
                    end = now + (now - obj.start_t) * rng.random() + 1e-9
                heap[i] = (end, etype, seq, obj)
        heapq.heapify(heap)
        tasks = {t.name: t for t in child.workload.tasks}
        trajs = list(state.trajectories.values()) + list(child._sandbox_queue)
        for traj in trajs:
            k = child._next_turn.get(traj.id, 0)  # the simulator's next turn
            while 0 < k < traj.n_turns and traj.turns[k - 1].together:
                k += 1  # the group in flight keeps its own turns (chains not yet submitted)
            if k >= traj.n_turns:
                continue  # its reward action is submitted: nothing is left to draw
            fresh = sample_trajectory(tasks[traj.task], rng, sigma).turns
            done = traj.turns[:k]
            traj.turns = done + (list(fresh[k:]) if len(fresh) > k else list(fresh[-1:]))
        child.instance = replace(child.instance, steps=(
            list(child.instance.steps[:child._step + 1])
            + list(self._futures[future].steps[child._step + 1:])))
