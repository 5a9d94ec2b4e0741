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
from typing import Any

from metasched.core.pools import EndpointSpec
from metasched.core.validate import bounded, check_keys, get_key, mapping_or_empty
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


# The keys of one API endpoint's quota (EndpointSpec).
ENDPOINT_KEYS = frozenset({"rpm", "tpm", "max_concurrency", "window_s"})


def parse_endpoints(d: Any, path: str) -> dict[str, EndpointSpec]:
    """Validate a mapping of API endpoint name -> ``{rpm, tpm, max_concurrency, window_s}``."""
    endpoints = {}
    for ename, e in mapping_or_empty(d, path).items():
        ep = f"{path}.{ename}"
        if not isinstance(e, Mapping):
            raise ConfigError(ep, f"must be a mapping (got {e!r})")
        if "burst_s" in e:  # the token bucket this replaced
            raise ConfigError(f"{ep}.burst_s", "quotas are counted over a sliding window: "
                              "set window_s (seconds; 60 by default) instead")
        check_keys(e, ENDPOINT_KEYS, ep)
        tpm = e.get("tpm")
        endpoints[str(ename)] = EndpointSpec(
            rpm=bounded(get_key(e, "rpm", ep), f"{ep}.rpm", lo=0.0, lo_open=True),
            max_concurrency=bounded(get_key(e, "max_concurrency", ep), f"{ep}.max_concurrency",
                                    lo=1, integer=True),
            tpm=None if tpm is None else bounded(tpm, f"{ep}.tpm", lo=0.0, lo_open=True),
            window_s=bounded(e.get("window_s", 60.0), f"{ep}.window_s", lo=0.0, lo_open=True,
                             hi=86400.0))
    return endpoints


def parse_cluster(d: Mapping, path: str = "cluster") -> ClusterConfig:
    """Validate a cluster dict (see ``configs/cluster/*.yaml``).

    ``scale`` (default 1) multiplies every pool (:meth:`ClusterConfig.scaled` over cpu,
    gpu and api: cores per node, GPU devices, API RPM/TPM and concurrency) after the rest
    is read, so ``cluster.scale=0.25`` is the profile's cluster at a quarter of its size.
    """
    if not isinstance(d, Mapping):
        raise ConfigError(path, f"must be a mapping (got {type(d).__name__})")
    check_keys(d, {"name", "scale", "cpu", "gpu", "api"}, path)
    cpu = mapping_or_empty(d.get("cpu"), f"{path}.cpu")
    gpu = mapping_or_empty(d.get("gpu"), f"{path}.gpu")
    api = mapping_or_empty(d.get("api"), f"{path}.api")
    for sub, keys in (("cpu", {"nodes", "cores_per_node", "mem_gb_per_node", "launch_s",
                               "launch_p90_s"}),
                      ("gpu", {"devices", "mem_gb"}), ("api", {"endpoints"})):
        check_keys(locals()[sub], keys, f"{path}.{sub}")
    endpoints = parse_endpoints(api.get("endpoints"), f"{path}.api.endpoints")
    launch = bounded(cpu.get("launch_s", 0.0), f"{path}.cpu.launch_s", lo=0.0)
    p90 = cpu.get("launch_p90_s")
    sigma = 0.0
    if p90 is not None:
        p90 = bounded(p90, f"{path}.cpu.launch_p90_s", lo=launch)
        sigma = launch_sigma(launch, p90)
    scale = bounded(d.get("scale", 1.0), f"{path}.scale", lo=0.0, lo_open=True)
    c = ClusterConfig(
        name=str(d.get("name", "cluster")),
        cpu_nodes=bounded(cpu.get("nodes", 0), f"{path}.cpu.nodes", lo=0, integer=True),
        cores_per_node=bounded(cpu.get("cores_per_node", 0), f"{path}.cpu.cores_per_node", lo=0,
                               integer=True),
        mem_gb_per_node=bounded(cpu.get("mem_gb_per_node", 0.0), f"{path}.cpu.mem_gb_per_node",
                                lo=0.0),
        gpu_devices=bounded(gpu.get("devices", 0), f"{path}.gpu.devices", lo=0, integer=True),
        gpu_mem_gb=bounded(gpu.get("mem_gb", 0.0), f"{path}.gpu.mem_gb", lo=0.0),
        endpoints=endpoints, cpu_launch_s=launch, cpu_launch_sigma=sigma)
    # One knob for a contended regime: every pool scaled as metasched-plan scales them.
    return c if scale == 1.0 else c.scaled(scale, ("cpu", "gpu", "api"))


def launch_sigma(median_s: float, p90_s: float) -> float:
    """The log-normal sigma of a start-up with this median and 90th percentile."""
    if not median_s > 0.0 or p90_s <= median_s:
        return 0.0
    return math.log(p90_s / median_s) / NormalDist().inv_cdf(0.9)
