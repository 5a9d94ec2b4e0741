"""Helpers shared by the test modules (importable: pytest puts tests/ on sys.path)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from functools import cache

import pytest

from metasched.cli.train_app import TRAIN_MODULES
from metasched.compose import profile
from metasched.core.cluster_config import ClusterConfig
from metasched.envs.scheduling import scale_workload
from metasched.sim.workload_config import WorkloadConfig

# Tests of training and of SB3 interop need the `train` extra; the base install runs the rest.
HAS_TRAIN_EXTRA = all(importlib.util.find_spec(m) is not None for m in TRAIN_MODULES)
needs_train = pytest.mark.skipif(not HAS_TRAIN_EXTRA, reason="needs the train extra "
                                 "(torch, stable-baselines3, sb3-contrib, tensorboard)")


@cache
def shrunk(name: str, load: float = 0.1, steps: int | None = None
           ) -> tuple[WorkloadConfig, ClusterConfig]:
    """A profile at ``load`` x its trajectories per step (and ``steps`` RL steps if
    given), with its own cluster."""
    w, c = profile(name)
    return scale_workload(w, load=load, steps=steps), c


def _reachable_by_all(path: str) -> bool:
    """Whether every user may run ``path``: each directory on the way (the symlinks
    resolved) searchable by others."""
    real = os.path.realpath(path)
    d = os.path.dirname(real)
    while d != "/":
        if not os.stat(d).st_mode & 0o001:
            return False
        d = os.path.dirname(d)
    return os.access(real, os.X_OK) and bool(os.stat(real).st_mode & 0o001)


# The Python that commands run: the live dispatcher runs them as unprivileged users (one
# per sandbox), who cannot run an interpreter below a directory only its owner may enter
# (the test runner's may sit under /root). Any interpreter does: commands use only the
# standard library.
COMMAND_PY = (sys.executable if _reachable_by_all(sys.executable)
              else shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
              or sys.executable)
