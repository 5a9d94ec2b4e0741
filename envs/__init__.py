"""Gymnasium environments over the metasched scheduling core.

Importing this package registers ``metasched/ActionScheduling-v0``::

    import gymnasium as gym
    import metasched.envs  # noqa: F401

    env = gym.make("metasched/ActionScheduling-v0", workload="rm_math")
"""

from gymnasium.envs.registration import register, registry

from metasched.envs.scheduling import ActionSchedulingEnv, Randomization, RewardConfig

ENV_ID = "metasched/ActionScheduling-v0"

if ENV_ID not in registry:
    register(id=ENV_ID, entry_point="metasched.envs.scheduling:ActionSchedulingEnv")

__all__ = ["ENV_ID", "ActionSchedulingEnv", "Randomization", "RewardConfig"]
