"""Stand-in nodes for measuring the control plane alone: a
:class:`~metasched.runtime.backend.Backend` whose nodes exist only in the dispatcher's
books and whose commands end (exit 0, nothing run) at once or after a set time, with
stand-in GPUs whose services' batches end so too (a result of None per request). A
shard on it pays every cost of an action but the work: the request's trip, the
journal, the queue, the decision, the grant, the completion, the result's trip."""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Mapping
from typing import Any

from metasched.core.pools import ServiceSpec
from metasched.runtime.backend import CommandSpec, Node
from metasched.runtime.dispatch.executors.nodes import NodeExecutors
from metasched.runtime.gpu import LiveDevice
from metasched.runtime.journal import Journal
from metasched.runtime.outcome import Outcome
from metasched.runtime.ray_backend.cluster import RemoteSandbox, RemoteSandboxes
from metasched.runtime.sandbox.config import SandboxConfig

__all__ = ["StandinBackend"]


class _DoneCommand:
    """A command that ends (exit 0) after ``seconds`` of doing nothing."""

    __slots__ = ("cores", "seconds")

    def __init__(self, cores: list[int], seconds: float) -> None:
        self.cores = cores
        self.seconds = seconds

    async def wait(self) -> Outcome:
        if self.seconds > 0:
            await asyncio.sleep(self.seconds)
        return Outcome(ok=True, exit_code=0, detail={"cores": self.cores})

    def abandon(self) -> None:
        """Nothing runs."""


class _StandinGpus:
    """Stand-in GPU services: a batch ends after ``seconds`` of nothing."""

    def __init__(self, specs: dict[str, ServiceSpec], seconds: float) -> None:
        self.specs = specs
        self.seconds = seconds

    async def run_batch(self, service: str, device: LiveDevice, resident_now: Collection[str],
                        payloads: list[Any]) -> Outcome:
        if service not in self.specs:
            return Outcome(ok=False, reason=f"unknown service {service!r}")
        if self.seconds > 0:
            await asyncio.sleep(self.seconds)
        return Outcome(ok=True, value=[None] * len(payloads), detail={"batch": len(payloads)})


class StandinBackend:
    """``nodes`` stand-in nodes of ``cores`` cores each, named after ``owner``, whose
    commands take ``seconds`` (of nothing) each; ``gpus`` stand-in devices of
    ``gpu_mem_gb`` serving ``services`` (name: :class:`ServiceSpec` fields), a batch
    taking ``seconds`` too (see the module docstring)."""

    name = "standin"
    AHEAD_PER_CORE = 0  # a command ends as it starts: nothing to hand ahead
    EXECUTORS = NodeExecutors
    cores: tuple[int, ...] = ()
    no_gpu_reason = "no GPU: stand-in nodes"

    def __init__(self, owner: str, nodes: int = 1, cores: int = 64,
                 mem_gb: float = 256.0, seconds: float = 0.0, gpus: int = 0,
                 gpu_mem_gb: float = 80.0,
                 services: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self.seconds = seconds
        self.nodes = [Node(f"{owner}-standin-{i}", tuple(range(cores)), mem_gb)
                      for i in range(nodes)]
        self.devices = [LiveDevice(i, f"standin-{i}", gpu_mem_gb, "cpu", None, "")
                        for i in range(gpus)]
        self.host = _StandinGpus({name: ServiceSpec(**spec)
                                  for name, spec in (services or {}).items()}, seconds)

    async def start_sandboxes(self, config: SandboxConfig, hide: list[str]) -> RemoteSandboxes:
        fact = {"isolated": False, "warnings": [], "sandboxes": "stand-ins (nothing runs)"}
        return RemoteSandboxes(self, [fact] * len(self.nodes), config)  # type: ignore[arg-type]

    def start_command(self, node: int, n_cores: int, spec: CommandSpec,
                      sandbox: RemoteSandbox | None = None) -> _DoneCommand:
        return _DoneCommand(list(range(n_cores)), self.seconds)

    def close_trajectory(self, key: str) -> None:
        """Nothing: a stand-in sandbox is only the dispatcher's record of it."""

    def device_node(self, device: int) -> int:
        return -1

    async def kill_orphans(self, journal: Journal) -> None:
        """Nothing runs, so nothing is left running."""

    def sample(self) -> None:
        """Nothing to measure."""

    def measured_utilisation(self) -> dict[str, float]:
        return {}

    async def close(self) -> None:
        await asyncio.sleep(0)
