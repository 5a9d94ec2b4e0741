"""The GPU side of the live dispatcher, one module per concern:

- :mod:`~metasched.runtime.gpu.devices`: devices (:class:`LiveDevice`), a command's GPU
  environment, NVML shared by its users, discovery and a GPU's device node;
- :mod:`~metasched.runtime.gpu.sampler`: utilisation and memory sampling (:class:`GpuSampler`);
- :mod:`~metasched.runtime.gpu.services`: GPU services (:class:`LiveService`) and the host
  (:class:`ServiceHost`) whose real residency follows the scheduler's model;
- :mod:`~metasched.runtime.gpu.scorer`: an example service (:func:`linear_scorer`).

Nothing here needs a GPU: without NVML, :func:`discover_devices` says why there is no GPU
and, when asked, returns CPU stand-in devices that behave like GPUs for the host (tests,
dry runs). torch is imported only when a torch service is loaded or placed.
"""

from metasched.runtime.gpu.devices import (
    GIB,
    LiveDevice,
    command_env,
    device_minor,
    discover_devices,
)
from metasched.runtime.gpu.sampler import GpuSampler
from metasched.runtime.gpu.scorer import linear_scorer
from metasched.runtime.gpu.services import GpuHost, LiveService, ServiceHost

__all__ = [
    "GIB", "GpuHost", "GpuSampler", "LiveDevice", "LiveService", "ServiceHost", "command_env",
    "device_minor", "discover_devices", "linear_scorer",
]
