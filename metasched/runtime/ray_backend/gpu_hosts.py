"""GPU services on a Ray cluster: one actor per GPU (``num_gpus=1``), holding that
device's resident services, and the dispatcher's side of them.

Each :class:`GpuHostActor` is a :class:`metasched.runtime.gpu.ServiceHost` of one
device, on whichever node Ray gave it a GPU: Ray sets its ``CUDA_VISIBLE_DEVICES`` to
that GPU, which NVML then describes. The scheduler's residency model (which services
are resident where, LRU eviction, restore costs) stays in the dispatcher, as on one
machine; :class:`RayGpuHost` hands each batch to its device's actor with the model's
residency, and the actor's host makes the hardware follow it.

A GPU that Ray declares but NVML cannot see (a logical ``num_gpus`` on a machine
without one, as in tests) is served by a CPU stand-in of ``standin_mem_gb``; the
actor's description says so.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Collection, Mapping
from typing import Any

import ray

from metasched.core.pools import ServiceSpec
from metasched.errors import ConfigError
from metasched.runtime.gpu import (
    LiveDevice,
    LiveService,
    ServiceHost,
    discover_devices,
)
from metasched.runtime.outcome import Outcome

PLACE_TIMEOUT_S = 60.0  # how long the GPU actors may take to be placed and start


@ray.remote(num_cpus=0, num_gpus=1, max_restarts=-1)
class GpuHostActor:
    """The services of the one GPU Ray gave this actor."""

    def __init__(self, services: Mapping[str, LiveService], standin_mem_gb: float) -> None:
        devices, why = discover_devices(standin=1, standin_mem_gb=standin_mem_gb)
        self.device = devices[0]
        self.why = why
        self.host = ServiceHost([self.device])
        for name, svc in services.items():
            self.host.register(name, svc)

    def describe(self) -> dict[str, Any]:
        d = self.device
        return {"node_id": ray.get_runtime_context().get_node_id(), "name": d.name,
                "mem_gb": d.mem_gb, "nvml_index": d.nvml_index, "visible_id": d.visible_id,
                "standin_reason": self.why}

    async def run_batch(self, service: str, resident_now: list[str], payloads: list[Any]
                        ) -> Outcome:
        return await self.host.run_batch(service, self.device, resident_now, payloads)

    def pid(self) -> int:
        return os.getpid()


class RayGpuHost:
    """The dispatcher's side of the GPU actors: the :class:`~metasched.runtime.backend.GpuHost`
    of a Ray backend. ``devices[i]`` is served by ``actors[i]``."""

    def __init__(self, actors: list[Any], devices: list[LiveDevice],
                 services: Mapping[str, LiveService], node_ids: list[str] | None = None,
                 standin_reason: str = "") -> None:
        self.actors = actors
        self.devices = devices
        self.node_ids = node_ids or []  # the node of each device
        self.standin_reason = standin_reason  # why some devices are CPU stand-ins
        self._specs = {name: svc.spec for name, svc in services.items()}

    @classmethod
    async def start(cls, n_gpus: int, services: Mapping[str, LiveService],
                    standin_mem_gb: float, *, timeout_s: float = PLACE_TIMEOUT_S
                    ) -> RayGpuHost:
        """One actor per GPU of the cluster (``n_gpus``), placed by Ray.

        Raises:
            ConfigError: the actors could not all be placed within ``timeout_s`` (other
                work holds the cluster's GPUs).
        """
        actors = [GpuHostActor.remote(dict(services), standin_mem_gb) for _ in range(n_gpus)]
        try:
            facts = await asyncio.wait_for(
                asyncio.gather(*(a.describe.remote() for a in actors)), timeout_s)
        except asyncio.TimeoutError:
            for a in actors:
                ray.kill(a)
            raise ConfigError("gpu", f"the cluster has {n_gpus} GPUs, but not all of them "
                              f"could be given to the dispatcher within {timeout_s:g} s "
                              f"(other work holds them?)") from None
        devices = [LiveDevice(i, f["name"], float(f["mem_gb"]), "remote", f["nvml_index"],
                              f["visible_id"]) for i, f in enumerate(facts)]
        why = next((f["standin_reason"] for f in facts if f["standin_reason"]), "")
        return cls(actors, devices, services, [f["node_id"] for f in facts], why)

    @property
    def specs(self) -> dict[str, ServiceSpec]:
        return dict(self._specs)

    async def run_batch(self, service: str, device: LiveDevice, resident_now: Collection[str],
                        payloads: list[Any]) -> Outcome:
        if service not in self._specs:
            names = ", ".join(sorted(self._specs)) or "none"
            return Outcome(ok=False, reason=f"unknown service {service!r} (registered: {names})")
        return await self.actors[device.index].run_batch.remote(
            service, sorted(resident_now), payloads)

    def close(self) -> None:
        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.actors = []


__all__ = ["GpuHostActor", "RayGpuHost"]
