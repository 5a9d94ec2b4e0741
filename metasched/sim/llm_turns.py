"""A simulated trajectory's LLM turns as requests to the generation pool.

What the simulator hands over when a profile sets ``generation:``
(:mod:`metasched.sim.generation`): each trajectory's tokens (drawn up front from a
stream of the run's seed of their own, so the workload's and the scheduler's draws stay
as they were), each turn's request and its priority under the pool's order, and the
turn's action arriving when its last token is out.

Tokens: turn ``i``'s output is its generation time times ``tokens_per_s``; its prompt is
the prompt group's first prompt plus every earlier turn's output and tool output.

Orders (the priority a request is stamped with, lower first):

- ``fifo``: none (arrival order), today's practice.
- ``oracle``: longest true remaining work first: minus the sum of the trajectory's
  generation times and tool durations from this turn on (a bound: the truth).
- ``least_slack``: least slack against the step's critical path on the same truth:
  minus (time since the trajectory started + its remaining work). In synchronous steps,
  where every trajectory starts together, it orders as ``oracle`` does.
- ``predicted``: longest predicted remaining first: minus the run's predictor's median
  remaining time (``metasched.core.predictor``), as the live side would stamp it.

A scheduler may ask for another order (``state.generation_order``: a meta-policy option
that sets it, ``metasched.agents.meta_options``); requests submitted after take it, and
the configured one again once it asks for none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from metasched.core.actions import Trajectory
from metasched.core.predictor import Predictor, group_of
from metasched.core.state import ClusterState
from metasched.core.trace_writer import TraceWriter
from metasched.errors import ConfigError
from metasched.sim.generation import GenerationConfig, GenerationPool, GenRequest

__all__ = ["GenerationHost", "LLMTurns", "true_remaining_s"]


class GenerationHost(Protocol):
    """What the generation pool's turns ask of their simulator
    (:class:`~metasched.sim.simulator.Simulator`)."""

    state: ClusterState
    predictor: Predictor | None
    trace_writer: TraceWriter | None

    def push_event(self, t: float, etype: int, obj: object) -> None: ...


def true_remaining_s(traj: Trajectory, turn: int) -> float:
    """The trajectory's true remaining work from ``turn`` on: its generation times and
    its actions' durations (at one core), uncontended."""
    return sum(t.gen_s + t.action.true_s for t in traj.turns[turn:])


class LLMTurns:
    """The simulator's side of the generation pool (see the module docstring).

    Args:
        sim: the simulator (its clock, heap and arrivals).
        config: the profile's ``generation:``.
        seed: the run's seed (tokens come from a fourth stream of it).
        event: the simulator's event type for a pool's payload.
        arrive: the simulator's event type for a turn's action arriving.
    """

    def __init__(self, sim: GenerationHost, config: GenerationConfig, seed: int, event: int,
                 arrive: int) -> None:
        self.sim = sim
        self.config = config
        self._event, self._arrive = event, arrive
        self._rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(4)[3])
        self._tokens: dict[int, tuple[list[int], list[int]]] = {}
        self._first: dict[object, int] = {}  # prompt group -> its first prompt's tokens
        self._not_before: dict[int, float] = {}  # trajectory -> its sandbox is ready
        self.pool = GenerationPool(config, self._push, self._done, self._order(config.order))
        self._asked: str | None = None  # the order the scheduler asks for (state's)

    def _order(self, order: str) -> Callable[[GenRequest], float] | None:
        if order == "fifo":
            return None
        if order == "oracle":
            return lambda q: -true_remaining_s(q.traj, q.turn)
        if order == "least_slack":
            return lambda q: -(self.sim.state.t - q.traj.start_t
                               + true_remaining_s(q.traj, q.turn))
        if self.sim.predictor is None:
            raise ConfigError("workload.generation.order", "predicted needs a predictor "
                              "(metasched-eval predictor=...)")
        p = self.sim.predictor
        return lambda q: -p.remaining(q.traj.id, q.traj.task, group_of(q.traj)).p50

    # ------------------------------------------------------------------ the simulator's calls

    def open(self, traj: Trajectory, t: float, startup_s: float) -> None:
        """``traj``'s sandbox is placed at ``t`` (ready ``startup_s`` later): its first
        turn is generated; its action arrives once both are done."""
        self._draw(traj)
        self._not_before[traj.id] = t + startup_s
        self.turn(traj, 0, t)

    def turn(self, traj: Trajectory, i: int, t: float) -> None:
        """Generate ``traj``'s turn ``i`` from ``t`` (its action arrives after)."""
        prompts, outs = self._tokens[traj.id]
        asked = self.sim.state.generation_order
        if asked != self._asked:
            self._asked = asked
            self.pool.order_by(self._order(asked or self.config.order))
        if outs[i] == 0:  # no generation before it (an action submitted with another)
            self.sim.push_event(max(t, self._not_before.pop(traj.id, t)), self._arrive, traj)
            return
        self.pool.submit(GenRequest(traj, i, prompts[i], outs[i], t), t)

    def close(self, traj: Trajectory) -> None:
        """``traj`` has ended."""
        self._tokens.pop(traj.id, None)
        self._not_before.pop(traj.id, None)
        self.pool.forget(traj.id)

    # ------------------------------------------------------------------ internals

    def _draw(self, traj: Trajectory) -> None:
        cfg = self.config
        key = traj.prompt if traj.prompt is not None else ("traj", traj.id)
        first = self._first.get(key)
        if first is None:
            first = self._first[key] = max(1, round(cfg.prompt_tokens.sample(self._rng)))
        tools = np.rint(cfg.tool_output_tokens.sample(self._rng, traj.n_turns)).astype(int)
        outs = [round(t.gen_s * cfg.tokens_per_s) for t in traj.turns]
        prompts, ctx = [], first
        for out, tool in zip(outs, tools.tolist(), strict=True):
            prompts.append(ctx)
            ctx += out + tool
        self._tokens[traj.id] = (prompts, outs)

    def _push(self, t: float, payload: object) -> None:
        self.sim.push_event(t, self._event, payload)

    def _done(self, q: GenRequest) -> None:
        t = q.end_t
        self.sim.push_event(max(t, self._not_before.pop(q.traj.id, t)), self._arrive, q.traj)
        writer = self.sim.trace_writer
        if writer is not None:
            writer.record_generation({"step": q.traj.step, **q.record()})
