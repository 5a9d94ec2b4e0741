"""Recording a simulated run as a trace of finished actions, with what was measured
(the same lines the live dispatcher writes: ``metasched.core.trace_writer``).

It lives here, beside the other runs of a named scheduler, because it builds that
scheduler (:func:`metasched.agents.make_scheduler`): the simulator itself takes a
scheduler, never a name."""

from __future__ import annotations

import os

from metasched.agents import make_scheduler
from metasched.core.cluster_config import ClusterConfig
from metasched.core.metrics import RunResult
from metasched.core.trace_writer import TraceWriter
from metasched.sim.simulator import Simulator, cost_model_for
from metasched.sim.workload_config import WorkloadConfig


def record_trace(workload: WorkloadConfig, cluster: ClusterConfig, path: str | os.PathLike,
                 scheduler: str = "elastic_greedy", seed: int = 0,
                 max_wait_s: float | None = 300.0, estimates: str = "given"
                 ) -> tuple[RunResult, int]:
    """Simulate ``workload`` on ``cluster`` under ``scheduler`` (a heuristic's name or a
    checkpoint directory) for ``seed`` and append every finished action to ``path``;
    ``estimates``: what the scheduler sees (``online``: the dispatcher's cost model).

    Returns the run's result and the number of actions written.
    """
    with TraceWriter(path, cluster, workload.services) as log:
        sim = Simulator(workload, cluster, seed, trace_writer=log, max_wait_s=max_wait_s,
                        cost_model=cost_model_for(estimates))
        result = sim.run(make_scheduler(scheduler))
    return result, log.n_written


__all__ = ["record_trace"]
