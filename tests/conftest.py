"""Shared fixtures: tiny workloads and clusters built from plain dicts, sandboxes, the
local Ray, and the Hypothesis profile (no deadline: the machine running the suite is
shared). The markers of pyproject.toml: a test that uses the local Ray is marked ``ray``
here, one that uses ``sandboxes`` ``isolation``; an ``isolation`` test is skipped, with the
reason, where bwrap sandboxes cannot run (``isolation(bwrap=False)``: it needs root and
cgroups only, and says so itself)."""

from __future__ import annotations

import os
import sys

# numpy picks its exp/log kernels by CPU: the AVX-512 ones round some results differently
# in the last bit from the AVX2 ones, which the stored simulator digests
# (tests/data/sim_digests.json) and other exact figures were made with. The suite runs on
# the AVX2 kernels wherever it runs; the variable is read once, when numpy is imported.
os.environ.setdefault("NPY_DISABLE_CPU_FEATURES", "X86_V4 AVX512_ICL AVX512_SPR")
if "numpy" in sys.modules:  # too late for the setting: say so rather than fail obscurely
    sys.stderr.write("conftest: numpy was imported before the suite set "
                     "NPY_DISABLE_CPU_FEATURES; exact digests may differ on AVX-512 CPUs\n")

import copy  # noqa: E402

import pytest  # noqa: E402
from helpers import HAS_TRAIN_EXTRA  # noqa: E402
from hypothesis import settings  # noqa: E402
from sandbox_helpers import needs_isolation  # noqa: E402

from metasched.core.cluster_config import parse_cluster  # noqa: E402
from metasched.runtime.sandbox.config import SandboxConfig  # noqa: E402
from metasched.runtime.sandbox.manager import Sandboxes  # noqa: E402
from metasched.sim.workload_config import parse_workload  # noqa: E402

settings.register_profile("metasched", deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "metasched"))

# Modules that are about training or the SB3 policy through and through; the base install
# (no `train` extra) runs everything else, and the header of the run says what it left out.
TRAIN_ONLY = ["test_imitation.py", "test_policy.py", "test_training.py"]
collect_ignore = [] if HAS_TRAIN_EXTRA else TRAIN_ONLY


def pytest_report_header(config) -> str | None:
    if not HAS_TRAIN_EXTRA:
        return f"train extra not installed: {', '.join(TRAIN_ONLY)} not collected"
    return None


