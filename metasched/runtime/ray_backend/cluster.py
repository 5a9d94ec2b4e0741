"""The Ray cluster as a dispatcher's backend: the cluster view (nodes, cores, GPUs) read
from Ray, and granted commands run as Ray tasks pinned to their node.

The view: every alive node with CPUs is a CPU node of the core's pool. How many cores
the dispatcher may grant there is Ray's ``CPU`` resource of the node (the smallest
node's, since the core's nodes have one size; the log says what that leaves out of a
mixed cluster), which core ids commands are pinned to is what a task on the node may
run on (asked once, by a task pinned to it), its memory is the node's. GPUs are Ray's
``GPU`` resources, each served by an actor (:mod:`.gpu_hosts`).

Each node has the dispatcher's daemon (:mod:`.node_daemon`: the node's sandboxes and
cgroups), which runs every command granted there, in its trajectory's sandbox: a
trajectory's commands run on the node of its sandbox (the core places the sandbox and
pins the trajectory's actions there, as in simulation). How a command reaches the daemon
is ``submit``:

- ``"stream"`` (the default): one direct, authenticated TCP stream per node
  (:mod:`.channel`, :class:`~.commands.NodeLink`) carries the node's commands and their results,
  everything one side has in one turn of its loop in one frame, so no Ray call is made
  per action (each costs the dispatcher and the daemon close to a millisecond of CPU).
  The daemons hold the dispatcher's cores of their node in Ray's accounting
  (``num_cpus``) for as long as the dispatcher runs, busy or not. The dispatcher must
  reach each node's address on the port its daemon's kernel picks, as Ray's own workers
  do; where it cannot, it does not start, and says so;
- ``"daemon"``: as ``"stream"``, with one actor call to the node's daemon per command;
- ``"task"``: a Ray task pinned to the node (``NodeAffinitySchedulingStrategy``, not
  soft) with ``num_cpus`` equal to its granted cores, which asks the node's daemon to run
  it, so Ray's own accounting agrees with the dispatcher's grant by grant and other Ray
  work on the cluster sees the cores as taken only while commands run (the slowest
  way: a task submission and an actor call per action).

Handing ahead: the dispatcher may hand a node commands ahead of its free cores
(``DispatcherConfig.ahead_per_core``, default :attr:`RayBackend.AHEAD_PER_CORE`). Each
command goes to its node's daemon with a count of cores; the daemon gives the node's cores
to its commands in arrival order and starts the next the moment one exits, so no
command waits for a round trip through the dispatcher to start. In ``"task"`` mode the
tasks handed ahead wait in Ray's own queue for their ``num_cpus`` on the node first.

Tasks and calls are not retried by Ray: a command that was lost with its worker or node
is reported failed, with the reason, and the dispatcher's journal decides what runs
again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from metasched.errors import ConfigError
from metasched.runtime.backend import CommandSpec, Node
from metasched.runtime.dispatch.executors.nodes import NodeExecutors
from metasched.runtime.gpu import LiveService
from metasched.runtime.journal import Journal
from metasched.runtime.ray_backend.commands import NodeLink, RemoteCommand, StreamedCommand, lost
from metasched.runtime.ray_backend.gpu_hosts import RayGpuHost
from metasched.runtime.ray_backend.node_daemon import BoxSpec, NodeDaemon, pack, run_on_daemon
from metasched.runtime.ray_backend.node_tasks import (
    DISPATCHER_ENV,
    NodeFacts,
    describe_node,
    kill_orphans,
)
from metasched.runtime.sandbox.config import SandboxConfig
from metasched.runtime.sandbox.workspace import Template

log = logging.getLogger("metasched.dispatch")

DESCRIBE_TIMEOUT_S = 60.0  # how long nodes may take to answer the first look
SUBMIT_MODES = ("task", "daemon", "stream")
DEFAULT_SUBMIT = "stream"  # see the module docstring
DAEMON_CONCURRENCY = 10_000  # commands one node's daemon may run at once (async calls)


_MB = 1 << 20


def check_submit(submit: str) -> str:
    """``submit`` if it names a way of reaching the daemons (ConfigError if not)."""
    if submit not in SUBMIT_MODES:
        raise ConfigError("submit", f"must be one of {', '.join(SUBMIT_MODES)}, got "
                          f"{submit!r}")
    return submit


def _pinned(node_id: str) -> NodeAffinitySchedulingStrategy:
    return NodeAffinitySchedulingStrategy(node_id, soft=False)


def alive_nodes() -> list[dict[str, Any]]:
    """Ray's records of the alive nodes that have CPUs, in node-id order (a stable order
    across dispatchers of one cluster)."""
    nodes = [n for n in ray.nodes() if n.get("Alive") and n["Resources"].get("CPU", 0) >= 1]
    return sorted(nodes, key=lambda n: n["NodeID"])


async def cluster_view(*, cores_per_node: int | None = None,
                       timeout_s: float = DESCRIBE_TIMEOUT_S) -> list[Node]:
    """The CPU nodes of the connected cluster as the dispatcher schedules them.

    Args:
        cores_per_node: grant at most this many cores on each node (default: the
            smallest node's ``CPU``).
        timeout_s: how long the nodes may take to describe themselves.

    Raises:
        ConfigError: no node has a CPU, or ``cores_per_node`` exceeds a node's.
    """
    records = alive_nodes()
    if not records:
        raise ConfigError("cores", "the Ray cluster has no alive node with a CPU")
    ray_cpus = {n["NodeID"]: int(n["Resources"]["CPU"]) for n in records}
    smallest = min(ray_cpus.values())
    if cores_per_node is None:
        cores_per_node = smallest
    elif cores_per_node > smallest:
        raise ConfigError("cores_per_node", f"{cores_per_node} exceeds the smallest node's "
                          f"{smallest} CPUs in Ray")
    left_out = sum(ray_cpus.values()) - cores_per_node * len(ray_cpus)
    if left_out:
        log.warning("Ray nodes of different sizes: the dispatcher grants %d cores on each of "
                    "%d nodes, leaving %d of the cluster's %d CPUs to other work",
                    cores_per_node, len(ray_cpus), left_out, sum(ray_cpus.values()))
    try:
        facts: list[NodeFacts] = await asyncio.wait_for(asyncio.gather(*(
            describe_node.options(scheduling_strategy=_pinned(n)).remote() for n in ray_cpus)),
            timeout_s)
    except asyncio.TimeoutError:
        raise ConfigError("cores", f"the Ray nodes did not describe themselves within "
                          f"{timeout_s:g} s") from None
    nodes = []
    for f in facts:
        if len(f.cores) < cores_per_node:
            raise ConfigError("cores", f"node {f.node_id[:12]} ({f.hostname}) may run on "
                              f"{len(f.cores)} CPUs, fewer than the {cores_per_node} Ray "
                              f"counts there")
        nodes.append(Node(f.node_id, f.cores[:cores_per_node], f.mem_gb))
    return nodes


@dataclass(eq=False)
class RemoteSandbox:
    """A trajectory's sandbox as the dispatcher sees it on a Ray backend: what its first
    command decided (the node's daemon makes it there, at that command). Ready at once:
    a sandbox that cannot be made fails its command with the reason."""

    key: str
    network: bool
    size_bytes: int
    template: Template | None
    ready: asyncio.Future[None]

    def box(self) -> BoxSpec:
        return BoxSpec(self.key, self.network, self.size_bytes / _MB, self.template)


class RemoteSandboxes:
    """The sandboxes of every node, as the dispatcher tracks them (the interface of
    :class:`~metasched.runtime.sandbox.manager.Sandboxes` it uses); each lives in its
    node's daemon."""

    def __init__(self, backend: RayBackend, facts: list[dict[str, Any]],
                 config: SandboxConfig) -> None:
        self.backend = backend
        self.config = config
        self.isolated = all(f["isolated"] for f in facts)
        self.warnings = sorted({w for f in facts for w in f["warnings"]})
        lines = sorted({f["sandboxes"] for f in facts})
        self._line = f"on {len(facts)} Ray nodes: " + " | ".join(lines)
        self._sandboxes: dict[str, RemoteSandbox] = {}
        self._shared: dict[bool, RemoteSandbox] = {}

    def describe(self) -> str:
        return self._line

    def _new(self, key: str, size_mb: float, template: Template | None,
             network: bool) -> RemoteSandbox:
        ready = asyncio.get_running_loop().create_future()
        ready.set_result(None)
        return RemoteSandbox(key, network, int(size_mb * _MB), template, ready)

    def get(self, key: str) -> RemoteSandbox | None:
        return self._sandboxes.get(key)

    def open(self, key: str, *, size_mb: float, template: Template | None,
             network: bool) -> RemoteSandbox:
        sb = self._sandboxes[key] = self._new(key, size_mb, template, network)
        return sb

    def shared(self, network: bool) -> RemoteSandbox:
        sb = self._shared.get(network)
        if sb is None:
            sb = self._shared[network] = self._new("", self.config.scratch_mb, None, network)
        return sb

    def close_trajectory(self, key: str) -> None:
        self._sandboxes.pop(key, None)
        self.backend.close_trajectory(key)

    def close(self) -> None:
        """Nothing here: the daemons end their sandboxes when the backend closes."""


class RayBackend:
    """The Ray cluster as a :class:`~metasched.runtime.backend.Backend` (see the module
    docstring); made by :meth:`create` from the connected cluster.

    Args:
        nodes: the CPU nodes (see :func:`cluster_view`).
        gpus: the GPU actors (None: no GPU).
        dispatcher: the dispatcher's name, carried by every command (the next
            dispatcher on the same journal finds the commands a dead one left by it).
        workdir: where the daemons' run directories go on the nodes (None: ``/dev/shm``
            where writable).
        submit: how a command reaches its node's daemon: ``"task"``, ``"daemon"`` or
            ``"stream"``.
    """

    name = "ray"
    # Commands per core a node holds ahead of its free cores unless the dispatcher's
    # ahead_per_core says otherwise (measured: benchmarks/ray_throughput.py --ahead).
    AHEAD_PER_CORE = 2
    EXECUTORS = NodeExecutors  # each command handed to its node's daemon
    cores: tuple[int, ...] = ()  # the nodes' cores are picked there, not pinned from here

    def __init__(self, nodes: list[Node], gpus: RayGpuHost | None, *, dispatcher: str,
                 workdir: str | None = None, submit: str = DEFAULT_SUBMIT) -> None:
        check_submit(submit)
        self.nodes = nodes
        self.gpus = gpus
        self.devices = list(gpus.devices) if gpus is not None else []
        self.host = gpus if gpus is not None else RayGpuHost([], [], {})
        self.no_gpu_reason = "" if self.devices else "no GPU: the Ray cluster has none"
        self.dispatcher = dispatcher
        self.workdir = workdir
        self.submit = submit
        self.daemons: list[Any] = []  # per node, once start_sandboxes has run
        self.links: list[NodeLink] = []  # per node, with submit="stream"
        self._submit: dict[tuple[int, int], Any] = {}  # (node, cores) -> task options
        self._where: dict[str, int] = {}  # trajectory -> the node of its sandbox

    @classmethod
    async def create(cls, *, dispatcher: str, services: Mapping[str, LiveService] | None = None,
                     cores_per_node: int | None = None, standin_mem_gb: float = 16.0,
                     workdir: str | None = None, submit: str = DEFAULT_SUBMIT) -> RayBackend:
        """The backend of the cluster this process is connected to (``ray.init`` first)."""
        nodes = await cluster_view(cores_per_node=cores_per_node)
        n_gpus = int(ray.cluster_resources().get("GPU", 0))
        gpus = None
        if n_gpus:
            gpus = await RayGpuHost.start(n_gpus, services or {}, standin_mem_gb)
            if gpus.standin_reason:
                log.warning("Ray GPUs without a device NVML can see are CPU stand-ins (%s)",
                            gpus.standin_reason)
        elif services:
            log.warning("GPU services registered, but the Ray cluster has no GPU")
        return cls(nodes, gpus, dispatcher=dispatcher, workdir=workdir, submit=submit)

    async def start_sandboxes(self, config: SandboxConfig, hide: list[str]) -> RemoteSandboxes:
        """Start each node's daemon (its run directory, sandbox server and cgroups).

        Raises:
            ConfigError: a node cannot confine commands as configured (the message
                names the node and why).
        """
        # The daemons end with the actor that starts them (the dispatcher's), and their
        # sandboxes with them. In "daemon" mode they hold the dispatcher's cores in Ray.
        cpus = len(self.nodes[0].cores) if self.submit != "task" else 0
        daemon = ray.remote(NodeDaemon)
        self.daemons = [daemon.options(
            num_cpus=cpus, max_restarts=0, max_concurrency=DAEMON_CONCURRENCY,
            scheduling_strategy=_pinned(n.name)).remote(config, hide, self.workdir, n.cores)
            for n in self.nodes]
        try:
            facts = await asyncio.wait_for(asyncio.gather(
                *(a.describe.remote() for a in self.daemons)), DESCRIBE_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise ConfigError("sandbox", f"the Ray nodes' daemons did not start within "
                              f"{DESCRIBE_TIMEOUT_S:g} s") from None
        for node, f in zip(self.nodes, facts, strict=True):
            if "error" in f:
                raise ConfigError("sandbox", f"node {node.name[:12]}: {f['error']}")
        if self.submit == "stream":
            try:
                self.links = list(await asyncio.wait_for(asyncio.gather(
                    *(NodeLink.connect(a) for a in self.daemons)), DESCRIBE_TIMEOUT_S))
            except (OSError, asyncio.TimeoutError) as e:
                raise ConfigError("submit", f"stream: cannot reach a node's daemon "
                                  f"({e or type(e).__name__}); the nodes' addresses must "
                                  f"be reachable on any port, or use submit=daemon") from None
        return RemoteSandboxes(self, facts, config)

    def _task(self, node: int, n_cores: int) -> Any:
        """``run_on_daemon`` with the options of ``n_cores`` on ``node`` (made once)."""
        key = (node, n_cores)
        fn = self._submit.get(key)
        if fn is None:
            fn = self._submit[key] = run_on_daemon.options(
                num_cpus=n_cores, scheduling_strategy=_pinned(self.nodes[node].name))
        return fn

    def start_command(self, node: int, n_cores: int, spec: CommandSpec,
                      sandbox: RemoteSandbox | None = None) -> RemoteCommand | StreamedCommand:
        """Start ``spec`` on ``n_cores`` of ``node``'s cores: the node's daemon picks them
        and starts it in its queue's order (now, when they are free: see the module
        docstring on handing ahead); its Outcome's ``detail["cores"]`` says which."""
        spec = replace(spec, extra_env={**(spec.extra_env or {}),
                                        DISPATCHER_ENV: self.dispatcher})
        if sandbox is not None and sandbox.key:
            self._where[sandbox.key] = node
        packed = pack(spec, n_cores, sandbox.box() if sandbox is not None else None)
        daemon = self.daemons[node]
        if self.submit == "stream":
            return self.links[node].start(packed)
        if self.submit == "daemon":
            ref = daemon.run.remote(packed)
        else:
            ref = self._task(node, n_cores).remote(daemon, packed)
        return RemoteCommand(ref)

    def close_trajectory(self, key: str) -> None:
        """End trajectory ``key``'s sandbox on its node (nothing waits for it)."""
        node = self._where.pop(key, None)
        if node is not None and self.daemons:
            self.daemons[node].close_trajectory.remote(key)

    def device_node(self, device: int) -> int:
        node_id = self.gpus.node_ids[device] if self.gpus is not None else None
        return next((i for i, n in enumerate(self.nodes) if n.name == node_id), -1)

    async def kill_orphans(self, journal: Journal) -> None:
        keys = [key for key, _, _ in journal.unfinished()]
        if not keys:
            return
        # One task per node with every key (not one per key): the next dispatcher does not
        # know where a dead one's commands ran.
        killed = await asyncio.gather(*(
            kill_orphans.options(scheduling_strategy=_pinned(n.name)).remote(
                self.dispatcher, keys) for n in self.nodes))
        if sum(killed):
            log.info("killed %d commands a previous dispatcher left running", sum(killed))

    def sample(self) -> None:
        """Nothing: the nodes' load is not measured from the dispatcher."""

    def measured_utilisation(self) -> dict[str, float]:
        return {}

    async def close(self) -> None:
        links, self.links = self.links, []
        for link in links:
            await link.close()
        daemons, self.daemons = self.daemons, []
        if daemons:
            # Each ends its sandboxes and removes what it made before it goes.
            await asyncio.gather(*(a.close.remote() for a in daemons), return_exceptions=True)
            for a in daemons:
                ray.kill(a)
        if self.gpus is not None:
            self.gpus.close()


__all__ = ["DEFAULT_SUBMIT", "SUBMIT_MODES", "NodeLink", "RayBackend", "RemoteCommand",
           "RemoteSandbox", "RemoteSandboxes", "StreamedCommand", "alive_nodes",
           "check_submit", "cluster_view", "lost"]
