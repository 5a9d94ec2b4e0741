"""Handing ahead: cpu actions handed to a node ahead of its free cores.

A node may hold up to ``ahead_per_node`` pending cpu actions in its own queue and start
each, in order, as soon as the cores before it free, without waiting for the scheduler.
:class:`Ahead` holds the state's part of it; :class:`~metasched.core.state.ClusterState`
inherits it and owns the attributes it reads (``ahead``, ``ahead_claim``, ``n_ahead``,
``ahead_per_node``, the pools and the pending queue).
"""

from __future__ import annotations

from itertools import islice
from typing import TYPE_CHECKING

from metasched.core.actions import AHEAD, RUNNING, Action, InvalidGrant

if TYPE_CHECKING:
    from collections import deque

    from metasched.core.pools import CpuPool


class Ahead:
    """The ahead queues of actions handed ahead (a mixin of ``ClusterState``)."""

    t: float
    cpu: CpuPool
    pending: dict[str, dict[int, Action]]
    pending_est_s: dict[str, float]
    ahead: list[deque[Action]]
    ahead_claim: list[int]
    ahead_per_node: int
    n_ahead: int
    n_running: int
    n_grants: int
    version: int
    busy_by_task: dict[tuple[str, str], int]

    def check_ahead(self, a: Action, node: int, cores: int) -> str | None:
        """Why ``a`` cannot be handed to ``node`` ahead with ``cores`` now, or None."""
        spec = a.spec
        if spec.kind != "cpu" or self.pending["cpu"].get(a.id) is not a:
            return f"action {a.id} is not a pending cpu action"
        if not 0 <= node < self.cpu.n_nodes:
            return f"node {node} does not exist"
        if a.node >= 0 and a.node != node:
            return f"action {a.id} runs on node {a.node} (its sandbox's)"
        if not spec.min_cores <= cores <= min(spec.max_cores, self.cpu.cores[node]):
            return f"cores {cores} outside [{spec.min_cores}, {spec.max_cores}] or the node's"
        if a.traj is not None and a.traj.held_cores:
            return "its trajectory holds cores (its actions start on them, not in order)"
        if self.cpu.held:
            return "trajectories hold cores (a node's queue would wait behind them)"
        q = self.ahead[node]
        if len(q) >= self.ahead_per_node:
            return f"node {node} holds {len(q)} actions ahead, its most"
        if not q and self.cpu.free[node] >= cores:
            return f"node {node} can start it now (a grant, not a hand-off)"
        return None

    def hand_ahead(self, a: Action, node: int, cores: int) -> None:
        """Hand pending cpu action ``a`` to ``node`` ahead of free cores (handing ahead): the
        ahead queues it and starts it, with ``cores`` cores, as soon as the actions
        before it there leave them, without waiting for the scheduler. From now on it is
        neither pending (no scheduler sees or grants it) nor running: it is ``AHEAD``,
        in ``ahead[node]`` (counted in ``n_ahead``), until a :meth:`finish` of an action
        on that node leaves the cores it takes; the node's freed cores are kept for its
        queue meanwhile (``ahead_claim``), never granted twice. Raises
        :class:`InvalidGrant` (see :meth:`check_ahead`)."""
        why = self.check_ahead(a, node, cores)
        if why is not None:
            raise InvalidGrant(why)
        self.version += 1
        cpu = self.cpu
        del self.pending["cpu"][a.id]
        self.pending_est_s["cpu"] -= a.spec.est_s
        if not self.pending["cpu"]:
            self.pending_est_s["cpu"] = 0.0
        a.status, a.node, a.cores = AHEAD, node, cores
        # The node's free cores (fewer than it needs) wait for the queue with those that
        # free later.
        self.ahead_claim[node] += cpu.free[node]
        cpu.free[node] = 0
        self.ahead[node].append(a)
        self.n_ahead += 1
        self.n_grants += 1

    def fill_ahead(self) -> list[Action]:
        """Hand pending cpu actions ahead (:meth:`hand_ahead`), in submission order, each
        with its ``min_cores`` (what surely fits when it starts), to its sandbox's node
        or the node holding the fewest, until every node holds ``ahead_per_node``. Only
        actions that cannot start now are handed: the scheduler has had its turn over
        the free cores. Returns those handed."""
        limit = self.ahead_per_node
        if limit <= 0 or not self.pending["cpu"] or self.cpu.held:
            return []
        ahead = self.ahead
        room = sum(limit - len(q) for q in ahead)
        out: list[Action] = []
        pending = self.pending["cpu"]
        skipped = 0  # actions passed over, still first in the queue
        while room > 0:
            # The queue's head in chunks, not a copy of all of it: a deep queue costs
            # nothing when a few actions fill the room (handed ones leave the queue).
            chunk = list(islice(pending.values(), skipped, skipped + 2 * room + 8))
            if not chunk:
                break
            for a in chunk:
                if room <= 0:
                    break
                k = a.spec.min_cores
                nodes = ([a.node] if a.node >= 0
                         else sorted(range(len(ahead)), key=lambda n: (len(ahead[n]), n)))
                for node in nodes:
                    if self.check_ahead(a, node, k) is None:
                        self.hand_ahead(a, node, k)
                        out.append(a)
                        room -= 1
                        break
                else:
                    skipped += 1
        return out

    def _return_cores(self, node: int, k: int) -> list[Action]:
        """``k`` cores of ``node`` are no longer taken: free, or kept for the node's
        queue, whose first actions start on them (returned)."""
        if not self.ahead[node]:
            self.cpu.free[node] += k
            return []
        self.ahead_claim[node] += k
        return self._promote(node)

    def _promote(self, node: int) -> list[Action]:
        """Start the first actions of ``node``'s queue that its kept cores fit, in order
        (as the node does); what is kept when the queue empties is free again."""
        q = self.ahead[node]
        started = []
        cpu = self.cpu
        while q and q[0].cores <= self.ahead_claim[node]:
            b = q.popleft()
            self.ahead_claim[node] -= b.cores
            cpu.busy += b.cores
            self.busy_by_task[("cpu", b.task)] += b.cores
            b.status, b.start_t = RUNNING, self.t
            self.n_ahead -= 1
            self.n_running += 1
            started.append(b)
        if not q and self.ahead_claim[node]:
            cpu.free[node] += self.ahead_claim[node]
            self.ahead_claim[node] = 0
        return started


__all__ = ["Ahead"]
