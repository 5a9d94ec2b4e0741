"""The event-driven simulator: a heap of typed events over the shared core state.

Synchronous RL steps: a step starts its trajectories together and ends when its
slowest trajectory ends; the next step starts then. A profile with ``max_offpolicyness``
set runs asynchronous rollouts instead (no step barrier, a staleness bound:
``metasched.sim.async_rollout``). The scheduler is asked only at
events after which some pending action could start. Deterministic for a seed: the
workload instance is drawn up front from one generator, and the scheduler gets its
own generator spawned from the same seed.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import replace

import numpy as np

from metasched.core.actions import RUNNING, Action, Grant, Trajectory
from metasched.core.cluster_config import ClusterConfig
from metasched.core.cost_model import ESTIMATES, CostModel, cost_model_for, signature
from metasched.core.deadlines import DeadlineRule, serve_due
from metasched.core.decision import DecisionStep
from metasched.core.guard import WaitGuard
from metasched.core.metrics import RunResult
from metasched.core.predictor import Predictor
from metasched.core.sandbox_queue import SandboxQueue
from metasched.core.scheduler import Scheduler
from metasched.core.state import ClusterState
from metasched.core.trace_writer import TraceWriter
from metasched.sim.sampling import (
    TrajectorySpec,
    WorkloadInstance,
    run_seed_sequences,
    sample_workload,
    workload_rng,
)
from metasched.sim.sharing import NodeSharing, has_deadlines
from metasched.sim.workload_config import WorkloadConfig

__all__ = ["ESTIMATES", "SimulationError", "Simulator", "cost_model_for"]

# Event types, in the order events at the same instant are handled. SHARE: a queued
# action reaches its latest start (metasched.core.deadlines).
# GEN: a generation pool's replica reaches a step boundary (metasched.sim.generation).
END, DEVICE_FREE, ARRIVE, INDEPENDENT, WAKE, DEADLINE, STEP, SHARE, GEN = range(9)


class SimulationError(RuntimeError):
    """The run cannot make progress (e.g. a scheduler left work with no future event)."""


class Simulator:
    """Runs one workload instance on one cluster under one scheduler.

    Use :meth:`run` for a whole run, or drive it one decision at a time (the
    Gymnasium env does): ``next_decision()`` advances to the next decision point and
    returns False at the end; then ``apply(grant)`` or ``wait()``. When the scheduler is
    asked is the core's decision step's (``metasched.core.decision``), as in the live
    dispatcher; trajectories wait for sandbox memory in the core's ``SandboxQueue``.

    Args:
        workload: the profile (sampled with ``seed``), unless ``instance`` is given or
            the profile names a ``trace`` file to replay.
        cluster: the resources.
        seed: the run's seed.
        instance: a fixed workload instance (trace replay) instead of sampling.
        timeline_dt: bucket width of the utilisation timeline, seconds.
        max_wait_s: the core's starvation guard: an action that waited longer is started
            (default allocation) before the scheduler is asked, as soon as it can start;
            None disables it.
        serve_stalled: when the scheduler waits while the cluster is idle (nothing runs,
            no API call waits for a refill: ``WaitGuard.idle``), start what can start
            (default allocation), as the live dispatcher does; without it such a wait lasts
            until the next event, and with nothing left to happen raises
            ``SimulationError``. Always on while ``max_wait_s`` is set. The env turns it
            on: a policy's wait must never end a run.
        cost_model: where schedulers' estimates come from. None (default): each action's
            estimate is the profile's (or the trace's) ``est_s``. A ``CostModel``: the
            live dispatcher's estimates, learned from the durations this run measures
            (the action's own ``est_s`` is the hint until its signature has run), so a
            scheduler is judged on the estimates it will see live.
        check_invariants: verify the accounting invariant at every event (slow; tests).
        trace_writer: where to record every finished action as a trace line, with what
            was measured (queue wait, run time, allocation, generation gap), as the live
            dispatcher records them (``metasched.core.trace_writer``).
        ahead_per_core: handing ahead, as the live dispatcher's setting of that name: cpu
            actions each node may hold per core ahead of its free cores (handed after
            the scheduler's turn, started the moment cores free there; see
            ``ClusterState.hand_ahead``). 0 (default): none.
        predictor: a remaining-work predictor (``metasched.core.predictor``) to feed on
            this run's clock and show to schedulers as ``state.predictor``, whatever the
            estimates (the cost model's, if it holds one, otherwise). None: none.

    A cpu action runs its command's start-up (``cluster.cpu_launch_s``, or a log-normal
    draw around it when ``cluster.cpu_launch_sigma`` > 0, from the run's own generator)
    plus its true duration at the granted cores, holding the cores throughout.

    Generation: with the profile's ``generation`` set, each turn's LLM generation is a
    request to a pool of inference replicas (:mod:`metasched.sim.llm_turns`,
    :mod:`metasched.sim.generation`) instead of a fixed gap; without it (every
    profile's default) the run is as it always was.

    Deadlines: an action whose spec has ``start_by_s`` and is still queued then is started
    time-shared on busy cores, and its node's actions slow down while it is
    oversubscribed (:mod:`metasched.core.deadlines`, :mod:`metasched.sim.sharing`).
    Without any (every profile's default) the run is as it always was.
    """

    def __init__(self, workload: WorkloadConfig, cluster: ClusterConfig, seed: int, *,
                 instance: WorkloadInstance | None = None, timeline_dt: float = 10.0,
                 max_wait_s: float | None = None, serve_stalled: bool = False,
                 cost_model: CostModel | None = None, check_invariants: bool = False,
                 trace_writer: TraceWriter | None = None, ahead_per_core: int = 0,
                 predictor: Predictor | None = None) -> None:
        self.workload = workload
        self.cluster = cluster
        self.seed = seed
        self._sched_seq = run_seed_sequences(seed)[1]
        if instance is None and workload.trace is not None:
            from metasched.sim.trace import read_trace

            instance = read_trace(workload.trace)
        self.instance = instance if instance is not None else sample_workload(
            workload, workload_rng(seed))
        self.state = ClusterState(cluster, workload.services, timeline_dt=timeline_dt)
        self.state.ahead_per_node = ahead_per_core * cluster.cores_per_node
        self.check_invariants = check_invariants
        self.cost_model = cost_model
        # A predictor the cost model holds is fed here too (gaps, ends) and shown to
        # schedulers as ``state.predictor``.
        if predictor is None and cost_model is not None:
            predictor = cost_model.predictor
        self.predictor = predictor
        # ``learn`` feeds the cost model's predictor; another is fed its measurements here.
        self._feed = predictor is not None and (cost_model is None
                                                or cost_model.predictor is not predictor)
        self.state.predictor = self.predictor
        self._restore_s: dict[int, float] = {}  # gpu action id -> its batch's restore
        self._in_flight: dict[int, int] = {}  # trajectory id -> its actions submitted, unfinished
        self._next_turn: dict[int, int] = {}  # trajectory id -> index of its next turn
        self._launch_s, self._launch_sigma = cluster.cpu_launch_s, cluster.cpu_launch_sigma
        # A third stream of the seed: the workload's and the scheduler's stay as they were.
        self._launch_rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(3)[2])
        self.guard = WaitGuard(max_wait_s)
        self.serve_stalled = serve_stalled or max_wait_s is not None
        self.step = DecisionStep(self.state, self.guard, self._start)
        self._deadline_at = -1.0  # the pending guard wake-up, if in the future
        self.state.task_demand = self.instance.demand_by_task()
        self._heap: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self._waited = False
        self._next_action_id = 0
        self._next_traj_id = 0
        self._step = -1
        self._sandbox_queue = SandboxQueue(self.state)
        self._wake_at: dict[str, float] = {}
        self.n_events = 0
        self.n_decisions = 0
        self.n_waits = 0
        self.trace_writer = trace_writer
        self._gpu_runs: dict[int, tuple[int, float]] = {}  # logged: action -> batch, setup
        # Per trajectory: (its turns whose actions have ended, when the last one ended);
        # the current step's trajectories, sandbox or not (read by the step objective).
        self.turns_done: dict[int, tuple[int, float]] = {}
        self.step_trajs: list[Trajectory] = []
        for ia in self.instance.independent:
            self._push(ia.arrival_s, INDEPENDENT, ia)
        # The deadline rule, only for an instance with deadlines.
        self.deadlines = DeadlineRule() if has_deadlines(self.instance) else None
        self._share_at = -1.0  # the pending SHARE wake-up, if in the future
        # Running cpu actions (with deadlines only): id -> (action, its full-speed end).
        self._cpu_runs: dict[int, tuple[Action, float]] = {}
        # (a bound method, not a closure: a deep copy, the look-ahead's fork, pushes
        # into its own heap)
        self.sharing = NodeSharing([cluster.cores_per_node] * cluster.cpu_nodes,
                                   self._push_moved_end)
        # The LLM's generation as a pool (a profile's ``generation:``); None: each turn's
        # generation is a fixed gap, as always.
        self.llm = None
        if workload.generation is not None:
            from metasched.sim.llm_turns import LLMTurns

            self.llm = LLMTurns(self, workload.generation, seed, GEN, ARRIVE)
        self.over = None  # over-provisioned prompt groups (opt-in)
        if workload.generation is not None and workload.generation.overprovision:
            from metasched.sim.overprovision import OverProvision

            self.over = OverProvision(self, workload.generation.overprovision, seed)
        self.rollout = None
        if workload.max_offpolicyness is not None:
            from metasched.sim.async_rollout import AsyncRollout

            self.rollout = AsyncRollout(self)
            self.rollout.begin()
        else:
            self._start_next_step()

    # ------------------------------------------------------------------ driving

    def run(self, scheduler: Scheduler) -> RunResult:
        """Run to the end under ``scheduler`` and return what was measured."""
        scheduler.reset(self.state, self.scheduler_rng())
        decide = scheduler.decide
        apply = self.apply
        while self.next_decision():
            self.n_decisions += 1
            grants = decide(self.state)
            if grants:
                for g in grants:
                    apply(g)
            else:
                self.wait()
        return self.result()

    def scheduler_rng(self) -> np.random.Generator:
        """The generator a scheduler gets for this run (independent of the workload's)."""
        return np.random.default_rng(self._sched_seq)

    @property
    def done(self) -> bool:
        s = self.state
        return not self._heap and s.n_pending == 0 and s.n_ahead == 0 and s.n_running == 0

    def next_decision(self) -> bool:
        """Advance through events until a decision is possible; False when the run ends."""
        state = self.state
        ready = self.step.ready
        while True:
            if self.deadlines is not None:
                self._serve_due()
            if not self._waited and ready():
                return True
            if state.ahead_per_node:  # after the scheduler's turn, as the dispatcher does
                state.fill_ahead()
            if state.pending["api"]:
                self._schedule_api_wakeups()
            if not self._heap:
                if state.n_pending and self._waited and self.serve_stalled:
                    if self.step.serve_all():
                        self._waited = False
                        continue
                if state.n_pending:
                    raise SimulationError(
                        f"{state.n_pending} actions pending at t={state.t:.1f}s with nothing "
                        "left to happen: the scheduler waited when only it could act")
                if self._sandbox_queue:
                    raise SimulationError(
                        f"{len(self._sandbox_queue)} trajectories never got a sandbox: no node "
                        "has the memory")
                return False
            self._process_instant()
            self._waited = False

    def apply(self, grant: Grant) -> None:
        """Start ``grant`` now (raises ``InvalidGrant`` if it is illegal)."""
        state = self.state
        started, delay = state.start(grant)
        t = state.t
        spec = grant.action.spec
        if spec.kind == "cpu":
            self._push_cpu_end(grant.action, t)
        elif spec.kind == "gpu":
            svc = state.gpu.services[spec.service]
            batch_s = svc.batch_s([b.spec.true_s for b in started])
            end = t + delay + batch_s
            for b in started:
                self._push_end(b, t, delay + batch_s)
                if self.cost_model is not None and delay:
                    self._restore_s[b.id] = delay
                if self.trace_writer is not None:
                    self._gpu_runs[b.id] = (len(started), delay)
            self._push(end, DEVICE_FREE, grant.device)
        else:
            self._push_end(grant.action, t, spec.true_s)

    def _start(self, grant: Grant) -> None:
        # Through the attribute, so that a wrapper set on the instance sees the guard's
        # grants too.
        self.apply(grant)

    def wait(self) -> None:
        """Decline to act until the next event (the guard may serve an idle cluster)."""
        self.n_waits += 1
        if self.serve_stalled and self.step.serve_idle():
            return  # the scheduler is asked again
        self._waited = True
        deadline = self.guard.next_deadline(self.state)
        # Wake up when the longest-waiting action reaches the guard's limit.
        if deadline is not None and deadline > self.state.t and (
                self._deadline_at <= self.state.t or deadline < self._deadline_at):
            self._deadline_at = deadline
            self._push(deadline, DEADLINE, None)

    def result(self) -> RunResult:
        state = self.state
        state.check_invariant()
        counters = {"events": self.n_events, "decisions": self.n_decisions,
                    "grants": state.n_grants, "waits": self.n_waits,
                    "submitted": state.n_submitted, "completed": state.n_done,
                    "failed": state.n_failed, "pending": state.n_pending + state.n_running,
                    "gpu_restores": state.gpu.restores, "gpu_evictions": state.gpu.evictions,
                    "guard_fired": self.guard.fired}
        cap = {"cpu": float(state.cpu.total), "gpu": float(state.gpu.total),
               "api": float(state.api.total)}
        eps = state.api.endpoints.values()
        rps = sum(e.spec.rpm / 60.0 for e in eps)
        burst = sum(e.spec.req_capacity for e in eps)
        r = RunResult.from_recorder(state.metrics, cap, rps, burst, state.t, counters)
        if self.rollout is not None:
            r.rollout = self.rollout.measured()
        return r

    # ------------------------------------------------------------------ events

    def _push(self, t: float, etype: int, obj: object) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, etype, self._seq, obj))

    def push_event(self, t: float, etype: int, obj: object) -> None:
        """An event of type ``etype`` at ``t`` (for the parts the simulator composes:
        the generation pool's turns)."""
        self._push(t, etype, obj)

    def _push_cpu_end(self, a: Action, t: float) -> None:
        """The end of cpu action ``a`` started at ``t`` on its ``a.cores``."""
        launch = self._launch_s
        if self._launch_sigma:
            launch *= math.exp(self._launch_sigma * self._launch_rng.standard_normal())
        run_s = launch + a.spec.true_s / a.spec.speedup(a.cores)
        self._push_end(a, t, run_s)
        if self.deadlines is not None:
            self._cpu_runs[a.id] = (a, t + run_s)
            if self.sharing.followed(a.node):
                self.sharing.started(a, run_s, t)

    def _push_moved_end(self, a: Action, t: float) -> None:
        self._push(t, END, a)

    def _serve_due(self) -> None:
        """Start the queued actions whose latest start has come (time-shared where no
        core is free) and wake up at the next one's."""
        state = self.state
        serve_due(state, self.deadlines, self._start, self._start_shared)
        at = self.deadlines.next_due(state)
        if at is not None and at > state.t and (self._share_at <= state.t or at < self._share_at):
            self._share_at = at
            self._push(at, SHARE, None)

    def _start_shared(self, a: Action, node: int) -> None:
        state = self.state
        if not self.sharing.followed(node):
            self.sharing.follow(node, [(b, end) for b, end in self._cpu_runs.values()
                                       if b.node == node and b.status == RUNNING], state.t)
        state.start_shared(a, node)
        self._push_cpu_end(a, state.t)

    def _push_end(self, a: Action, t: float, run_s: float) -> None:
        # A run past its timeout is killed at the timeout.
        self._push(t + min(run_s, a.spec.timeout_s), END, a)
        if run_s > a.spec.timeout_s:
            a.reason = "timeout"

    def _process_instant(self) -> None:
        heap = self._heap
        t = heap[0][0]
        self.state.advance(t)
        while heap and heap[0][0] <= t:
            _, etype, _, obj = heapq.heappop(heap)
            self.n_events += 1
            if etype == END:
                self._on_end(obj)
            elif etype == DEVICE_FREE:
                self.state.release_device(obj)
            elif etype == ARRIVE:
                self._on_arrive(obj)
            elif etype == INDEPENDENT:
                self._submit(obj.spec, obj.task, None, 0)
            elif etype == STEP:  # the trainer's pause between steps is over
                self._start_next_step()
            elif etype == WAKE:  # tokens have refilled; nothing to do but ask again
                self._wake_at.pop(obj, None)
            elif etype == GEN:
                self.llm.pool.on_event(obj, t)
            # DEADLINE: an action reached the guard's limit; the guard acts next
            # SHARE: an action reached its latest start; the deadline rule acts next
            if self.check_invariants:
                self.state.check_invariant()

    def _submit(self, spec, task: str, traj: Trajectory | None, turn: int) -> None:
        if self.cost_model is not None:
            spec = replace(spec, est_s=self.cost_model.estimate(
                signature(spec.kind, task, spec.name), spec.est_s))
        a = Action(self._next_action_id, spec, task, traj, turn, self.state.t)
        self._next_action_id += 1
        self.state.submit(a)

    def _on_arrive(self, traj: Trajectory) -> None:
        # This turn's action, and those submitted together with it; a chained one waits
        # for the action before it (submitted from _on_end).
        if self.over is not None and traj.id in self.over.aborted:
            return
        i = self._next_turn.get(traj.id, 0)
        if self.predictor is not None:
            self.predictor.observe_gap(traj, traj.turns[i].gen_s)
        while True:
            if not traj.turns[i].chained:
                self._submit_turn(traj, i)
            if not traj.turns[i].together or i + 1 >= traj.n_turns:
                return
            i += 1

    def _submit_turn(self, traj: Trajectory, i: int) -> None:
        if not traj.turns[i].same_turn:  # agent turns submitted so far
            traj.turn += 1
        self._next_turn[traj.id] = max(self._next_turn.get(traj.id, 0), i + 1)
        self._in_flight[traj.id] = self._in_flight.get(traj.id, 0) + 1
        self._submit(traj.turns[i].action, traj.task, traj, i)

    def _on_end(self, a: Action) -> None:
        if self.deadlines is not None and a.spec.kind == "cpu":
            if not self.sharing.current(a, self.state.t):
                return  # an end moved since (its node's speed changed)
            self._cpu_runs.pop(a.id, None)
            if self.sharing.followed(a.node):
                self.sharing.ended(a, self.state.t)
        failed = a.reason == "timeout"
        for b in self.state.finish(a, not failed, a.reason):  # its node's queue starts
            self._push_cpu_end(b, self.state.t)
        if self.cost_model is not None:
            restore = self._restore_s.pop(a.id, 0.0)
            if not failed:  # live learns from successes only
                self.cost_model.learn(a, self.state.t - a.start_t - restore)
        if self._feed and not failed:
            self.predictor.observe_action(a, self.state.t - a.start_t)
        traj = a.traj
        if self.trace_writer is not None:
            batch, setup = self._gpu_runs.pop(a.id, (1, 0.0))
            self.trace_writer.record(a, step=None if traj is None else traj.step, batch=batch,
                                   setup_s=setup, duration_s=a.spec.true_s,
                                   prompt=None if traj is None else traj.prompt)
        if traj is None:
            return
        if self.over is not None and traj.id in self.over.aborted:
            self.over.action_ended(traj)
            return
        nxt = a.turn + 1
        if nxt > self.turns_done.get(traj.id, (0, 0.0))[0]:
            self.turns_done[traj.id] = (nxt, self.state.t)
        if nxt < traj.n_turns and traj.turns[nxt].chained:  # its chain goes on
            self._submit_turn(traj, nxt)
        left = self._in_flight.pop(traj.id) - 1
        if left:  # others submitted together with it are still running
            self._in_flight[traj.id] = left
            return
        nxt = self._next_turn[traj.id]
        if nxt < traj.n_turns:
            if self.llm is not None:
                self.llm.turn(traj, nxt, self.state.t)
            else:
                self._push(self.state.t + traj.turns[nxt].gen_s, ARRIVE, traj)
            return
        del self._next_turn[traj.id]
        if self.llm is not None:
            self.llm.close(traj)
        self.turns_done.pop(traj.id, None)
        traj.end_t = self.state.t
        if self.predictor is not None:
            self.predictor.finish(traj.id, traj.turn)
        self.state.close_trajectory(traj)
        if self.rollout is not None:
            self.rollout.done(traj)
            return
        if self.over is not None:
            self.over.finished(traj)
        self.open_waiting_sandboxes()
        self.state.step_done += 1
        if self.state.step_done == self.state.step_total:
            self.state.metrics.steps.append((self.state.step_start_t, self.state.t))
            gap = self.workload.step_gap_s
            if gap > 0 and self._step + 1 < len(self.instance.steps):
                self._push(self.state.t + gap, STEP, None)
            else:
                self._start_next_step()

    def _start_next_step(self) -> None:
        if self.rollout is not None:  # the trainer has trained on a batch
            self.rollout.trained()
            return
        self._step += 1
        if self._step >= len(self.instance.steps):
            return
        t = self.state.t
        specs = self.instance.steps[self._step]
        state = self.state
        state.step_index, state.step_start_t = self._step, t
        state.step_total, state.step_done = len(specs), 0
        if self._step and self.workload.step_fresh_quotas:
            for ep in state.api.endpoints.values():
                ep.restart()
        if self.predictor is not None:
            self.predictor.reset()  # the last step's groups are done
        state.prompts = {}
        self.step_trajs = []
        for ts in specs:
            self.start_trajectory(ts, self._step)
        if self.over is not None:
            self.over.launch(specs, self._step)
        self.open_waiting_sandboxes()

    def start_trajectory(self, ts: TrajectorySpec, version: int) -> Trajectory:
        """A trajectory of ``ts`` at trainer version ``version`` starts now: it joins the
        step's trajectories (and its prompt group's) and waits for its sandbox
        (:meth:`open_waiting_sandboxes` places those that fit)."""
        state = self.state
        traj = Trajectory(self._next_traj_id, ts.task, version, list(ts.turns), ts.sandbox,
                          ts.prompt)
        self._next_traj_id += 1
        traj.start_t = state.t
        if ts.prompt is not None:
            state.prompts.setdefault(ts.prompt, []).append(traj)
        self.step_trajs.append(traj)
        self._sandbox_queue.append(traj)
        return traj

    def open_waiting_sandboxes(self) -> None:
        """Place the sandboxes of waiting trajectories that fit now, in order."""
        self._sandbox_queue.open_waiting(self._opened)

    def train_until(self, t: float) -> None:
        """The trainer is busy until ``t``: its step (or, for asynchronous rollouts,
        its batch) ends then."""
        self._push(t, STEP, None)

    def _opened(self, traj: Trajectory) -> None:
        """``traj``'s sandbox is placed: its first action arrives after the first LLM
        generation, which sandbox creation overlaps."""
        startup = traj.sandbox.startup_s if traj.sandbox is not None else 0.0
        if self.llm is not None:
            self.llm.open(traj, self.state.t, startup)
            return
        self._push(self.state.t + max(traj.turns[0].gen_s, startup), ARRIVE, traj)

    def _schedule_api_wakeups(self) -> None:
        """When api calls wait only for tokens, make sure an event fires once they refill
        (for each endpoint, when its smallest waiting call fits)."""
        state = self.state
        for name, wait in state.api_wakeups().items():
            at = state.t + wait + 1e-9  # past the refill instant despite rounding
            prev = self._wake_at.get(name)
            if prev is None or prev <= state.t or at < prev:
                self._wake_at[name] = at
                self._push(at, WAKE, name)
