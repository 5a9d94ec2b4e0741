"""Helpers shared by the test modules (importable: pytest puts tests/ on sys.path)."""

from __future__ import annotations

from functools import cache

from metasched.compose import profile
from metasched.core.cluster_config import ClusterConfig
from metasched.envs.scheduling import scale_workload
from metasched.sim.workload_config import WorkloadConfig


@cache
def shrunk(name: str, load: float = 0.1, steps: int | None = None
           ) -> tuple[WorkloadConfig, ClusterConfig]:
    """A profile at ``load`` x its trajectories per step (and ``steps`` RL steps if
    given), with its own cluster."""
    w, c = profile(name)
    return scale_workload(w, load=load, steps=steps), c
