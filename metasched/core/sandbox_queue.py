"""The sandbox queue: trajectories waiting for sandbox memory, shared by both clocks.

A trajectory holds its sandbox's memory on one node for its lifetime. When no node has
the memory, it waits here; whenever memory frees (a trajectory ends), the waiting ones
are placed in arrival order, the first blocking those behind it, so a large sandbox is
never overtaken for good by smaller ones.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from metasched.core.actions import SandboxSpec, Trajectory
from metasched.core.state import ClusterState


class SandboxQueue:
    """Trajectories of ``state`` waiting, in order, for sandbox memory."""

    __slots__ = ("state", "_waiting")

    def __init__(self, state: ClusterState) -> None:
        self.state = state
        self._waiting: deque[Trajectory] = deque()

    def __len__(self) -> int:
        return len(self._waiting)

    def __iter__(self) -> Iterator[Trajectory]:
        return iter(self._waiting)

    def append(self, traj: Trajectory) -> None:
        """Queue ``traj`` behind those already waiting."""
        self._waiting.append(traj)

    def remove(self, traj: Trajectory) -> None:
        """Take ``traj`` out of the queue (its sandbox was placed otherwise)."""
        self._waiting.remove(traj)

    def open_waiting(self, opened: Callable[[Trajectory], object],
                     sandbox: Callable[[Trajectory], SandboxSpec | None] | None = None
                     ) -> None:
        """Place the sandboxes of waiting trajectories, in order, while memory lasts,
        calling ``opened(traj)`` for each one placed.

        Without ``sandbox``, a trajectory brings its own and is opened whole
        (``ClusterState.open_trajectory``: the simulator's trajectories). With it, an
        open trajectory is given the sandbox ``sandbox(traj)`` (``ClusterState.
        open_sandbox``: the dispatcher's, at its first command); None means it no
        longer waits (closed meanwhile), and it leaves the queue.
        """
        q, state = self._waiting, self.state
        while q:
            traj = q[0]
            if sandbox is None:
                if not state.open_trajectory(traj):
                    return
            else:
                spec = sandbox(traj)
                if spec is not None and not state.open_sandbox(traj, spec):
                    return
                if spec is None:
                    q.popleft()
                    continue
            q.popleft()
            opened(traj)


__all__ = ["SandboxQueue"]
