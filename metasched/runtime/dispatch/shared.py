"""What every part of the dispatcher is given (:class:`Shared`): the core's state, the
configuration, the cluster it was made for, the clock and loop, and the table of
unfinished jobs. Each part's module adds, in a protocol of its own, the few other
things it asks of the dispatcher; the :class:`~.dispatcher.Dispatcher` provides them
all, and no part reaches into another's private attributes."""

from __future__ import annotations

from typing import Protocol

from metasched.core.cluster_config import ClusterConfig
from metasched.core.state import ClusterState
from metasched.runtime.dispatch.config import DispatcherConfig
from metasched.runtime.dispatch.jobs import JobTable
from metasched.runtime.dispatch.loop import DispatchLoop

__all__ = ["Shared"]


class Shared(Protocol):
    """What every part reads: the core's state (the scheduler's view), the
    configuration, the cluster, the clock and loop, and the unfinished jobs."""

    state: ClusterState
    config: DispatcherConfig
    cluster: ClusterConfig
    loop: DispatchLoop
    jobs: JobTable
