"""The simulator on a cluster of the size users run: 10^4-10^5 sandboxes.

The ``coding`` profile (one sandbox per trajectory, ~74 shell/test/install actions each,
a CPU test-suite reward) with ``trajectories_per_step`` set to each N of ``--sizes``
and one RL step, on the ``coding`` cluster grown to hold them as that profile
provisions them (4 cores per trajectory: N/16 nodes of 64 cores, 512 GB). Prints, per
N, the wall and CPU time of sampling the workload and of simulating it (one core), the
actions simulated, the simulated rate the cluster sustains (actions per simulated
second, the figure to compare with a cluster's ~10^4 actions/s), the decisions and
the process's peak memory. A progress bar on stderr follows the simulation (actions
finished); the table goes to stdout.

    python benchmarks/sim_scale.py [--sizes 10000,30000,100000] [--scheduler elastic_greedy]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from dataclasses import replace

from tqdm import tqdm

from metasched.agents import make_scheduler
from metasched.compose import profile
from metasched.core.scheduler import Scheduler
from metasched.core.state import ClusterState
from metasched.sim.simulator import Simulator

TRAJECTORIES_PER_NODE = 16  # 64 cores / 4 cores per trajectory, as configs/cluster/coding.yaml
PROGRESS_EVERY = 1 << 14  # decisions between progress bar updates (a few per second)


class _Progress(Scheduler):
    """``inner``, with a progress bar of the actions finished, updated every
    ``PROGRESS_EVERY`` decisions (one call more per decision; no change to any grant)."""

    def __init__(self, inner: Scheduler, bar: tqdm) -> None:
        self.inner, self.bar = inner, bar
        self.name = inner.name
        self._calls = 0

    def reset(self, state: ClusterState, rng) -> None:
        self.inner.reset(state, rng)

    def decide(self, state: ClusterState):
        self._calls += 1
        if not self._calls % PROGRESS_EVERY:
            self.bar.update(state.n_done + state.n_failed - self.bar.n)
        return self.inner.decide(state)


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
    print("| sandboxes | nodes | cores | actions | sampling s | sampling CPU s | "
          "simulation s | simulation CPU s | decisions | simulated makespan s | "
          "actions per simulated s | sim actions/s (wall) | peak RSS GB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for n in sizes:
        nodes = -(-n // TRAJECTORIES_PER_NODE)
        w = replace(base_w, steps=1, trajectories_per_step=n)
        c = replace(base_c, name=f"coding-{n}", cpu_nodes=nodes)
        print(f"{time.strftime('%H:%M:%S')} sampling {n:,} trajectories", file=sys.stderr,
              flush=True)
        t0, p0 = time.perf_counter(), time.process_time()
        sim = Simulator(w, c, args.seed)
        t1, p1 = time.perf_counter(), time.process_time()
        print(f"{time.strftime('%H:%M:%S')} sampled in {t1 - t0:.1f} s; simulating",
              file=sys.stderr, flush=True)
        with tqdm(total=sim.instance.n_actions, desc=f"{n:,} sandboxes", unit="action",
                  unit_scale=True, mininterval=5.0, file=sys.stderr) as bar:
            r = sim.run(_Progress(make_scheduler(args.scheduler), bar))
            bar.update(bar.total - bar.n)
        t2, p2 = time.perf_counter(), time.process_time()
        k = r.counters
        makespan = r.makespan
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KB -> GB
        print(f"| {n:,} | {nodes:,} | {nodes * c.cores_per_node:,} | {k['submitted']:,} | "
              f"{t1 - t0:.1f} | {p1 - p0:.1f} | {t2 - t1:.1f} | {p2 - p1:.1f} | "
              f"{k['decisions']:,} | {makespan:,.0f} | {k['submitted'] / makespan:,.0f} | "
              f"{k['submitted'] / (t2 - t1):,.0f} | {peak:.2f} |", flush=True)


if __name__ == "__main__":
    main()
