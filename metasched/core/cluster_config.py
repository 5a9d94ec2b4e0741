"""The cluster schema: CPU nodes, GPU devices and API endpoint quotas, validated.

A cluster arrives as a plain dict (from Hydra/OmegaConf or YAML); ``parse_cluster`` turns
it into a frozen :class:`ClusterConfig` or raises :class:`ConfigError` with a one-line
message naming the field. The scheduling state (:mod:`metasched.core.state`) reads it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from statistics import NormalDist
from typing import Annotated, Any

from pydantic import BeforeValidator, model_validator

from metasched.core.pools import EndpointSpec
from metasched.core.schema import Count, Number, Strict, parse
from metasched.errors import ConfigError


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """Resources: CPU nodes, GPU devices, API endpoint quotas.

    ``cpu_launch_s`` is the start-up of a cpu action's command (process creation and
    exec, seconds): the simulator adds it to every cpu action's run, on its granted
    cores; 0 where the profile's durations already include it. With
    ``cpu_launch_sigma`` > 0 it is the median of a log-normal start-up drawn per action
    (``cluster.cpu.launch_p90_s`` gives its 90th percentile).
    """

    name: str
    cpu_nodes: int
    cores_per_node: int
    mem_gb_per_node: float
    gpu_devices: int
    gpu_mem_gb: float
    endpoints: dict[str, EndpointSpec]
    cpu_launch_s: float = 0.0
    cpu_launch_sigma: float = 0.0

    def scaled(self, factor: float, pools: tuple[str, ...] = ("cpu", "gpu")) -> ClusterConfig:
        """The cluster with the named pools scaled by ``factor`` (at least one unit each
        where the original had any). CPU scales cores per node (sandbox memory is
        kept: a sandbox's state is needed whoever schedules it); GPU scales the device
        count; API scales RPM/TPM and concurrency."""
        from dataclasses import replace

        c = self
        if "cpu" in pools:
            if self.cores_per_node:
                c = replace(c, cores_per_node=max(1, round(self.cores_per_node * factor)))
        if "gpu" in pools and self.gpu_devices:
            c = replace(c, gpu_devices=max(1, round(self.gpu_devices * factor)))
        if "api" in pools:
            c = replace(c, endpoints={
                n: replace(e, rpm=e.rpm * factor, tpm=None if e.tpm is None else e.tpm * factor,
                           max_concurrency=max(1, round(e.max_concurrency * factor)))
                for n, e in self.endpoints.items()})
        return c

    def resources(self) -> dict[str, float]:
        """Resource totals: cores, GPUs, API concurrency slots."""
        return {"cpu": self.cpu_nodes * self.cores_per_node, "gpu": self.gpu_devices,
                "api": sum(e.max_concurrency for e in self.endpoints.values())}


class _Endpoint(Strict):
    """One API endpoint's quota (:class:`~metasched.core.pools.EndpointSpec`)."""

    rpm: Number(gt=0.0)
    max_concurrency: Count(1)
    tpm: Number(gt=0.0) | None = None
    window_s: Number(gt=0.0, le=86400.0) = 60.0

    @model_validator(mode="before")
    @classmethod
    def _no_burst(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and "burst_s" in data:  # the token bucket this replaced
            raise ConfigError("burst_s", "quotas are counted over a sliding window: set "
                              "window_s (seconds; 60 by default) instead")
        return data

    def spec(self) -> EndpointSpec:
        return EndpointSpec(rpm=self.rpm, max_concurrency=self.max_concurrency, tpm=self.tpm,
                            window_s=self.window_s)


# The keys of one API endpoint's quota (EndpointSpec).
ENDPOINT_KEYS = frozenset(_Endpoint.model_fields)

_Endpoints = dict[str, _Endpoint] | None


def parse_endpoints(d: Any, path: str) -> dict[str, EndpointSpec]:
    """Validate a mapping of API endpoint name -> ``{rpm, tpm, max_concurrency, window_s}``."""
    return {str(k): e.spec() for k, e in (parse(_Endpoints, d, path) or {}).items()}


class _Cpu(Strict):
    nodes: Count(0) = 0
    cores_per_node: Count(0) = 0
    mem_gb_per_node: Number(ge=0.0) = 0.0
    launch_s: Number(ge=0.0) = 0.0
    launch_p90_s: Number(ge=0.0) | None = None

    @model_validator(mode="after")
    def _p90(self) -> _Cpu:
        if self.launch_p90_s is not None and self.launch_p90_s < self.launch_s:
            raise ConfigError("launch_p90_s", f"must be >= {self.launch_s:g} (launch_s; got "
                              f"{self.launch_p90_s:g})")
        return self


class _Gpu(Strict):
    devices: Count(0) = 0
    mem_gb: Number(ge=0.0) = 0.0


class _Api(Strict):
    endpoints: _Endpoints = None


class _Cluster(Strict):
    """A cluster as ``configs/cluster/*.yaml`` gives it (:class:`ClusterConfig`)."""

    name: Annotated[str, BeforeValidator(str)] = "cluster"
    scale: Number(gt=0.0) = 1.0
    cpu: _Cpu | None = None
    gpu: _Gpu | None = None
    api: _Api | None = None

    def config(self) -> ClusterConfig:
        cpu, gpu, api = self.cpu or _Cpu(), self.gpu or _Gpu(), self.api or _Api()
        c = ClusterConfig(
            name=self.name, cpu_nodes=cpu.nodes, cores_per_node=cpu.cores_per_node,
            mem_gb_per_node=cpu.mem_gb_per_node, gpu_devices=gpu.devices,
            gpu_mem_gb=gpu.mem_gb,
            endpoints={str(k): e.spec() for k, e in (api.endpoints or {}).items()},
            cpu_launch_s=cpu.launch_s,
            cpu_launch_sigma=(0.0 if cpu.launch_p90_s is None
                              else launch_sigma(cpu.launch_s, cpu.launch_p90_s)))
        # One knob for a contended regime: every pool scaled as metasched-plan scales them.
        return c if self.scale == 1.0 else c.scaled(self.scale, ("cpu", "gpu", "api"))


def parse_cluster(d: Mapping, path: str = "cluster") -> ClusterConfig:
    """Validate a cluster dict (see ``configs/cluster/*.yaml``).

    ``scale`` (default 1) multiplies every pool (:meth:`ClusterConfig.scaled` over cpu,
    gpu and api: cores per node, GPU devices, API RPM/TPM and concurrency) after the rest
    is read, so ``cluster.scale=0.25`` is the profile's cluster at a quarter of its size.
    """
    return parse(_Cluster, d, path).config()


def launch_sigma(median_s: float, p90_s: float) -> float:
    """The log-normal sigma of a start-up with this median and 90th percentile."""
    if not median_s > 0.0 or p90_s <= median_s:
        return 0.0
    return math.log(p90_s / median_s) / NormalDist().inv_cdf(0.9)