# Fixtures whose tests take the marker (before -m selects).
MARKED_BY_FIXTURE = {"ray_session": "ray", "sandboxes": "isolation"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for fixture, marker in MARKED_BY_FIXTURE.items():
            if fixture in getattr(item, "fixturenames", ()):
                item.add_marker(marker)


def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = item.get_closest_marker("isolation")
    if marker is not None and marker.kwargs.get("bwrap", True):
        needs_isolation()


# One GPU service, one API endpoint: enough for every action kind.
SERVICES = {"rm": {"mem_gb": 30, "restore_s": 4.0, "max_batch": 8, "batch_marginal": 0.05}}


def _workload_dict(reward: dict, *, actions: dict | None = None, turns=0, trajectories: int = 1,
                  steps: int = 1, generation_s=1.0, sandbox: dict | None = None,
                  services: dict | None = None, estimate_error: float = 0.0) -> dict:
    """A one-task workload dict (task ``t``) with constant shapes by default."""
    return {
        "name": "tiny", "steps": steps, "trajectories_per_step": trajectories,
        "estimate_error": estimate_error,
        "services": copy.deepcopy(SERVICES if services is None else services),
        "tasks": {"t": {"turns": turns, "generation_s": generation_s, "sandbox": sandbox,
                        "actions": copy.deepcopy(actions or {}),
                        "reward": copy.deepcopy(reward)}},
    }


def _cluster_dict(*, nodes: int = 1, cores: int = 4, mem_gb: float = 64.0, gpus: int = 1,
                 gpu_mem_gb: float = 80.0, endpoints: dict | None = None) -> dict:
    """A cluster dict; by default one 4-core node, one 80 GB GPU, endpoint ``e``."""
    if endpoints is None:
        endpoints = {"e": {"rpm": 600, "tpm": 60000, "max_concurrency": 4, "window_s": 1.0}}
    return {"name": "tiny",
            "cpu": {"nodes": nodes, "cores_per_node": cores, "mem_gb_per_node": mem_gb},
            "gpu": {"devices": gpus, "mem_gb": gpu_mem_gb},
            "api": {"endpoints": copy.deepcopy(endpoints)}}


@pytest.fixture
def make_workload():
    """Factory: ``make_workload(reward_dict, **kw)`` -> validated WorkloadConfig."""
    def make(reward: dict, **kw):
        return parse_workload(_workload_dict(reward, **kw))
    return make


@pytest.fixture
def make_cluster():
    """Factory: ``make_cluster(**kw)`` -> validated ClusterConfig."""
    def make(**kw):
        return parse_cluster(_cluster_dict(**kw))
    return make


@pytest.fixture
def valid_config() -> tuple[dict, dict]:
    """A valid (workload, cluster) dict pair using every kind of action, for tests that
    break one field at a time. Task ``code`` (cpu, sandbox), ``rm`` (gpu reward),
    ``search`` (api)."""
    workload = {
        "name": "valid", "steps": 2, "trajectories_per_step": 4, "estimate_error": 0.5,
        "services": {"rm7b": {"mem_gb": 15, "restore_s": 4, "max_batch": 8,
                              "batch_marginal": 0.05}},
        "tasks": {
            "code": {
                "share": 0.5,
                "turns": {"median": 3, "p90": 6, "min": 1, "max": 10},
                "generation_s": {"median": 2.0, "p99": 20, "max": 60},
                "sandbox": {"mem_gb": 4, "startup_s": 5},
                "actions": {
                    "shell": {"kind": "cpu", "prob": 0.7,
                              "duration_s": {"median": 0.3, "p99": 5}, "timeout_s": 60},
                    "tests": {"kind": "cpu", "prob": 0.3, "duration_s": {"median": 2, "p90": 10},
                              "cores": [1, 8], "parallel_fraction": 0.8, "timeout_s": 60},
                },
                "reward": {"kind": "cpu", "duration_s": 10, "cores": [2, 8],
                           "parallel_fraction": 0.9, "timeout_s": 300},
            },
            "rm": {
                "share": 0.25, "turns": 0, "generation_s": 5, "sandbox": None, "actions": {},
                "reward": {"kind": "gpu", "service": "rm7b", "duration_s": 0.2, "timeout_s": 60},
            },
            "search": {
                "share": 0.25, "turns": {"median": 2, "min": 1, "max": 3}, "generation_s": 2,
                "sandbox": None,
                "actions": {"web": {"kind": "api", "prob": 1.0, "endpoint": "web",
                                    "duration_s": 1.0, "timeout_s": 30}},
                "reward": {"kind": "api", "endpoint": "judge", "duration_s": 3.0,
                           "timeout_s": 300,
                           "tokens": {"median": 2000, "p99": 6000, "max": 8000}},
            },
        },
    }
    cluster = {
        "name": "valid",
        "cpu": {"nodes": 2, "cores_per_node": 16, "mem_gb_per_node": 64},
        "gpu": {"devices": 1, "mem_gb": 80},
        "api": {"endpoints": {
            "web": {"rpm": 600, "max_concurrency": 16},
            "judge": {"rpm": 500, "tpm": 600000, "max_concurrency": 16, "window_s": 1.0},
        }},
    }
    return workload, cluster


@pytest.fixture
def one_torch_thread():
    """Policy inference on one thread (the machine is shared; more threads only thrash).
    Without torch (the base install) there is nothing to set."""
    try:
        import torch
    except ImportError:
        yield
        return

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def visible_dir():
    """A directory that sandboxed commands can read (they run as other users, with a
    /tmp of their own, so the test's tmp_path is out of their sight): for gate files."""
    import shutil
    import tempfile
    from pathlib import Path

    path = Path(tempfile.mkdtemp(prefix="metasched-test-", dir="/var/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def sandbox_dev_root() -> str | None:
    """Where ``sandboxes`` finds device nodes (None: /dev); a module may override it."""
    return None


@pytest.fixture
def sandboxes(sandbox_dev_root):
    """Real bwrap sandboxes (``Sandboxes``), closed after the test."""
    b = Sandboxes(SandboxConfig(isolation="bwrap"), dev_root=sandbox_dev_root)
    yield b
    b.close()


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the test session (Ray takes seconds to start): one node bound to
    127.0.0.1 with 2 CPUs and one logical GPU (a CPU stand-in serves it). A module that
    starts dispatcher actors stops them before it ends: a dispatcher takes the cluster's
    GPU. Skipped without the ``ray`` extra."""
    # With clusters off, every server Ray starts listens on 127.0.0.1 only (read when ray
    # is imported).
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray = pytest.importorskip("ray", reason="needs the ray extra (pip install 'metasched[ray]')")
    # address="local": a Ray of its own, even where another one on the machine is the
    # default to join (``ray start`` records it for ``ray.init()``).
    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
             num_cpus=2, num_gpus=1, log_to_driver=False, logging_level="ERROR")
    try:
        (node,) = ray.nodes()
        assert node["NodeManagerAddress"] == "127.0.0.1", node["NodeManagerAddress"]
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_cluster(ray_session):
    """The session's local Ray for one module (a module may extend it to stop what it
    started there before the next module runs)."""
    return ray_session
