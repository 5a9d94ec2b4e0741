"""Decision latency of a meta-policy against the rule it chose, in the simulator.

Runs each scheduler on one shrunk instance of a profile and times every ``decide``
call (the meta-policy's first call includes reading the workload features and its
network; every later one is the chosen rule's decision behind one check). Prints the
option chosen, the number of decisions, p50 and p99 and the first call, in µs.

    python benchmarks/meta_latency.py [--profile retool_grouped] [--load 0.25]
        [--schedulers checkpoints/default,critical_path,checkpoints/meta_act,rate_greedy]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from metasched.agents import make_scheduler
from metasched.agents.checkpoint import resolve_scheduler
from metasched.compose import profile
from metasched.core.scheduler import Scheduler
from metasched.envs.scheduling import scale_workload
from metasched.sim.simulator import Simulator


class Timed(Scheduler):
    """Times every decision of the scheduler it wraps."""

    def __init__(self, inner: Scheduler) -> None:
        self.inner, self.ns = inner, []

    def reset(self, state, rng) -> None:
        self.inner.reset(state, rng)

    def decide(self, state):
        t0 = time.perf_counter_ns()
        grants = self.inner.decide(state)
        self.ns.append(time.perf_counter_ns() - t0)
        return grants


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="retool_grouped")
    ap.add_argument("--load", type=float, default=0.25, help="x trajectories per step")
    ap.add_argument("--seed", type=int, default=1_000_000)
    ap.add_argument("--schedulers", default="checkpoints/default,critical_path,"
                    "checkpoints/meta_act,rate_greedy")
    args = ap.parse_args()
    w, c = profile(args.profile)
    w = scale_workload(w, load=args.load, steps=1)
    for name in args.schedulers.split(","):
        sched = Timed(make_scheduler(resolve_scheduler(name)))
        Simulator(w, c, args.seed, max_wait_s=300.0).run(sched)
        us = np.asarray(sched.ns) / 1e3
        choice = getattr(sched.inner, "choice", None)
        print(f"{name}{f' (chose {choice.name})' if choice else ''}: {len(us)} decisions, "
              f"p50 {np.median(us):.1f} µs, p99 {np.percentile(us, 99):.1f} µs, "
              f"first {us[0]:.1f} µs", flush=True)


if __name__ == "__main__":
    main()
