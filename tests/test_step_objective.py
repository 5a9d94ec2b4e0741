"""The env's step objective: the progress reward telescopes to minus the step time, the
efficiency reward counts granted or held resource-seconds, both objectives pass the
API checkers."""

from __future__ import annotations

import dataclasses
import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env as gym_check_env
from helpers import needs_train, shrunk

import metasched.envs  # noqa: F401  (registers the env id)
from metasched.envs import ENV_ID
from metasched.envs.scheduling import ActionSchedulingEnv, RewardConfig
from metasched.errors import ConfigError
from metasched.sim.simulator import Simulator
from metasched.sim.step_progress import StepProgress


def _episode(env: ActionSchedulingEnv, seed: int, policy: str) -> tuple[float, list[float]]:
    """Run one episode (``policy``: always wait, the advisor's action, random legal
    actions); returns the return and the rewards."""
    env.reset(seed=seed)
    rng = np.random.default_rng(seed)
    rewards, done = [], False
    n = env.obs_config.n_actions
    while not done:
        mask = env.action_masks()
        if policy == "wait":
            a = n - 1
        elif policy == "random":
            a = int(rng.choice(np.flatnonzero(mask)))
        else:  # the first legal grant
            legal = np.flatnonzero(mask[:-1])
            a = int(legal[0]) if legal.size else n - 1
        _, r, done, _, _ = env.step(a)
        rewards.append(r)
    return float(np.sum(rewards)), rewards


@pytest.mark.parametrize("name,load,steps,policy", [
    ("retool_grouped", 0.06, 2, "first"), ("retool_grouped", 0.06, 2, "random"),
    ("rm_math", 0.1, 2, "wait"), ("rm_math", 0.1, 2, "random"),
    ("swe_grouped", 0.125, 1, "first"), ("swe_grouped", 0.125, 1, "random"),
    ("search", 0.1, 2, "wait"), ("search", 0.1, 2, "first")])
def test_step_return_is_minus_step_time(name, load, steps, policy):
    w, c = shrunk(name, load=load)
    scale = 0.01
    env = ActionSchedulingEnv(w, c, reward=RewardConfig(objective="step", efficiency=0.0,
                                                        scale=scale), episode_steps=steps)
    ret, _ = _episode(env, 7, policy)
    step_s = env.sim.result().step_s
    assert step_s.size == steps
    assert ret == pytest.approx(-scale * step_s.sum(), rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("name", ["retool_grouped", "swe_grouped"])
def test_projected_end_is_never_before_now_and_ends_at_the_step_end(name):
    w, c = shrunk(name, load=0.1)
    sim = Simulator(w, c, 3, max_wait_s=300)
    progress = StepProgress(sim)
    from metasched.agents import make_scheduler

    sched = make_scheduler("critical_path")
    sched.reset(sim.state, sim.scheduler_rng())
    seen = 0
    while sim.next_decision():
        end = progress.step_end()
        assert end is None or end >= sim.state.t - 1e-9
        seen += end is not None
        grants = sched.decide(sim.state)
        for g in grants or ():
            sim.apply(g)
        if not grants:
            sim.wait()
    assert seen
    assert progress.potential() == pytest.approx(float(sim.result().step_s.sum()), rel=1e-12)


def test_step_efficiency_counts_granted_and_held_resource_seconds():
    w, c = shrunk("retool_grouped", load=0.06)
    env = ActionSchedulingEnv(w, c, reward=RewardConfig(objective="step", progress=0.0,
                                                        scale=1.0), episode_steps=1)
    ret, _ = _episode(env, 5, "first")
    tot = env.sim.result().totals
    state = env.sim.state
    # cpu busy + held over the cores (retool has no gpu or api pool)
    assert state.gpu.total == 0 and state.api.total == 0
    want = (tot[0] + tot[1]) / state.cpu.total
    assert want > 0
    assert ret == pytest.approx(-want, rel=1e-9)


def test_act_objective_is_unchanged():
    """The default objective's return is minus total ACT (and held-idle) as before."""
    w, c = shrunk("rm_math", load=0.1)
    env = ActionSchedulingEnv(w, c, reward=RewardConfig(efficiency=0.0, scale=0.01),
                              episode_steps=1)
    ret, _ = _episode(env, 1, "first")
    assert ret == pytest.approx(-0.01 * env.sim.result().act.sum(), rel=1e-6)


@pytest.mark.parametrize("name,objective,ofp", [
    ("retool_grouped", "act", None), ("retool_grouped", "step", None),
    ("rm_math", "act", None), ("rm_math", "step", None), ("mixed", "act", None),
    ("mixed", "step", None), ("retool_grouped", "act", 1), ("mixed", "act", 2)])
def test_gymnasium_check_env_both_objectives(name, objective, ofp):
    w, c = shrunk(name, load=0.06)
    w = dataclasses.replace(w, max_offpolicyness=ofp)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        env = gym.make(ENV_ID, workload=w, cluster=c,
                       reward=RewardConfig(objective=objective))
        gym_check_env(env.unwrapped)
    assert [str(x.message) for x in caught] == []


@needs_train
def test_sb3_check_env_step_objective():  # the act objective: test_env.py, every profile
    from stable_baselines3.common.env_checker import check_env as sb3_check_env

    w, c = shrunk("retool_grouped", load=0.06)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sb3_check_env(ActionSchedulingEnv(w, c, reward=RewardConfig(objective="step")))
    assert [str(x.message) for x in caught] == []


@pytest.mark.parametrize("bad", ["steps", "ACT", ""])
def test_unknown_objective_is_one_line_error(bad):
    with pytest.raises(ConfigError, match="reward.objective"):
        RewardConfig(objective=bad)


def test_step_objective_needs_synchronous_steps():
    w, c = shrunk("retool_grouped", load=0.06)
    with pytest.raises(ConfigError, match="synchronous"):
        ActionSchedulingEnv(dataclasses.replace(w, max_offpolicyness=1), c,
                            reward=RewardConfig(objective="step"))
