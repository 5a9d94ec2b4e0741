"""Decision latency with a long queue: what a live dispatcher's scheduler pays per call
when thousands of actions wait.

Builds the state a dispatcher on this machine's cores holds after accepting ``--queued``
one-core commands that have not started (one node, ``--free`` cores free, the rest
running), and times each scheduler's ``decide`` (and, for checkpoints, the encoder's
``observe`` alone) on it. Each call sees a new state version, as after an event, so
nothing is answered from the encoder's per-version cache.

    python benchmarks/queued_decision.py [--queued 2000] [--free 1] [--samples 3000]
        [--schedulers elastic_greedy,checkpoints/default]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np

from metasched.agents import make_scheduler
from metasched.agents.checkpoint import resolve_scheduler
from metasched.core.actions import Action, ActionSpec, Grant
from metasched.core.cluster_config import ClusterConfig
from metasched.core.state import ClusterState


def queued_state(cores: int, free: int, queued: int) -> ClusterState:
    cluster = ClusterConfig(name="local", cpu_nodes=1, cores_per_node=cores,
                            mem_gb_per_node=64.0, gpu_devices=0, gpu_mem_gb=0.0, endpoints={})
    state = ClusterState(cluster, {})
    spec = ActionSpec(kind="cpu", name="true", true_s=math.nan, est_s=0.001, timeout_s=60.0,
                      min_cores=1, max_cores=1, parallel_fraction=0.0)
    for i in range(queued + cores - free):
        state.submit(Action(i, spec, "default", None, 0, 0.0))
    for a in list(state.pending["cpu"].values())[:cores - free]:  # these run
        state.start(Grant(a, cores=1, node=0))
    state.advance(1.0)
    return state


def timed(fn, state: ClusterState, samples: int) -> list[float]:
    """Microseconds per call, each on a new state version (after 50 untimed calls)."""
    out = []
    clock = time.perf_counter_ns
    for i in range(samples + 50):
        state.version += 1
        t0 = clock()
        fn(state)
        if i >= 50:
            out.append((clock() - t0) / 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--queued", type=int, default=2000)
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument("--free", type=int, default=1)
    ap.add_argument("--samples", type=int, default=3000)
    ap.add_argument("--schedulers", default="elastic_greedy,checkpoints/default")
    args = ap.parse_args()
    state = queued_state(args.cores, args.free, args.queued)
    print(f"{args.queued} queued one-core actions, {args.free} of {args.cores} cores free")
    print("| call | p50 µs | p90 µs | p99 µs |")
    print("|---|---|---|---|")
    for name in args.schedulers.split(","):
        sched = make_scheduler(resolve_scheduler(name))
        sched.reset(state, np.random.default_rng(0))
        calls = {f"{name} decide": sched.decide}
        encoder = getattr(sched, "encoder", None)
        if encoder is not None:
            calls[f"{name} observe"] = encoder.observe
        for label, fn in calls.items():
            us = timed(fn, state, args.samples)
            p90, p99 = np.percentile(us, [90, 99])
            print(f"| {label} | {statistics.median(us):.1f} | {p90:.1f} | {p99:.1f} |")


if __name__ == "__main__":
    main()
