"""What a workload profile's fit holds: per action type (:class:`TypeFit`), per task
(:class:`TaskFit`) and for the whole trace (:class:`Calibration`, which
:func:`metasched.calibration.profile.calibrate` returns and
:mod:`metasched.calibration.profile_yaml` writes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from metasched.calibration.fits import AmdahlFit, CountFit, DistFit
from metasched.calibration.groups import GroupFit
from metasched.calibration.samples import Stages, TraceSamples, TypeSamples

__all__ = ["Calibration", "TaskFit", "TypeFit"]


@dataclass
class TypeFit:
    """What was fitted for one action type."""

    samples: TypeSamples
    duration: DistFit
    x: np.ndarray  # the durations fitted (one-core / batch-of-one / call seconds)
    censored: np.ndarray
    amdahl: AmdahlFit | None
    parallel_fraction: float
    timeout_s: float
    timeout_rate: float
    fitted_timeout_rate: float
    est_sigma: float
    tokens: DistFit | None = None
    prob: float = 1.0
    n_in_task: int = 0  # tool actions of its task (prob's denominator)

    @property
    def label(self) -> str:
        s = self.samples
        return f"{s.task}/{'reward' if s.reward else s.name}"


@dataclass
class TaskFit:
    name: str
    n_traj: int
    share: float
    turns: CountFit
    gaps: DistFit | None
    actions: list[TypeFit]
    reward: TypeFit
    unused_rewards: list[str] = field(default_factory=list)
    sandbox: dict[str, Any] | None = None
    # What one agent turn submitted, where some turn submitted several actions: (prob,
    # its stages in order, turns seen); ``turns`` and ``gaps`` are then per agent turn.
    turn_groups: list[tuple[float, Stages, int]] = field(default_factory=list)


@dataclass
class Calibration:
    """A workload profile fitted to a trace (see :func:`calibrate`)."""

    name: str
    samples: TraceSamples
    types: list[TypeFit]
    tasks: list[TaskFit]
    steps: int
    trajectories_per_step: int
    estimate_error: float
    services: dict[str, dict[str, tuple[Any, str]]]  # name -> field -> (value, comment)
    cluster: dict[str, Any]  # the configs/cluster document, or {"defaults": ...}
    cluster_source: str
    notes: list[str] = field(default_factory=list)
    step_gap: tuple[float, int] = (0.0, 0)  # the pause between steps, and gaps measured
    # Steps after the first that began on a service started anew, of how many.
    fresh_steps: tuple[int, int] = (0, 0)
    groups: GroupFit | None = None  # prompt groups, where the trace has prompt ids

    @property
    def step_fresh_quotas(self) -> bool:
        """Every step after the first began on a restarted service (its quotas full)."""
        k, n = self.fresh_steps
        return n > 0 and k == n
