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

Cost. The guard runs before every decision, so it must not walk the queue: a live
dispatcher can hold 100,000 requests that have all waited past the limit. Overdue
actions sit at the front of each kind's queue (submission order); :meth:`overdue` walks
them only while the pass can still grant something of that kind (free cores, an idle
device, an endpoint with room), so a pass costs the grants it makes, not the queue's
length. :meth:`next_deadline` reads the oldest action not yet due from the guard's own
deque of them, fed by :meth:`ClusterState.follow_arrivals`, in amortised O(1). Two cases
still walk: cores held by trajectories (an action of theirs may start with no free core),
and an endpoint with room for small calls only; the grants are the same as a full walk.
"""

from __future__ import annotations

from collections import deque

from metasched.core.actions import KINDS, Action, Grant
from metasched.core.ledger import Ledger
from metasched.core.state import ClusterState

# A deque of not-yet-due actions is rebuilt from the queue once it holds this many more
# entries than twice the queue (actions started while older ones wait stay in it until
# they reach its front): memory stays proportional to the queue.
_SLACK = 64


class WaitGuard:
    """Serves actions past ``max_wait_s`` first; counts how often it fired."""

    def __init__(self, max_wait_s: float | None) -> None:
        if max_wait_s is not None and not max_wait_s > 0:
            raise ValueError(f"max_wait_s must be > 0 or None (got {max_wait_s})")
        self.max_wait_s = max_wait_s
        self.fired = 0
        self._state: ClusterState | None = None
        self._feed: deque[Action] = deque()
        # Per kind, pending actions in submission order that had not reached the limit
        # when last looked at (with some that have since started: dropped lazily).
        self._waiting: dict[str, deque[Action]] = {}

    def _not_due(self, state: ClusterState) -> dict[str, deque[Action]]:
        """The per-kind deques of actions not yet due, brought up to date."""
        if self._state is not state:  # first use, or another state: index it
            self._state = state
            self._feed = state.follow_arrivals()
            self._waiting = {k: deque(state.pending[k].values()) for k in KINDS}
        feed, waiting = self._feed, self._waiting
        while feed:
            a = feed.popleft()
            waiting[a.spec.kind].append(a)
        return waiting

    def next_deadline(self, state: ClusterState) -> float | None:
        """The next instant an action reaches the limit (None: no limit, or no pending
        action that has not reached it yet). Actions already past it are served as soon
        as they can start, at the next event that frees something."""
        if self.max_wait_s is None:
            return None
        now, wait = state.t, self.max_wait_s
        out = None
        for kind, dq in self._not_due(state).items():
            pend = state.pending[kind]
            if len(dq) > 2 * len(pend) + _SLACK:
                dq = self._waiting[kind] = deque(
                    a for a in pend.values() if a.submit_t + wait > now)
            while dq:  # submission order: the first one pending and not yet due
                a = dq[0]
                if pend.get(a.id) is a and a.submit_t + wait > now:
                    due = a.submit_t + wait
                    if out is None or due < out:
                        out = due
                    break
                dq.popleft()  # started, or due: overdue() finds it in the queue
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
            pend = state.pending[kind]
            if not pend or next(iter(pend.values())).submit_t > deadline:
                continue
            led = led or Ledger(state)
            if kind == "cpu":
                self._overdue_cpu(state, led, pend.values(), deadline, grants)
            elif kind == "gpu":
                for a in pend.values():  # submission order: oldest first
                    if a.submit_t > deadline or not led.idle:
                        break  # not due yet, or no idle device left for anyone
                    g = led.default_grant(a)
                    if g is not None:
                        grants.append(g)
            else:
                self._overdue_api(state, led, pend.values(), deadline, grants)
        self.fired += len(grants)
        return grants

    @staticmethod
    def _overdue_cpu(state: ClusterState, led: Ledger, pending, deadline: float,
                     grants: list[Grant]) -> None:
        # With no core held by a trajectory, an action can start only on free cores: once
        # none is left in the ledger, no later action can.
        held = state.cpu.held > 0
        for a in pending:
            if a.submit_t > deadline:
                break
            g = led.default_grant(a)
            if g is not None:
                grants.append(g)
            elif not held and max(led.free, default=0) == 0:
                break

    @staticmethod
    def _overdue_api(state: ClusterState, led: Ledger, pending, deadline: float,
                     grants: list[Grant]) -> None:
        # An endpoint without a free slot or request token (after the planned calls)
        # starts nothing more in this pass: skip its calls; stop once every endpoint is
        # in that state. ``api_ok`` brings an endpoint's quota window to now when it first
        # looks at one of its calls, as a walk over every call does.
        endpoints = state.api.endpoints
        full: set[str] = set()
        for a in pending:
            if a.submit_t > deadline:
                break
            name = a.spec.endpoint
            if name in full:
                continue
            g = led.default_grant(a)
            if g is not None:
                grants.append(g)
            if not led.api_room(endpoints[name]):
                full.add(name)
                if len(full) == len(endpoints):
                    break
