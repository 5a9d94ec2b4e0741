"""The sandbox gate: a command is queued for the scheduler only once its sandbox is
ready. A trajectory's first command opens its sandbox (waiting, in order, for sandbox
memory in the core's pool when there is none); its later commands are held behind it
until the sandbox is ready, and commands of no trajectory wait for the shared sandbox of
their network setting."""

from __future__ import annotations

from typing import Any, Protocol

from metasched.core.actions import SandboxSpec, Trajectory
from metasched.core.sandbox_queue import SandboxQueue
from metasched.errors import ConfigError
from metasched.runtime.dispatch.jobs import Job
from metasched.runtime.dispatch.shared import Shared
from metasched.runtime.requests import Request
from metasched.runtime.sandbox.manager import Sandbox


class GateHost(Shared, Protocol):
    """What the sandbox gate asks of its dispatcher
    (the :class:`~.dispatcher.Dispatcher`)."""

    sandboxes: Any  # the backend's sandboxes (made at start)

    def submit_job(self, job: Job, traj: Trajectory | None) -> None: ...


class SandboxGate:
    """Holds dispatcher ``d``'s commands until their sandboxes are ready."""

    def __init__(self, d: GateHost) -> None:
        self.d = d
        self.wait = SandboxQueue(d.state)  # waiting for sandbox memory
        # trajectory id -> its jobs, until its sandbox is ready
        self.awaiting: dict[int, list[Job]] = {}
        self._shared_wait: dict[bool, list[Job]] = {}  # jobs until a shared sandbox opens

    def _network(self, req: Request) -> bool:
        return req.network if req.network is not None else self.d.config.sandbox.network

    def check(self, req: Request) -> None:
        """What a command asks of its sandbox, against this machine and against the
        sandbox its trajectory already has (the first command decides)."""
        d = self.d
        if req.workspace_template is not None:
            d.config.sandbox.template(req.workspace_template)
        mb = req.workspace_mb
        if mb is not None and mb / 1024 > d.cluster.mem_gb_per_node:
            raise ConfigError("workspace_mb", f"{mb:g} MB exceeds this node's memory "
                              f"({d.cluster.mem_gb_per_node * 1024:g} MB)")
        sb = (d.sandboxes.get(req.trajectory) if d.sandboxes is not None
              and req.trajectory is not None else None)
        if sb is None:
            return
        network = self._network(req)
        if network != sb.network:
            raise ConfigError("network", f"trajectory {req.trajectory}'s sandbox was made "
                              f"with network={str(sb.network).lower()}")
        template = sb.template.name if sb.template is not None else None
        if req.workspace_template is not None and req.workspace_template != template:
            raise ConfigError("workspace_template", f"trajectory {req.trajectory}'s workspace "
                              f"was made from {template or 'nothing'}")
        if mb is not None and int(mb * (1 << 20)) != sb.size_bytes:
            raise ConfigError("workspace_mb", f"trajectory {req.trajectory}'s workspace was "
                              f"made with {sb.size_bytes / (1 << 20):g} MB")

    def ready_for(self, job: Job, traj: Trajectory | None) -> bool:
        """Whether ``job``'s sandbox is ready; if not, the job is held (and submitted
        by :meth:`_release_awaiting` once it is, or once it failed: then the job fails at
        its start, with the reason)."""
        d = self.d
        req = job.request
        network = self._network(req)
        if traj is None:
            own = getattr(job.sandbox, "throwaway", False)  # (gVisor: its own sandbox)
            sb = job.sandbox = job.sandbox if own else d.sandboxes.shared(network)
            if sb.ready.done():
                return True
            if own or getattr(sb, "throwaway", False):  # submitted again once it is ready
                sb.ready.add_done_callback(
                    lambda _: None if self.d.loop.closed else self.d.submit_job(job, None))
                return False
            held = self._shared_wait.setdefault(network, [])
            if not held:
                sb.ready.add_done_callback(lambda _: self._release_shared(network))
            held.append(job)
            return False
        if traj.id in self.awaiting:  # its sandbox is not ready: keep the order
            self.awaiting[traj.id].append(job)
            return False
        sb = job.sandbox = d.sandboxes.get(req.trajectory)
        if sb is not None:  # ready: until it is, its trajectory's jobs are held
            return True
        # The trajectory's first command (or its first since its sandbox failed).
        self.awaiting[traj.id] = [job]
        if traj.sandbox is None and not d.state.open_sandbox(traj, self._spec(req)):
            self.wait.append(traj)  # no sandbox memory free: wait
            return False
        self._open(traj, req)
        return False

    def _spec(self, req: Request) -> SandboxSpec:
        """The sandbox a trajectory's first command ``req`` asks for."""
        mb = req.workspace_mb or self.d.config.sandbox.workspace_mb
        return SandboxSpec(mem_gb=mb / 1024, startup_s=0.0)

    def _open(self, traj: Trajectory, req: Request) -> None:
        """Make the trajectory's sandbox; its held jobs are submitted when it is ready."""
        d = self.d
        template = (d.config.sandbox.template(req.workspace_template)
                    if req.workspace_template is not None else None)
        sb = d.sandboxes.open(req.trajectory, size_mb=traj.sandbox.mem_gb * 1024,
                          template=template, network=self._network(req))
        sb.ready.add_done_callback(lambda _: self._release_awaiting(traj, sb))

    def _release_awaiting(self, traj: Trajectory, sb: Sandbox) -> None:
        jobs = self.awaiting.pop(traj.id, [])
        if self.d.loop.closed:
            return
        for job in jobs:
            job.sandbox = sb
            self.d.submit_job(job, traj)

    def _release_shared(self, network: bool) -> None:
        for job in self._shared_wait.pop(network, []):
            if not self.d.loop.closed:
                self.d.submit_job(job, None)

    def drop_held(self, job: Job) -> bool:
        """Take ``job`` out of the jobs held for their sandbox (it is cancelled); False
        if it was not held."""
        for held in (*self.awaiting.values(), *self._shared_wait.values()):
            if job in held:
                held.remove(job)
                return True
        return False

    def open_overcommitted(self, traj: Trajectory) -> None:
        """Open the sandbox of ``traj``, waiting for sandbox memory, now (its first held
        command has reached its latest start): on the node with the most memory free,
        overcommitting it; returned when the trajectory closes."""
        req = self.awaiting[traj.id][0].request
        spec = self._spec(req)
        state = self.d.state
        cpu = state.cpu
        node = max(range(cpu.n_nodes), key=lambda n: (cpu.mem_free[n], -n))
        cpu.mem_free[node] -= spec.mem_gb
        cpu.sandboxes[node] += 1
        traj.sandbox, traj.node = spec, node
        state.version += 1
        self.wait.remove(traj)
        self._open(traj, req)

    def open_waiting(self) -> None:
        """Sandbox memory was freed: open the sandboxes of trajectories waiting for it,
        in order, while it lasts."""
        self.wait.open_waiting(self._opened, self._waiting_spec)

    def _waiting_spec(self, traj: Trajectory) -> SandboxSpec | None:
        """The sandbox a waiting trajectory asks for (its first held command's); None
        once it was closed meanwhile."""
        jobs = self.awaiting.get(traj.id)
        return self._spec(jobs[0].request) if jobs else None

    def _opened(self, traj: Trajectory) -> None:
        self._open(traj, self.awaiting[traj.id][0].request)


__all__ = ["SandboxGate"]
