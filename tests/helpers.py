"""Helpers shared by the test modules (importable: pytest puts tests/ on sys.path)."""

from __future__ import annotations

import importlib.util
import shutil
import socket
import sys
from functools import cache

import pytest

from metasched.cli.train_app import TRAIN_MODULES
from metasched.compose import profile
from metasched.core.cluster_config import ClusterConfig
from metasched.envs.scheduling import scale_workload
from metasched.runtime.dispatch import DispatcherConfig
from metasched.runtime.sandbox.uids import runnable_by_all
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


# The Python that commands run: the live dispatcher runs them as unprivileged users (one
# per sandbox), who cannot run an interpreter below a directory only its owner may enter
# (the test runner's may sit under /root). Any interpreter does: commands use only the
# standard library.
COMMAND_PY = (sys.executable if runnable_by_all(sys.executable)
              else shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
              or sys.executable)


def running(argv: list[str]) -> list:
    """The processes on this machine whose command line is exactly ``argv`` (a test gives
    its command an argument of its own, e.g. ``sleep 61.234``, to find only its own)."""
    import psutil

    return [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == argv]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dispatcher_config(**kw) -> DispatcherConfig:
    """Dispatcher settings for a test: ``elastic_greedy``, sampled every 0.05 s, unless
    given."""
    kw.setdefault("scheduler", "elastic_greedy")
    kw.setdefault("sample_interval_s", 0.05)
    return DispatcherConfig(**kw)


def cpu(*argv: str, **kw) -> dict:
    """A cpu request running ``argv`` (timeout 30 s unless given)."""
    return {"kind": "cpu", "argv": list(argv), "timeout_s": kw.pop("timeout_s", 30), **kw}
