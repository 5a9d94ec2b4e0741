"""The simulator on a cluster of the size users run: 10^4-10^5 sandboxes.

The ``coding`` profile (one sandbox per trajectory, ~74 shell/test/install actions each,
a CPU test-suite reward) with ``trajectories_per_step`` set to each N of ``--sizes``
and one RL step, on the ``coding`` cluster grown to hold them as that profile
provisions them (4 cores per trajectory: N/16 nodes of 64 cores, 512 GB). Prints, per
N, the wall time of sampling the workload and of simulating it (one core), the
actions simulated, the simulated rate the cluster sustains (actions per simulated
second, the figure to compare with a cluster's ~10^4 actions/s), the decisions and
the process's peak memory.

    python benchmarks/sim_scale.py [--sizes 10000,30000,100000] [--scheduler elastic_greedy]
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from dataclasses import replace

from metasched.agents import make_scheduler
from metasched.compose import profile
from metasched.sim.simulator import Simulator

TRAJECTORIES_PER_NODE = 16  # 64 cores / 4 cores per trajectory, as configs/cluster/coding.yaml


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10000,30000,100000",
                    help="sandboxes (trajectories of the step), comma-separated")
    ap.add_argument("--scheduler", default="elastic_greedy")
    ap.add_argument("--seed", type=int, default=1_000_000)
    args = ap.parse_args()
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        raise SystemExit(f"error: sizes: not a list of integers ({args.sizes!r})") from None
    if not sizes or min(sizes) < TRAJECTORIES_PER_NODE:
        raise SystemExit(f"error: sizes: each must be >= {TRAJECTORIES_PER_NODE}")
    if hasattr(os, "sched_setaffinity"):  # one core, as the figures are quoted
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})

    base_w, base_c = profile("coding")
    print("| sandboxes | nodes | cores | actions | sampling s | simulation s | decisions | "
          "simulated makespan s | actions per simulated s | sim actions/s (wall) | "
          "peak RSS GB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for n in sizes:
        nodes = -(-n // TRAJECTORIES_PER_NODE)
        w = replace(base_w, steps=1, trajectories_per_step=n)
        c = replace(base_c, name=f"coding-{n}", cpu_nodes=nodes)
        t0 = time.perf_counter()
        sim = Simulator(w, c, args.seed)
        t1 = time.perf_counter()
        r = sim.run(make_scheduler(args.scheduler))
        t2 = time.perf_counter()
        k = r.counters
        makespan = r.makespan
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KB -> GB
        print(f"| {n:,} | {nodes:,} | {nodes * c.cores_per_node:,} | {k['submitted']:,} | "
              f"{t1 - t0:.1f} | {t2 - t1:.1f} | {k['decisions']:,} | {makespan:,.0f} | "
              f"{k['submitted'] / makespan:,.0f} | {k['submitted'] / (t2 - t1):,.0f} | "
              f"{peak:.2f} |", flush=True)


if __name__ == "__main__":
    main()
