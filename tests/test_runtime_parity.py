"""Sim/live parity: the same actions arriving at the same times give the scheduler the
same observations (and masks) in the simulator and in the live dispatcher."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from metasched.agents import make_advisor
from metasched.core.actions import ActionSpec
from metasched.core.cluster_config import ClusterConfig
from metasched.core.observation import ObsConfig, ObservationEncoder
from metasched.core.pools import EndpointSpec
from metasched.core.scheduler import Scheduler
from metasched.runtime.dispatch import Dispatcher, DispatcherConfig
from metasched.sim.sampling import IndependentAction, WorkloadInstance
from metasched.sim.simulator import Simulator

CORES = sorted(os.sched_getaffinity(0))
EP = {"judge": EndpointSpec(rpm=600, max_concurrency=8, tpm=600_000, window_s=1.0)}
LONG = 1000.0  # nothing finishes while observations are compared

# (arrival s, task, kind, est_s, min cores, max cores, parallel fraction, tokens)
ARRIVALS = [
    (0.0, "swe", "cpu", 2.0, 1, len(CORES), 0.9, 0),
    (0.0, "swe", "cpu", 0.3, 1, 1, 0.0, 0),
    (0.5, "judge", "api", 1.5, 1, 1, 0.0, 2000),
    (0.5, "judge", "api", 1.5, 1, 1, 0.0, 2000),
    (0.7, "judge", "api", 1.5, 1, 1, 0.0, 2000),
    (1.25, "swe", "cpu", 5.0, 1, 2, 0.5, 0),
    (1.5, "judge", "api", 1.5, 1, 1, 0.0, 2000),
    (2.0, "math", "cpu", 0.8, 1, 1, 0.0, 0),
    (2.5, "judge", "api", 0.7, 1, 1, 0.0, 6000),
    (3.5, "judge", "api", 0.4, 1, 1, 0.0, 3000),
    (3.5, "swe", "cpu", 3.0, 1, 4 * len(CORES), 0.8, 0),  # more cores than the node has
]


class Recording(Scheduler):
    """elastic_greedy that records the observation at every decision."""

    name = "recording"

    def __init__(self) -> None:
        from metasched.agents import make_scheduler

        self.inner = make_scheduler("elastic_greedy")
        self.seen: list[tuple[float, dict[str, np.ndarray]]] = []

    def reset(self, state, rng) -> None:
        self.inner.reset(state, rng)
        self.encoder = ObservationEncoder(state, ObsConfig(), make_advisor(ObsConfig()))

    def decide(self, state):
        if state.t < LONG / 2:
            obs = {k: v.copy() for k, v in self.encoder.observe(state).items()}
            self.seen.append((state.t, obs))
        return self.inner.decide(state)


def simulated(make_workload) -> list:
    workload = make_workload({"kind": "cpu", "duration_s": 1.0, "timeout_s": 10}, services={})
    cluster = ClusterConfig(name="local", cpu_nodes=1, cores_per_node=len(CORES),
                            mem_gb_per_node=64.0, gpu_devices=0, gpu_mem_gb=0.0, endpoints=EP)
    indep = []
    for t, task, kind, est, lo, hi, p, tokens in ARRIVALS:
        spec = ActionSpec(kind, "x", LONG, est, 2 * LONG, lo, hi, p,
                          endpoint="judge" if kind == "api" else None, tokens=tokens)
        indep.append(IndependentAction(t, task, spec))
    sim = Simulator(workload, cluster, 0, instance=WorkloadInstance(independent=indep))
    rec = Recording()
    rec.reset(sim.state, sim.scheduler_rng())
    while sim.next_decision() and sim.state.t < 10.0:  # Simulator.run's loop, cut short
        grants = rec.decide(sim.state)
        for g in grants:
            sim.apply(g)
        if not grants:
            sim.wait()
    return rec.seen


async def live() -> list:
    now = [0.0]
    rec = Recording()
    never = asyncio.Event()

    async def call():
        await never.wait()

    d = Dispatcher(DispatcherConfig(cores=CORES, mem_gb=64.0, endpoints=EP,
                                    sample_interval_s=3600), scheduler=rec,
                   clock=lambda: now[0])
    await d.start()
    try:
        for i, (t, task, kind, est, lo, hi, p, tokens) in enumerate(ARRIVALS):
            now[0] = t
            if kind == "cpu":
                d.accept({"kind": "cpu", "argv": ["sleep", str(LONG)], "timeout_s": 2 * LONG,
                          "task": task, "name": "x", "est_s": est, "min_cores": lo,
                          "max_cores": hi, "parallel_fraction": p})
            else:
                d.accept({"kind": "api", "endpoint": "judge", "timeout_s": 2 * LONG,
                          "task": task, "name": "x", "est_s": est, "tokens": tokens},
                         call=call)
            if i + 1 == len(ARRIVALS) or ARRIVALS[i + 1][0] > t:  # all of this instant in
                await asyncio.sleep(0.05)  # the scheduling pass runs at this (frozen) time
        now[0] = 4.0
        return rec.seen, d.observe()
    finally:
        await d.close(drain=False)


@pytest.mark.skipif(len(CORES) < 2, reason="needs 2 cores")
async def test_same_state_gives_identical_observations(make_workload):
    sim_seen = simulated(make_workload)
    live_seen, _ = await live()
    assert len(sim_seen) >= 5
    assert [t for t, _ in live_seen] == [t for t, _ in sim_seen]
    for (t, a), (_, b) in zip(sim_seen, live_seen, strict=True):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=f"{key} at t={t}")
