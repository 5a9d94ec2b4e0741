"""The scheduling core's state: pools, the pending queue, trajectories and accounting.

One ``ClusterState`` is driven by a clock: the simulator's event heap or the live
dispatcher's asyncio loop. Both call the same ``submit`` / ``start`` / ``finish``
methods, so what a scheduler sees (``ClusterState`` is the ``ClusterView`` handed to
``Scheduler.decide``) cannot differ between simulation and live dispatch.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import replace

from metasched.core.actions import (
    AHEAD,
    DONE,
    FAILED,
    KINDS,
    RUNNING,
    Action,
    Grant,
    InvalidGrant,
    SandboxSpec,
    Trajectory,
)
from metasched.core.ahead import Ahead
from metasched.core.cluster_config import ClusterConfig
from metasched.core.metrics import Recorder
from metasched.core.pools import ApiPool, CpuPool, GpuPool, ServiceSpec
from metasched.core.predictor import Predictor
from metasched.core.readiness import Readiness

KIND_INDEX = {k: i for i, k in enumerate(KINDS)}


def api_key(endpoint: str) -> str:
    """The pool key of one API endpoint in ``reserved`` / ``busy_by_task``."""
    return f"api/{endpoint}"


class ClusterState(Ahead, Readiness):
    """Pools, queue and trajectories at time ``t``; the view every scheduler reads.

    Attributes:
        t: current time in seconds.
        cpu, gpu, api: the pools.
        pending: per kind, pending actions by id in submission order.
        trajectories: trajectories alive now, by id.
        ahead: per CPU node, the cpu actions handed to it ahead of free cores, in the
            order the node starts them (see :meth:`hand_ahead`); empty unless the clock
            sets ``ahead_per_node``.
        ahead_per_node: most actions one node may hold ahead (0: none, the default).
        task_demand: per pool kind, each task's expected work in estimate-seconds
            (partitioning schedulers size partitions by it).
        reserved: ``(pool, task) -> units`` that a partitioning scheduler reserved for a
            task; they count as held, and as held-but-idle while the task does not use them.
            ``pool`` is ``"cpu"`` (cores) or ``api_key(endpoint)`` (concurrency slots of
            one endpoint).
        device_owner: GPU device -> the task it is reserved for; an owned device
            counts as held-but-idle while no batch runs on it.
        busy_by_task: ``(pool, task) -> units`` in use now, keyed like ``reserved``.
    """

    def __init__(self, cluster: ClusterConfig, services: dict[str, ServiceSpec],
                 *, timeline_dt: float = 10.0) -> None:
        self.cluster = cluster
        self.t = 0.0
        self.cpu = CpuPool([cluster.cores_per_node] * cluster.cpu_nodes,
                           [cluster.mem_gb_per_node] * cluster.cpu_nodes)
        self.gpu = GpuPool(cluster.gpu_devices, cluster.gpu_mem_gb, services)
        self.api = ApiPool(cluster.endpoints)
        self.pending: dict[str, dict[int, Action]] = {k: {} for k in KINDS}
        # Estimated seconds of the pending actions per kind, kept as they come and go
        # (summing a live queue of thousands at every observation would dominate it).
        self.pending_est_s: dict[str, float] = dict.fromkeys(KINDS, 0.0)
        self.trajectories: dict[int, Trajectory] = {}
        # The current RL step's prompt groups: prompt id -> its trajectories (siblings),
        # running and finished, as the clock knows them (none where prompts are unknown).
        self.prompts: dict[str, list[Trajectory]] = {}
        # The remaining-work predictor (metasched.core.predictor) the clock feeds, if any:
        # ``predictor.remaining_of(traj)`` gives a trajectory's remaining-time quantiles.
        self.predictor: Predictor | None = None
        # The generation pool's order a scheduler asks for (a meta-policy option's; see
        # metasched.sim.llm_turns), None: the configured one. Applies to later requests.
        self.generation_order: str | None = None
        # Handing ahead (see hand_ahead): per node, the actions handed there ahead of free
        # cores, and the freed cores kept for the first of them (idle, not free: another
        # grant there would start behind the node's queue, not on them).
        self.ahead_per_node = 0
        self.ahead: list[deque[Action]] = [deque() for _ in range(cluster.cpu_nodes)]
        self.ahead_claim = [0] * cluster.cpu_nodes
        self.n_ahead = 0
        self.reserved: dict[tuple[str, str], int] = {}
        self.device_owner: dict[int, str] = {}
        # Expected work per pool and task (estimate-seconds), for partitioning schedulers.
        self.task_demand: dict[str, dict[str, float]] = {k: {} for k in KINDS}
        self.busy_by_task: dict[tuple[str, str], int] = defaultdict(int)
        self.n_submitted = self.n_running = self.n_done = self.n_failed = 0
        self.n_grants = 0
        self.version = 0  # bumped by every change: lets readers cache what they derive
        self.metrics = Recorder(timeline_dt)
        self.max_node_cores = cluster.cores_per_node
        # Time-in-system of unfinished actions, integrated (the progress reward's basis).
        self.in_system_s = 0.0
        # The current RL step, as the clock driving the state knows it (0 when none).
        self.step_index = 0
        self.step_start_t = 0.0
        self.step_total = 0
        self.step_done = 0
        # Deques that every submitted action is appended to (see ``follow_arrivals``).
        self._arrival_feeds: list[deque[Action]] = []

    # ------------------------------------------------------------------ queries

    @property
    def n_pending(self) -> int:
        p = self.pending
        return len(p["cpu"]) + len(p["gpu"]) + len(p["api"])

    def cpu_feasible(self, a: Action) -> bool:
        """Whether ``a`` could start now with its minimum cores."""
        traj = a.traj
        need = a.spec.min_cores - (traj.held_cores if traj is not None else 0)
        if a.node >= 0:
            return self.cpu.free[a.node] >= need
        return max(self.cpu.free, default=0) >= need

    def feasible(self, a: Action) -> bool:
        """Whether some grant for ``a`` is legal now."""
        k = a.spec.kind
        if k == "cpu":
            return self.cpu_feasible(a)
        if k == "gpu":
            return any(not d.busy for d in self.gpu.devices)
        return self.api_feasible(a)

    # ------------------------------------------------------------------ mutations

    def advance(self, t: float) -> None:
        """Move the clock to ``t``, integrating resource use over the interval."""
        if t <= self.t:
            return
        self.version += 1
        cpu, gpu, api = self.cpu, self.gpu, self.api
        held = [0, 0, 0]
        if self.reserved:
            bbt = self.busy_by_task
            for (kind, task), units in self.reserved.items():
                idle = units - bbt[(kind, task)]
                if idle > 0:
                    held[KIND_INDEX[kind[:3]]] += idle
        if self.device_owner:
            devs = gpu.devices
            held[1] = sum(1 for d in self.device_owner if not devs[d].busy)
        self.in_system_s += (self.n_pending + self.n_ahead + self.n_running) * (t - self.t)
        self.metrics.integrate(self.t, t, (
            cpu.busy, cpu.held - cpu.held_busy + held[0], gpu.busy, held[1], api.busy, held[2]))
        self.t = t

    def reserve(self, pool: str, task: str, units: int) -> None:
        """Declare ``units`` of a pool reserved for ``task`` (partitioning schedulers)."""
        if pool == "gpu":
            raise ValueError("reserve GPU devices with reserve_device()")
        self.reserved[(pool, task)] = units

    def reserve_device(self, device: int, task: str) -> None:
        """Declare GPU ``device`` reserved for ``task`` (partitioning schedulers)."""
        self.device_owner[device] = task

    def submit(self, a: Action) -> None:
        """Queue a newly arrived action. A cpu action's ``max_cores`` above the largest
        node is capped to that node (no grant can exceed it), on both clocks: the
        scheduler's estimates and observations then mean the same in simulation and
        live."""
        self.version += 1
        spec = a.spec
        if spec.kind == "cpu":
            if spec.max_cores > self.max_node_cores:
                spec = a.spec = replace(
                    spec, max_cores=max(spec.min_cores, self.max_node_cores))
            best = self.cluster.cpu_launch_s + spec.true_s / spec.speedup(spec.max_cores)
        else:
            best = spec.true_s
        a.lower_bound_s = min(best, spec.timeout_s)
        self.pending[spec.kind][a.id] = a
        self.pending_est_s[spec.kind] += spec.est_s
        self.n_submitted += 1
        for feed in self._arrival_feeds:
            feed.append(a)

    def follow_arrivals(self) -> deque[Action]:
        """A deque to which every action submitted from now on is appended, in
        submission order: for an index kept outside the state (the guard's deadlines).
        Its reader pops what it has read."""
        feed: deque[Action] = deque()
        self._arrival_feeds.append(feed)
        return feed

    def check(self, g: Grant) -> str | None:
        """Why ``g`` is illegal now, or None when it is legal."""
        a = g.action
        spec = a.spec
        if self.pending[spec.kind].get(a.id) is not a:
            return f"action {a.id} is not pending"
        if spec.kind == "cpu":
            if not spec.min_cores <= g.cores <= spec.max_cores:
                return f"cores {g.cores} outside [{spec.min_cores}, {spec.max_cores}]"
            node = a.node if a.node >= 0 else g.node
            if not 0 <= node < self.cpu.n_nodes:
                return f"node {node} does not exist"
            held = a.traj.held_cores if a.traj is not None else 0
            if g.hold and a.traj is None:
                return "hold needs a trajectory"
            new_held = max(held, g.hold)
            if new_held - held + max(0, g.cores - new_held) > self.cpu.free[node]:
                return (f"{g.cores} cores (holding {g.hold}) requested, "
                        f"{self.cpu.free[node] + held} available")
        elif spec.kind == "gpu":
            if not 0 <= g.device < self.gpu.total:
                return f"device {g.device} does not exist"
            if self.gpu.devices[g.device].busy:
                return f"device {g.device} is busy"
            svc = self.gpu.services[spec.service]
            if svc.mem_gb > self.gpu.devices[g.device].mem_gb:
                return f"service {spec.service} does not fit device {g.device}"
            if len(g.batch) + 1 > svc.max_batch:
                return f"batch of {len(g.batch) + 1} exceeds max_batch {svc.max_batch}"
            ids = {a.id}
            for b in g.batch:
                if b.spec.service != spec.service or self.pending["gpu"].get(b.id) is not b:
                    return f"batch member {b.id} is not a pending request to {spec.service}"
                if b.id in ids:
                    return f"batch member {b.id} repeated"
                ids.add(b.id)
        elif not self.api_feasible(a):
            return f"endpoint {spec.endpoint} has no free slot or tokens"
        return None

    def start(self, g: Grant) -> tuple[tuple[Action, ...], float]:
        """Allocate ``g`` and mark its action(s) running.

        Returns the actions started (a gpu batch may start several) and the setup delay
        before they run (a gpu service restore). Raises :class:`InvalidGrant`.
        """
        self.version += 1
        why = self.check(g)
        if why is not None:
            raise InvalidGrant(why)
        a = g.action
        kind = a.spec.kind
        t = self.t
        delay = 0.0
        started: tuple[Action, ...] = (a,)
        if kind == "cpu":
            cpu = self.cpu
            node = a.node if a.node >= 0 else g.node
            traj = a.traj
            k = g.cores
            if g.hold:
                extra = max(0, g.hold - traj.held_cores)
                traj.held_cores += extra
                cpu.held += extra
                cpu.free[node] -= extra
                if traj.node < 0:
                    traj.node = node
            from_held = min(k, traj.held_cores) if traj is not None else 0
            cpu.free[node] -= k - from_held
            cpu.busy += k
            cpu.held_busy += from_held
            a.node, a.cores = node, k
            self.busy_by_task[("cpu", a.task)] += k
        elif kind == "gpu":
            d = self.gpu.devices[g.device]
            delay = self.gpu.make_resident(a.spec.service, g.device, t)
            d.busy, d.service, d.task = True, a.spec.service, a.task
            svc = self.gpu.services[a.spec.service]
            d.est_free_t = t + delay + svc.batch_s([a.spec.est_s] + [b.spec.est_s for b in g.batch])
            self.gpu.busy += 1
            self.busy_by_task[("gpu", a.task)] += 1
            started = (a, *g.batch)
            for b in started:
                b.device = g.device
        else:
            self.api.endpoints[a.spec.endpoint].take(a.spec.tokens, t)
            self.api.busy += 1
            self.busy_by_task[(api_key(a.spec.endpoint), a.task)] += 1
            self.metrics.request(t)
        for b in started:
            del self.pending[kind][b.id]
            self.pending_est_s[kind] -= b.spec.est_s
            b.status = RUNNING
            b.start_t = t
        if not self.pending[kind]:
            self.pending_est_s[kind] = 0.0  # no rounding residue in an empty queue
        self.n_running += len(started)
        self.n_grants += 1
        return started, delay

    def start_shared(self, a: Action, node: int) -> None:
        """Start pending cpu action ``a`` time-shared on ``node``'s busy cores (the
        deadline rule, :mod:`metasched.core.deadlines`): it runs on its minimum cores
        without taking them from the pool; :meth:`finish` ends it as any other."""
        self.version += 1
        if self.pending["cpu"].get(a.id) is not a:
            raise InvalidGrant(f"action {a.id} is not pending")
        self._unqueue(a)
        a.node, a.cores, a.shared = node, a.spec.min_cores, True
        self.cpu.shared[node] += a.cores
        a.status = RUNNING
        a.start_t = self.t
        self.n_running += 1

    def finish(self, a: Action, ok: bool, reason: str = "") -> list[Action]:
        """Record ``a`` as finished (``ok``) or failed (with ``reason``) at ``t`` and free
        what it held (a gpu device is freed by :meth:`release_device`).

        Returns the actions its node started on the cores it freed, from the node's
        queue of actions handed ahead (:meth:`hand_ahead`; empty without handing ahead):
        they are running from now on, and the clock must see them end."""
        self.version += 1
        kind = a.spec.kind
        promoted: list[Action] = []
        if a.status == AHEAD:
            # Its result came before its predecessor's (its node started it on cores the
            # state still counts as the predecessor's), or it never ran (cancelled): it
            # leaves its node's queue without cores of its own.
            self.ahead[a.node].remove(a)
            self.n_ahead -= 1
            self.n_running += 1  # it ran (or ends) now: counted out below with the others
            a.start_t = self.t
            promoted = self._promote(a.node)
        elif kind == "cpu" and a.shared:
            self.cpu.shared[a.node] -= a.cores  # it held no core of the pool
        elif kind == "cpu":
            cpu = self.cpu
            traj = a.traj
            from_held = min(a.cores, traj.held_cores) if traj is not None else 0
            cpu.busy -= a.cores
            cpu.held_busy -= from_held
            self.busy_by_task[("cpu", a.task)] -= a.cores
            promoted = self._return_cores(a.node, a.cores - from_held)
        elif kind == "api":
            self.api.endpoints[a.spec.endpoint].in_flight -= 1
            self.api.busy -= 1
            self.busy_by_task[(api_key(a.spec.endpoint), a.task)] -= 1
        self.n_running -= 1
        self._ended(a, ok, reason, a.start_t)
        return promoted

    def withdraw(self, a: Action, reason: str) -> None:
        """Take queued action ``a`` out of the queue unstarted (its caller cancelled
        it): it ends failed with ``reason`` at ``t``, having held nothing."""
        if a.id not in self.pending[a.spec.kind]:
            raise ValueError(f"action {a.id} is not queued")
        self.version += 1
        self._unqueue(a)
        self._ended(a, False, reason, self.t)

    def _unqueue(self, a: Action) -> None:
        """Take queued action ``a`` out of its kind's queue."""
        kind = a.spec.kind
        del self.pending[kind][a.id]
        self.pending_est_s[kind] -= a.spec.est_s
        if not self.pending[kind]:
            self.pending_est_s[kind] = 0.0  # no rounding residue in an empty queue

    def _ended(self, a: Action, ok: bool, reason: str, start_t: float) -> None:
        """Record ``a`` as ended at ``t`` (done if ``ok``, else failed with ``reason``),
        in the counts, its trajectory's action time and the metrics."""
        a.end_t = self.t
        a.status = DONE if ok else FAILED
        a.reason = reason
        if ok:
            self.n_done += 1
        else:
            self.n_failed += 1
        if a.traj is not None:
            a.traj.act_s += self.t - a.submit_t
        self.metrics.action(KIND_INDEX[a.spec.kind], a.task, a.submit_t, start_t, self.t, ok,
                            a.lower_bound_s, reason)

    def release_device(self, device: int) -> None:
        """The batch on ``device`` has ended; the service stays resident."""
        self.version += 1
        d = self.gpu.devices[device]
        d.busy = False
        self.gpu.busy -= 1
        self.busy_by_task[("gpu", d.task)] -= 1
        d.service = d.task = None

    def open_trajectory(self, traj: Trajectory) -> bool:
        """Place the sandbox of a starting trajectory; False when no node has memory."""
        self.version += 1
        if traj.sandbox is not None:
            node = self.cpu.place_sandbox(traj.sandbox.mem_gb)
            if node < 0:
                return False
            traj.node = node
        self.trajectories[traj.id] = traj
        return True

    def reserve_cores(self, node: int, cores: int) -> bool:
        """Take ``cores`` free cores of ``node`` outside any cpu grant, for what else runs
        on them (the live dispatcher's gpu commands); False, taking none, when fewer are
        free. :meth:`unreserve_cores` gives them back."""
        cpu = self.cpu
        if cores > cpu.free[node]:
            return False
        self.version += 1
        cpu.free[node] -= cores
        cpu.busy += cores
        return True

    def unreserve_cores(self, node: int, cores: int) -> list[Action]:
        """Give back what :meth:`reserve_cores` took; the actions the node's queue
        starts on them (as :meth:`finish`)."""
        self.version += 1
        self.cpu.busy -= cores
        return self._return_cores(node, cores)

    def open_sandbox(self, traj: Trajectory, sandbox: SandboxSpec) -> bool:
        """Give an open trajectory without one a sandbox (the live dispatcher makes it at
        the trajectory's first command); False when no node has the memory."""
        if traj.sandbox is not None:
            raise ValueError(f"trajectory {traj.id} already has a sandbox")
        node = self.cpu.place_sandbox(sandbox.mem_gb)
        if node < 0:
            return False
        self.version += 1
        traj.sandbox, traj.node = sandbox, node
        return True

    def close_trajectory(self, traj: Trajectory) -> None:
        """Free a finished trajectory's held cores and sandbox memory."""
        self.version += 1
        cpu = self.cpu
        if traj.held_cores:
            cpu.held -= traj.held_cores
            # (no action is ever handed ahead on a node where a trajectory holds cores)
            cpu.free[traj.node] += traj.held_cores
            traj.held_cores = 0
        if traj.sandbox is not None and traj.node >= 0:
            cpu.release_sandbox(traj.node, traj.sandbox.mem_gb)
        del self.trajectories[traj.id]

    def check_invariant(self) -> None:
        """submitted = completed + failed + pending (queued, handed ahead or running)."""
        if self.n_submitted != (self.n_done + self.n_failed + self.n_pending + self.n_ahead
                                + self.n_running):
            raise AssertionError(
                f"accounting broken: submitted {self.n_submitted} != done {self.n_done} + "
                f"failed {self.n_failed} + queued {self.n_pending} + ahead {self.n_ahead} + "
                f"running {self.n_running}")


__all__ = ["ClusterState", "InvalidGrant", "api_key"]
