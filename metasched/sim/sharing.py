"""Time-sharing in the simulator: a node running more cores' worth of cpu actions than
it has cores (after the deadline rule started one on busy cores, see
:mod:`metasched.core.deadlines`) runs each of them at ``cores / demand`` of full speed,
as the kernel's fair scheduler shares oversubscribed cores among equal-weight processes.

A node is followed from its first time-shared action until its last one ends: at every
start or end of a cpu action there, each action's work left (full-speed seconds, its
start-up included) is brought to now at the old speed and its end moved to where the new
speed puts it, never past its time limit (a wall-clock limit: a slowed action that would
run past it ends there, as a timeout). A moved end leaves its old event in the heap;
:meth:`NodeSharing.current` tells the simulator which end is the action's. Nodes no
action shares are not followed: their actions end as they were planned.
"""

from __future__ import annotations

from collections.abc import Callable

from metasched.core.actions import RUNNING, Action
from metasched.sim.sampling import WorkloadInstance


class NodeSharing:
    """The followed nodes of one simulation.

    Args:
        cores: cores per node.
        push_end: pushes an action's end event at a time.
    """

    def __init__(self, cores: list[int], push_end: Callable[[Action, float], None]) -> None:
        self.cores = cores
        self._push_end = push_end
        # node -> {action id: [action, work left (s at full speed), as of t, end planned]}
        self.nodes: dict[int, dict[int, list]] = {}
        self.rate: dict[int, float] = {}
        self.planned: dict[int, float] = {}  # action id -> its end event (followed ones)

    def followed(self, node: int) -> bool:
        return node in self.nodes

    def current(self, a: Action, t: float) -> bool:
        """Whether an end event of ``a`` at ``t`` is its end (not one moved since)."""
        if a.status != RUNNING:
            return False
        planned = self.planned.get(a.id)
        return planned is None or planned == t

    def follow(self, node: int, running: list[tuple[Action, float]], t: float) -> None:
        """Start following ``node`` at ``t``, its cpu actions running with the end each
        would reach at full speed (unclipped by its time limit)."""
        members = self.nodes[node] = {}
        self.rate[node] = 1.0
        for a, end in running:
            members[a.id] = [a, max(0.0, end - t), t, min(end, a.start_t + a.spec.timeout_s)]
            self.planned[a.id] = members[a.id][3]

    def started(self, a: Action, run_s: float, t: float) -> None:
        """Cpu action ``a`` started at ``t`` on a followed node, running ``run_s`` at full
        speed (its end at full speed is already in the heap)."""
        end = min(t + run_s, t + a.spec.timeout_s)
        self.nodes[a.node][a.id] = [a, run_s, t, end]
        self.planned[a.id] = end
        self._retime(a.node, t)

    def ended(self, a: Action, t: float) -> None:
        """Cpu action ``a`` of a followed node ended at ``t``."""
        members = self.nodes[a.node]
        members.pop(a.id, None)
        self.planned.pop(a.id, None)
        self._retime(a.node, t)
        if not any(m[0].shared for m in members.values()) and self.rate[a.node] == 1.0:
            for aid in members:  # their ends stand as planned at full speed
                self.planned.pop(aid, None)
            del self.nodes[a.node], self.rate[a.node]

    def _retime(self, node: int, t: float) -> None:
        members = self.nodes[node]
        old = self.rate[node]
        demand = sum(m[0].cores for m in members.values())
        new = min(1.0, self.cores[node] / demand) if demand else 1.0
        self.rate[node] = new
        for m in members.values():
            a = m[0]
            m[1] = max(0.0, m[1] - (t - m[2]) * old)
            m[2] = t
            hard = a.start_t + a.spec.timeout_s
            natural = t + m[1] / new
            end = min(natural, hard)
            a.reason = "timeout" if natural > hard else ""
            if end != m[3]:
                m[3] = end
                self.planned[a.id] = end
                self._push_end(a, end)


__all__ = ["NodeSharing"]


def has_deadlines(instance: WorkloadInstance) -> bool:
    """Whether any action of ``instance`` has a deadline (``start_by_s``)."""
    specs = [ia.spec for ia in instance.independent]
    specs += [turn.action for step in instance.steps for ts in step for turn in ts.turns]
    return any(spec.start_by_s is not None for spec in specs)
