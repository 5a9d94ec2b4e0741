"""The decision step: the loop that asks the scheduler, shared by both clocks.

A clock (the simulator's event heap, the dispatcher's asyncio loop) supplies time and
events and starts what is granted; this step decides when the scheduler is asked, so a
scheduler sees the same sequence of questions in both:

1. Only while a decision is possible (``ClusterState.decision_possible``).
2. The guard first: actions past ``max_wait_s`` that can start are started (default
   allocation) before the scheduler is asked (:meth:`DecisionStep.ready`).
3. The scheduler's grants are started, and it is asked again; an empty answer is a wait.
4. A wait while the cluster is idle (``WaitGuard.idle``) is not kept: what can start is
   started, and the scheduler is asked again (:meth:`DecisionStep.serve_idle`).
"""

from __future__ import annotations

from collections.abc import Callable

from metasched.core.actions import Grant
from metasched.core.guard import WaitGuard
from metasched.core.state import ClusterState


class DecisionStep:
    """Asks for decisions on ``state`` under ``guard``; ``start`` starts a grant on the
    clock's machines (raising ``InvalidGrant`` for an illegal one).

    The clock's loop::

        while step.ready():
            grants = scheduler.decide(state)
            if not grants:       # a wait
                if step.serve_idle():
                    continue     # something started: ask again
                break            # until the next event
            for g in grants:
                start(g)
    """

    __slots__ = ("state", "guard", "start")

    def __init__(self, state: ClusterState, guard: WaitGuard,
                 start: Callable[[Grant], object]) -> None:
        self.state = state
        self.guard = guard
        self.start = start

    def ready(self) -> bool:
        """Whether the scheduler is to be asked now: a decision is possible and the guard
        forced nothing (what it forces is started first, and the question repeated)."""
        state, guard = self.state, self.guard
        while state.decision_possible():
            forced = guard.overdue(state)
            if not forced:
                return True
            start = self.start
            for g in forced:
                start(g)
        return False

    def serve_all(self) -> bool:
        """Start every action that can start (default allocation), as after a wait when
        nothing else will happen; whether anything started."""
        forced = self.guard.overdue(self.state, stalled=True)
        start = self.start
        for g in forced:
            start(g)
        return bool(forced)

    def serve_idle(self) -> bool:
        """After the scheduler waited: on an idle cluster, :meth:`serve_all`; whether
        anything started (then the scheduler is asked again)."""
        return WaitGuard.idle(self.state) and self.serve_all()


__all__ = ["DecisionStep"]
