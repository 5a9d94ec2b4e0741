"""Behaviour cloning's data: the expert's labels, and DAgger's states reached by the
learner (labelled by the expert)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import shrunk

from metasched.agents.imitation import collect_expert
from metasched.core.observation import ObsConfig
from metasched.envs.scheduling import ActionSchedulingEnv


class Waits:
    """A learner that always waits."""

    def __init__(self, n_actions: int) -> None:
        self.wait = n_actions - 1

    def act(self, obs) -> int:
        return self.wait


def _env(name: str) -> ActionSchedulingEnv:
    w, c = shrunk(name, 0.1)
    return ActionSchedulingEnv(w, c, obs_config=ObsConfig())


@pytest.mark.parametrize("name", ["rm_math", "mixed"])
def test_labels_are_legal_and_the_expert_acts(name):
    env = _env(name)
    obs, actions = collect_expert(env, 300, 0, expert_name="rate_greedy")
    assert len(actions) == 300 and all(len(v) == 300 for v in obs.values())
    assert all(obs["action_mask"][i, a] for i, a in enumerate(actions))
    assert (actions != env.obs_config.n_actions - 1).any()


def test_dagger_follows_the_learner_and_keeps_the_experts_labels():
    env = _env("rm_math")
    wait = env.obs_config.n_actions - 1
    expert_obs, expert_actions = collect_expert(env, 200, 0, expert_name="rate_greedy")
    same_obs, same_actions = collect_expert(env, 200, 0, expert_name="rate_greedy",
                                            learner=Waits(env.obs_config.n_actions), beta=1.0)
    assert np.array_equal(same_actions, expert_actions)  # beta = 1: the expert drives
    assert np.array_equal(same_obs["slots"], expert_obs["slots"])
    obs, actions = collect_expert(env, 200, 0, expert_name="rate_greedy",
                                  learner=Waits(env.obs_config.n_actions), beta=0.0)
    assert not np.array_equal(obs["slots"], expert_obs["slots"])  # the learner drove
    # Waiting lets queues grow: the expert, asked there, would start something.
    assert (actions != wait).any()
    assert obs["slots"].reshape(200, 16, -1)[:, :, -1].sum(1).mean() > \
        expert_obs["slots"].reshape(200, 16, -1)[:, :, -1].sum(1).mean()
