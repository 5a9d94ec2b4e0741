"""Utilisation and memory sampling of the live dispatcher's GPUs, read from NVML."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from metasched.runtime.gpu.devices import GIB, LiveDevice, _nvml_acquire, _nvml_release

if TYPE_CHECKING:
    from metasched.runtime.gpu.services import ServiceHost

log = logging.getLogger("metasched.runtime.gpu")  # the package's one logger


class GpuSampler:
    """Utilisation (0..1) and memory used (GiB) of each device, read from NVML.

    A stand-in reports utilisation 0.0 and the host-side size of the modules ``host``
    has resident on it (0 without a host). A GPU that NVML fails to read reports
    ``(nan, nan)`` for that sample. Holds NVML initialised from construction to
    :meth:`close` (shared with other users: the last one to close shuts it down);
    usable as a context manager.
    """

    def __init__(self, devices: list[LiveDevice], host: ServiceHost | None = None) -> None:
        self.devices = list(devices)
        self.host = host
        self._nv: Any = None
        self._handles: dict[int, Any] = {}
        if any(not d.standin for d in self.devices):
            self._nv = _nvml_acquire()
            try:
                for d in self.devices:
                    if not d.standin:
                        self._handles[d.index] = self._nv.nvmlDeviceGetHandleByIndex(
                            d.nvml_index)
            except BaseException:
                self.close()
                raise

    def sample(self) -> list[tuple[float, float]]:
        """``(utilisation, mem_used_gb)`` per device, in ``devices`` order."""
        if self._nv is None and self._handles:
            raise RuntimeError("GpuSampler is closed")
        out = []
        for d in self.devices:
            if d.standin:
                used = self.host.mem_used_gb(d) if self.host is not None else 0.0
                out.append((0.0, used))
                continue
            h = self._handles[d.index]
            try:
                util = self._nv.nvmlDeviceGetUtilizationRates(h).gpu / 100.0
                used = self._nv.nvmlDeviceGetMemoryInfo(h).used / GIB
            except Exception as e:  # one bad read must not stop a monitor
                log.debug("NVML read of device %d failed: %s", d.index, e)
                util = used = float("nan")
            out.append((float(util), float(used)))
        return out

    def close(self) -> None:
        """Release NVML (once; later calls do nothing)."""
        if self._nv is not None:
            self._nv = None
            _nvml_release()

    def __enter__(self) -> GpuSampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
