"""Sampling: an action's draws made in one batch per trajectory are the draws made one
action at a time, in the same order, leaving the generator in the same state."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from metasched.compose import profile
from metasched.sim.sampling import _spec, _specs
from metasched.sim.workload_config import ActionType

PROFILES = ("coding", "mixed", "search", "rm_math", "retool")


def _types(name: str) -> list[tuple[list[ActionType], float]]:
    """Per task of a profile: 500 of its action types in a random order, the reward last,
    and the profile's estimate error."""
    w, _ = profile(name)
    pick = np.random.default_rng(7)
    out = []
    for task in w.tasks:
        kinds = pick.integers(len(task.actions), size=500) if task.actions else []
        out.append(([task.actions[k] for k in kinds] + [task.reward], w.estimate_error))
    return out


def _one_by_one(types: list[ActionType], rng: np.random.Generator, est_error: float):
    return [_spec(a, rng, est_error, i == len(types) - 1) for i, a in enumerate(types)]


@pytest.mark.parametrize("est_error", [None, 0.0])
@pytest.mark.parametrize("name", PROFILES)
def test_batched_draws_equal_single_draws(name: str, est_error: float | None) -> None:
    for types, profile_error in _types(name):
        err = profile_error if est_error is None else est_error
        a, b = np.random.default_rng(11), np.random.default_rng(11)
        assert _specs(types, a, err) == _one_by_one(types, b, err)
        assert a.bit_generator.state == b.bit_generator.state  # the stream goes on alike


def test_a_point_mass_at_zero_draws_one_by_one() -> None:
    """A duration with a mass at 0 takes a uniform as well as a normal: still the same."""
    w, _ = profile("coding")
    task = w.tasks[0]
    odd = task.actions[0].model_copy(
        update={"duration_s": replace(task.actions[0].duration_s, zero=0.3)})
    types = [odd, task.actions[1], odd, task.reward]
    a, b = np.random.default_rng(3), np.random.default_rng(3)
    got = _specs(types, a, 0.5)
    assert got == _one_by_one(types, b, 0.5)
    assert a.bit_generator.state == b.bit_generator.state
    assert any(s.true_s == odd.duration_s.lo for s in _specs([odd] * 200, a, 0.5))


def test_constant_durations_and_tokens_take_no_draw() -> None:
    w, _ = profile("search")
    consts = [t for task in w.tasks for t in task.actions
              if t.tokens is not None and t.tokens.sigma == 0.0]
    assert consts, "search has a call with constant tokens"
    a, b = np.random.default_rng(5), np.random.default_rng(5)
    assert _specs(consts * 3, a, 0.0) == _one_by_one(consts * 3, b, 0.0)
    assert a.bit_generator.state == b.bit_generator.state


def test_token_counts_past_int64_stay_exact() -> None:
    """Token counts are Python ints, as one draw at a time makes them: no overflow."""
    w, _ = profile("search")
    judge = next(t for task in w.tasks for t in (*task.actions, task.reward)
                 if t.tokens is not None and t.tokens.sigma > 0.0)
    huge = judge.model_copy(
        update={"tokens": replace(judge.tokens, median=1e25, lo=0.0, hi=float("inf"))})
    a, b = np.random.default_rng(9), np.random.default_rng(9)
    got = _specs([huge] * 50 + [judge], a, 0.5)
    assert got == _one_by_one([huge] * 50 + [judge], b, 0.5)
    assert min(s.tokens for s in got[:-1]) > 2**63
