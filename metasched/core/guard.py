"""Guardrails of the scheduling core: they hold for every scheduler, simulated or live.

- No decision exceeds capacity: ``ClusterState.check`` rejects any grant the pools
  cannot give (and the env's masks never offer one).
- No action starves: an action that has waited longer than ``max_wait_s`` and could
  start now is started before the scheduler is asked, with a default allocation.
- No idle cluster is kept idle: when the scheduler waits while nothing runs (no action,
  no GPU batch) and no API call waits for its quota to refill (``idle``), every action
  that could start is started, with a default allocation
  (its minimum cores; an idle device, resident service first, with the queued requests
  to that service as a batch; its API call).
"""

from __future__ import annotations

from metasched.core.actions import KINDS, Grant
from metasched.core.ledger import Ledger
from metasched.core.state import ClusterState


class WaitGuard:
    """Serves actions past ``max_wait_s`` first; counts how often it fired."""

    def __init__(self, max_wait_s: float | None) -> None:
        if max_wait_s is not None and not max_wait_s > 0:
            raise ValueError(f"max_wait_s must be > 0 or None (got {max_wait_s})")
        self.max_wait_s = max_wait_s
        self.fired = 0

    def next_deadline(self, state: ClusterState) -> float | None:
        """The next instant an action reaches the limit (None: no limit, or no pending
        action that has not reached it yet). Actions already past it are served as soon
        as they can start, at the next event that frees something."""
        if self.max_wait_s is None:
            return None
        now = state.t
        out = None
        for pend in state.pending.values():
            for a in pend.values():  # submission order: the first one not yet due
                due = a.submit_t + self.max_wait_s
                if due > now:
                    if out is None or due < out:
                        out = due
                    break
        return out

    @staticmethod
    def idle(state: ClusterState) -> bool:
        """Nothing runs (no action, no GPU batch outliving its timed-out requests) and no
        API call waits for a refill: a wait now would leave every resource idle until
        something arrives (both clocks then serve what can start)."""
        return (state.n_running == 0 and state.gpu.busy == 0
                and not (state.pending["api"] and state.api_wakeups()))

    def overdue(self, state: ClusterState, *, stalled: bool = False) -> list[Grant]:
        """Default grants for the feasible actions that waited past the limit, oldest
        first; with ``stalled`` (nothing else will ever happen), for all feasible ones."""
        if stalled:
            deadline = float("inf")
        elif self.max_wait_s is None:
            return []
        else:  # waited at least the limit (a hair of slack for float rounding)
            deadline = state.t - self.max_wait_s + 1e-9
        led: Ledger | None = None
        grants: list[Grant] = []
        for kind in KINDS:
            pending = state.pending[kind]
            if not pending or next(iter(pending.values())).submit_t > deadline:
                continue
            led = led or Ledger(state)
            most = max(led.free, default=0)  # the freest node's free cores
            for a in pending.values():  # submission order: oldest first
                if a.submit_t > deadline:
                    break
                if kind == "cpu":
                    if a.node < 0 and most < a.spec.min_cores and not (
                            a.traj is not None and a.traj.held_cores):
                        continue  # cannot fit anywhere (long overdue queues: skip fast)
                elif kind == "gpu" and not led.idle:
                    break
                g = led.default_grant(a)
                if g is not None:
                    grants.append(g)
                    most = max(led.free, default=0)
        self.fired += len(grants)
        return grants
