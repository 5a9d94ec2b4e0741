"""A learned policy behind the ``Scheduler`` interface (NumPy inference, no torch)."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

from metasched.agents.baselines import make_advisor
from metasched.agents.checkpoint import WEIGHTS, load_metadata
from metasched.agents.numpy_policy import NumpyPolicy
from metasched.core.actions import Grant
from metasched.core.observation import ObsConfig, ObservationEncoder
from metasched.core.scheduler import Scheduler
from metasched.core.state import ClusterState
from metasched.errors import ConfigError


class PolicyScheduler(Scheduler):
    """Decides with a policy's masked argmax: one grant (or wait) per call."""

    def __init__(self, policy: NumpyPolicy, obs_config: ObsConfig, name: str = "learned") -> None:
        self.policy = policy
        self.obs_config = obs_config
        self.name = name

    def reset(self, state: ClusterState, rng: np.random.Generator) -> None:
        try:
            self.encoder = ObservationEncoder(state, self.obs_config,
                                              make_advisor(self.obs_config))
        except ValueError as e:
            raise ConfigError("checkpoint", f"{self.name}: {e}") from None

    def decide(self, state: ClusterState) -> list[Grant]:
        obs = self.encoder.observe(state)
        g = self.encoder.grant(state, self.policy.act(obs))
        return [] if g is None else [g]


class LearnedScheduler(PolicyScheduler):
    """The policy of a checkpoint directory (see :mod:`metasched.agents.checkpoint`)."""

    def __init__(self, checkpoint: str | Path) -> None:
        path = Path(checkpoint)
        self.metadata = load_metadata(path)
        try:
            policy = NumpyPolicy.load(path / WEIGHTS)
        except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile) as e:
            raise ConfigError("checkpoint", f"{path / WEIGHTS} is unreadable ({e})") from None
        if self.metadata.get("normalization", {}).get("obs") and policy.obs_norm is None:
            raise ConfigError("checkpoint", f"{path} was trained on normalised observations "
                              f"but {WEIGHTS} has no normalisation statistics")
        super().__init__(policy, self.metadata["obs_config"], name=str(checkpoint))
