"""The ``Scheduler`` interface shared by heuristics, learned policies, the simulator,
the Gymnasium env and the live dispatcher."""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from metasched.core.actions import Grant
from metasched.core.state import ClusterState


class Scheduler(ABC):
    """Decides which pending actions to start, with what allocation.

    ``decide`` is called only when some pending action could start. It returns the
    grants to apply now, in order; an empty list means *wait* until the next event.
    Grants are applied one by one and the scheduler is asked again while a decision is
    still possible, so returning only the most urgent grant is always correct.

    A scheduler reads ``state`` (pools, ``pending``, ``trajectories``, ``t``) and the
    *estimates* of actions (``spec.est_s``), never ``spec.true_s``. It must not
    mutate ``state`` except through ``reset``'s ``state.reserve`` declarations.
    """

    name: str = "scheduler"

    def reset(self, state: ClusterState, rng: np.random.Generator) -> None:  # noqa: B027
        """Called once before a run, with the run's state and a dedicated generator."""

    @abstractmethod
    def decide(self, state: ClusterState) -> list[Grant]:
        """Grants to apply now (empty: wait for the next event)."""
