"""The local machine as the dispatcher sees it: the cores it may use, its memory, and
measured utilisation (per-core CPU from psutil, GPUs from NVML).

The scheduling core counts *granted* resources, exactly as in simulation, so the policy
sees the same features live as it was trained on. The measured readings are used where
they add something the core does not know: which core ids to pin an action to (the
least loaded ones: other tenants of the machine show up here) and the measured
utilisation reported beside the granted one.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence

import psutil

from metasched.errors import ConfigError


def usable_cores() -> list[int]:
    """The CPU ids this process may run on (its affinity mask), sorted."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def default_workdir() -> str | None:
    """``/dev/shm`` when it is a writable directory (tmpfs: scratch directories there
    are cheap to make and remove), else None (the system temporary directory)."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else None


def check_workdir(path: str | os.PathLike[str]) -> str:
    """``path`` if commands' scratch directories can be made there (one is made and
    removed to be sure: a read-only mount passes a permission check), else a one-line
    :class:`ConfigError` naming ``workdir``."""
    path = os.fspath(path)
    try:
        os.rmdir(tempfile.mkdtemp(prefix="metasched-check-", dir=path))
    except OSError as e:
        why = e.strerror or str(e)
        if isinstance(e, FileNotFoundError) and not os.path.exists(path):
            why = "no such directory"
        raise ConfigError("workdir", f"{path}: cannot make scratch directories there "
                          f"({why})") from None
    return path


def memory_gb() -> float:
    """Total memory of the machine, GB."""
    return psutil.virtual_memory().total / 1e9


class MachineMonitor:
    """Samples per-core CPU utilisation of ``cores`` (and GPU readings from a sampler
    with a ``sample()`` method, e.g. :class:`~metasched.runtime.gpu.GpuSampler`) and
    keeps their running means.

    ``sample()`` is cheap (one /proc read); the dispatcher calls it every
    ``interval_s`` seconds.
    """

    def __init__(self, cores: Sequence[int], gpu_sampler=None) -> None:
        self.cores = list(cores)
        self.gpu_sampler = gpu_sampler
        self.last_cpu: list[float] = [0.0] * len(self.cores)  # 0..1 per core, latest
        self.last_gpu: list[tuple[float, float]] = []  # (utilisation 0..1, memory GB)
        self._cpu_sum = 0.0
        self._gpu_sum: list[float] = []
        self.n = 0
        psutil.cpu_percent(percpu=True)  # starts psutil's interval

    def sample(self) -> None:
        per = psutil.cpu_percent(percpu=True)
        self.last_cpu = [per[c] / 100.0 if c < len(per) else 0.0 for c in self.cores]
        self._cpu_sum += sum(self.last_cpu) / max(1, len(self.cores))
        if self.gpu_sampler is not None:
            self.last_gpu = list(self.gpu_sampler.sample())
            if not self._gpu_sum:
                self._gpu_sum = [0.0] * len(self.last_gpu)
            for i, (util, _) in enumerate(self.last_gpu):
                self._gpu_sum[i] += util
        self.n += 1

    def least_loaded(self, free: Sequence[int], k: int) -> list[int]:
        """``k`` of the ``free`` core ids, least loaded by the latest sample first."""
        load = dict(zip(self.cores, self.last_cpu, strict=True))
        return sorted(free, key=lambda c: (load.get(c, 0.0), c))[:k]

    def summary(self) -> dict[str, float]:
        """Mean measured utilisation since the start: ``cpu`` (over the cores) and
        ``gpu`` (over the devices; absent without GPUs)."""
        out = {"cpu": self._cpu_sum / self.n if self.n else 0.0}
        if self._gpu_sum:
            out["gpu"] = sum(self._gpu_sum) / (self.n * len(self._gpu_sum))
        return out


__all__ = ["MachineMonitor", "check_workdir", "default_workdir", "memory_gb", "usable_cores"]
