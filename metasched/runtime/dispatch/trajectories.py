"""Trajectory life in the dispatcher: a request naming a trajectory opens it in the
core's state (its first one) and keeps it alive; it ends once its reward action (or
:meth:`Dispatcher.close_trajectory`) has come and nothing of it is queued or running,
or when it has been idle for ``trajectory_idle_s``. Ending it releases its held cores,
its sandbox memory and its sandbox. Its first request decides its task and its prompt
(``prompt``: GRPO's responses to one prompt share it; a later request naming another
is taken as the first said). A remaining-work predictor (the ``predictor`` setting:
:func:`fit_predictor`) learns each turn's generation gap (from the trajectory's last
event to a request that finds nothing of it queued or running) and each end, and reads
a trajectory's open and finished siblings (those with its prompt) as the simulator's
does. Where the OpenAI front door forwarded the turn's generations
(:meth:`Trajectories.generated`), the gap it learns is their measured time (queue and
run at the replica) instead of the wall time between the requests, which also holds
the client's own work. Once none of a prompt's trajectories is open, its group is
forgotten, so that a long-running dispatcher's predictor state stays bounded (and a
prompt sampled again in a later RL step starts a new group, as groups are per step in
training)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from metasched.core.actions import Trajectory
from metasched.core.predictor import Predictor, group_of, records_of_trace
from metasched.core.trace_writer import TraceWriter
from metasched.errors import ConfigError
from metasched.runtime.dispatch.executors.base import Executors
from metasched.runtime.dispatch.kernels import Kernels
from metasched.runtime.dispatch.sandbox_gate import SandboxGate
from metasched.runtime.dispatch.shared import Shared
from metasched.runtime.requests import Request
from metasched.sim.trace import scan_trace


class TrajectoryHost(Shared, Protocol):
    """What trajectory life asks of its dispatcher
    (the :class:`~.dispatcher.Dispatcher`)."""

    executors: Executors
    gate: SandboxGate
    kernels: Kernels
    sandboxes: Any  # the backend's sandboxes (made at start)
    trace_writer: TraceWriter | None


def fit_predictor(path: str | Path) -> Predictor:
    """The remaining-work predictor (design ``boost``) fitted on the recorded trace at
    ``path`` (the dispatcher's ``predictor`` setting)."""
    if not Path(path).is_file():
        raise ConfigError("predictor", f"no such trace file: {path}")
    try:
        return Predictor.fit(records_of_trace(scan_trace(path)), "boost")
    except ValueError as e:
        raise ConfigError("predictor", f"{path}: {e}") from None


class Trajectories:
    """The trajectories of dispatcher ``d``, by the name requests give them."""

    def __init__(self, d: TrajectoryHost) -> None:
        self.d = d
        self.by_name: dict[str, Trajectory] = {}
        self._live: dict[int, int] = {}  # trajectory id -> actions queued or running
        self._ended: set[int] = set()
        self._seen: dict[int, float] = {}
        self._generated: dict[int, float] = {}  # trajectory id -> its gap's generations, s
        self._prompts: dict[str, int] = {}  # prompt -> its open trajectories
        self._next = 0

    def get(self, name: str) -> Trajectory | None:
        return self.by_name.get(name)

    def arrived(self, req: Request, t: float) -> Trajectory | None:
        """``req`` was accepted at ``t``: its trajectory (opened if new), or None."""
        if req.trajectory is None:
            return None
        traj = self.by_name.get(req.trajectory)
        if traj is None:
            traj = Trajectory(self._next, req.task, 0, [], None, req.prompt)
            self._next += 1
            if traj.prompt is not None:
                self._prompts[traj.prompt] = self._prompts.get(traj.prompt, 0) + 1
            traj.start_t = t
            self.d.state.open_trajectory(traj)
            self.by_name[req.trajectory] = traj
        p = self.d.state.predictor
        if p is not None and not self._live.get(traj.id):  # a new turn: its gap ended
            gap = self._generated.pop(traj.id, None)
            p.observe_gap(traj, t - self._seen.get(traj.id, t) if gap is None else gap)
        traj.turn = max(traj.turn, req.turn + 1)
        self._live[traj.id] = self._live.get(traj.id, 0) + 1
        self._seen[traj.id] = t
        if req.reward:
            self._ended.add(traj.id)
        return traj

    def generated(self, name: str, seconds: float, t: float) -> None:
        """The front door forwarded one of trajectory ``name``'s generations, which took
        ``seconds`` at its replica and ended at ``t``: its gap is learned as the sum of
        these (one gap a turn, as the predictor was fitted), and the trajectory is not
        idle. A trajectory not yet open (its first turn's generation: the predictor's
        clock starts at its first action) or with an action running is left as it is."""
        traj = self.by_name.get(name)
        if traj is None or self._live.get(traj.id):
            return
        self._seen[traj.id] = max(t, self._seen.get(traj.id, t))
        if self.d.state.predictor is not None:
            self._generated[traj.id] = self._generated.get(traj.id, 0.0) + seconds

    def finished(self, traj: Trajectory, t: float) -> None:
        """One of ``traj``'s actions finished at ``t``: it closes if it was its last
        and the trajectory has ended."""
        self._live[traj.id] -= 1
        self._seen[traj.id] = t
        if self._live[traj.id] == 0 and traj.id in self._ended:
            self.close(traj)

    def close(self, traj: Trajectory) -> None:
        """The trajectory is over: its held cores, sandbox memory and sandbox (its
        workspace, and whatever still runs in it) are released."""
        d = self.d
        d.state.close_trajectory(traj)
        if d.state.predictor is not None:
            d.state.predictor.close(traj.id, traj.turn)
        if traj.prompt is not None:
            self._prompts[traj.prompt] -= 1
            if not self._prompts[traj.prompt]:  # its group's last: nobody reads it now
                del self._prompts[traj.prompt]
                if d.state.predictor is not None:
                    d.state.predictor.forget_group(group_of(traj))
        d.executors.release_held(traj.id)
        if d.trace_writer is not None:
            d.trace_writer.forget(traj.id)
        self._live.pop(traj.id, None)
        self._ended.discard(traj.id)
        self._seen.pop(traj.id, None)
        self._generated.pop(traj.id, None)
        for name, tr in list(self.by_name.items()):
            if tr is traj:
                del self.by_name[name]
                d.kernels.stop(name)
                if d.sandboxes is not None:
                    d.sandboxes.close_trajectory(name)
        if traj.sandbox is not None and d.gate.wait:
            d.gate.open_waiting()

    def end(self, name: str) -> None:
        """See :meth:`Dispatcher.close_trajectory`."""
        traj = self.by_name.get(name)
        if traj is None:
            return
        self._ended.add(traj.id)
        if self._live.get(traj.id, 0) == 0:
            self.close(traj)
            self.d.loop.kick()

    def close_idle(self, t: float, idle_s: float) -> None:
        """Close the trajectories with nothing queued or running for ``idle_s``."""
        for traj in list(self.by_name.values()):
            if self._live.get(traj.id, 0) == 0 and t - self._seen.get(traj.id, t) > idle_s:
                self.close(traj)
                self.d.loop.kick()


__all__ = ["Trajectories"]
