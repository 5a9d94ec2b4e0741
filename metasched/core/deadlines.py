"""The deadline rule: no caller waits past its deadline on a silent scheduler.

An action's caller stops waiting at its *deadline*; ``ActionSpec.start_by_s`` is the
latest start (after submission) that still lets the action run its whole time limit
before then: the deadline less its ``timeout_s``. A cpu action still queued at its
latest start is started at once, *time-shared*, on cores that are already busy, as an
oversubscribed host runs more processes than it has cores: it holds no core of the pool
(``Action.shared``), and every action on its node runs at a fraction of full speed while
the node has more work than cores. So it ends by its own time limit (a wall-clock
limit), and its caller has an answer, a result or a "time limit", before the deadline.
The clocks model the fraction the same way: the simulator slows every action of an
oversubscribed node to ``cores / demand`` (:mod:`metasched.sim.sharing`); the live
dispatcher starts the command on a cpuset that overlaps busy ones (the kernel shares the
cores, with the cgroup's CPU weight where the host has a cpu controller).

The alternative (the live dispatcher's ``on_deadline: refuse``): the action is refused
at its latest start instead, so its caller hears before it gives up (HTTP 504 on the
SandboxFusion route, which clients retry).

Without a deadline (``start_by_s`` None, every existing profile) nothing here acts.
Only cpu actions time-share; a gpu batch or an API call is not split this way.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from metasched.core.actions import Action, Grant
from metasched.core.state import ClusterState

# Float rounding: an action is due at its latest start, not a hair after.
_EPS = 1e-9


def latest_start(a: Action) -> float | None:
    """The time by which ``a`` must start (None: it has no deadline)."""
    s = a.spec.start_by_s
    return None if s is None else a.submit_t + s


class DeadlineRule:
    """Which queued cpu actions have reached their latest start (:meth:`due`) and when
    the next one will (:meth:`next_due`), for one state. Actions are indexed as they
    are submitted (``ClusterState.follow_arrivals``), in a heap by latest start: a pass
    costs the actions it returns, not the queue's length."""

    def __init__(self) -> None:
        self._state: ClusterState | None = None
        self._feed = None
        self._heap: list[tuple[float, int, Action]] = []
        self.fired = 0  # actions started time-shared (or refused) by the rule

    def _index(self, state: ClusterState) -> list[tuple[float, int, Action]]:
        if self._state is not state:
            self._state = state
            self._feed = state.follow_arrivals()
            self._heap = []
            for a in state.pending["cpu"].values():
                self._add(a)
        feed = self._feed
        while feed:
            self._add(feed.popleft())
        return self._heap

    def _add(self, a: Action) -> None:
        if a.spec.kind == "cpu" and a.spec.start_by_s is not None:
            heapq.heappush(self._heap, (a.submit_t + a.spec.start_by_s, a.id, a))

    def next_due(self, state: ClusterState) -> float | None:
        """When the next queued action reaches its latest start (None: none has a
        deadline). May be now or past: then :meth:`due` returns it."""
        heap = self._index(state)
        pend = state.pending["cpu"]
        while heap and pend.get(heap[0][2].id) is not heap[0][2]:
            heapq.heappop(heap)  # started (or gone) meanwhile
        return heap[0][0] if heap else None

    def due(self, state: ClusterState) -> list[Action]:
        """The queued cpu actions whose latest start has come, earliest first (taken
        out of the index: the clock starts or refuses each)."""
        heap = self._index(state)
        pend = state.pending["cpu"]
        now = state.t + _EPS
        out = []
        while heap and heap[0][0] <= now:
            _, _, a = heapq.heappop(heap)
            if pend.get(a.id) is a:
                out.append(a)
        self.fired += len(out)
        return out


def share_node(state: ClusterState, a: Action) -> int:
    """The node a time-shared action runs on: its sandbox's, else the node with the
    fewest cores' worth of work per core (lowest id on ties)."""
    if a.node >= 0:
        return a.node
    cpu = state.cpu
    return min(range(cpu.n_nodes),
               key=lambda n: ((cpu.cores[n] - cpu.free[n] + cpu.shared[n]) / cpu.cores[n], n))


def serve_due(state: ClusterState, rule: DeadlineRule, start: Callable[[Grant], object],
              share: Callable[[Action, int], object]) -> int:
    """Act on every action whose latest start has come: one that can start now on free
    cores is started there (its minimum cores, as the guard's default grant), any other
    is handed to ``share`` with its node (the clock starts it time-shared, or refuses
    it). Returns how many were acted on."""
    due = rule.due(state)
    for a in due:
        if state.cpu_feasible(a):
            cpu = state.cpu
            node = a.node if a.node >= 0 else max(range(cpu.n_nodes),
                                                  key=lambda n: (cpu.free[n], -n))
            start(Grant(a, cores=a.spec.min_cores, node=node))
        else:
            share(a, share_node(state, a))
    return len(due)


__all__ = ["DeadlineRule", "latest_start", "serve_due", "share_node"]
