"""Sim-to-live fidelity: the same workload instance in the simulator and, time-scaled,
through the live dispatcher on this machine.

Draws one RL step of a CPU-only profile (``coding`` by default) with ``--trajectories``
trajectories, scales every duration by ``--scale``, and runs it (a) in the simulator
on a cluster of this machine's cores and (b) live: one coroutine per trajectory sleeps
through each LLM generation gap, then submits the turn's action and waits for its
result; the action is a command that sleeps for its true duration at the granted core
count (Amdahl, from ``OMP_NUM_THREADS``), so a grant of more cores really shortens it.
The profile's sandbox start-up is left out of the simulated side (its delay is folded
into the first generation gap); live, each command runs in its trajectory's sandbox by
default (``--isolation``: ``bwrap``, or ``off`` for commands on the host without
cgroups; several modes are run one after the other per scheduler). Prints mean ACT and
step time, simulated and live, per scheduler and isolation.

    python benchmarks/live_replay.py [--profile coding] [--trajectories 4] [--scale 0.02]
        [--schedulers fifo,elastic_greedy,checkpoints/default] [--seed 1000000]
        [--isolation bwrap,off]

Live differs from simulated by construction in two ways, both part of what is measured:
commands cost their start-up (a shell and ``sleep``, a few ms; with isolation, a
trajectory's sandbox is made before its first command and each start goes through the
sandbox server), and the policy sees
estimates from the online cost model (measured durations) instead of the profile's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from dataclasses import replace

import numpy as np

from metasched.agents import make_scheduler
from metasched.agents.checkpoint import resolve_scheduler
from metasched.compose import profile
from metasched.core.actions import Turn
from metasched.core.cluster_config import ClusterConfig
from metasched.runtime.dispatcher import Dispatcher, DispatcherConfig
from metasched.runtime.sandbox.config import SandboxConfig
from metasched.sim.sampling import TrajectorySpec, WorkloadInstance, sample_workload
from metasched.sim.simulator import Simulator


def scaled_step(profile_name: str, n: int, scale: float, seed: int):
    """One step of ``n`` trajectories, every duration times ``scale``, no sandboxes."""
    w, _ = profile(profile_name)
    w = replace(w, trajectories_per_step=n, steps=1)
    inst = sample_workload(w, np.random.default_rng(seed))
    trajs = []
    for t in inst.steps[0]:
        turns = []
        for i, turn in enumerate(t.turns):
            a = turn.action
            if a.kind != "cpu":
                raise SystemExit(f"{profile_name}: live replay runs cpu actions only "
                                 f"(found a {a.kind} action)")
            gen = turn.gen_s
            if i == 0 and t.sandbox is not None:
                gen = max(gen, t.sandbox.startup_s)  # start-up overlaps the first gap
            turns.append(Turn(gen * scale, replace(
                a, true_s=a.true_s * scale, est_s=a.est_s * scale,
                timeout_s=a.timeout_s * scale)))
        trajs.append(TrajectorySpec(t.task, tuple(turns), None))
    return w, WorkloadInstance(steps=[trajs])


def amdahl_sleep(base_s: float, p: float) -> list[str]:
    """A command sleeping ``base_s x ((1 - p) + p / k)`` for ``k`` = its granted cores."""
    b, q = int(base_s * 1e6), int(round(p * 1000))
    script = (f't=$(( {b} * (1000 - {q}) / 1000 + {b} * {q} / 1000 / OMP_NUM_THREADS )); '
              'exec sleep "$((t / 1000000)).$(printf %06d $((t % 1000000)))"')
    return ["/bin/sh", "-c", script]


def simulate(w, inst, cluster: ClusterConfig, sched: str, seed: int
             ) -> tuple[float, float, int]:
    # The dispatcher's guard (max_wait_s 300, serving stalled queues) on both sides.
    sim = Simulator(w, cluster, seed, instance=inst, max_wait_s=300.0)
    r = sim.run(make_scheduler(resolve_scheduler(sched)))
    return float(r.act.mean()), float(r.step_s[0]), int(r.counters["failed"])


async def live(inst, cores: list[int], sched: str, isolation: str
               ) -> tuple[float, float, int]:
    sandbox = (SandboxConfig(isolation="none", cgroups="none") if isolation == "off"
               else SandboxConfig(isolation=isolation))
    cfg = DispatcherConfig(scheduler=sched, cores=cores, sample_interval_s=0.5,
                           sandbox=sandbox)
    async with Dispatcher(cfg) as d:
        if d.fallback_reason:
            raise SystemExit(f"{sched}: {d.fallback_reason}")

        async def trajectory(i: int, spec: TrajectorySpec) -> None:
            for k, turn in enumerate(spec.turns):
                await asyncio.sleep(turn.gen_s)
                a = turn.action
                await d.submit({
                    "kind": "cpu", "argv": amdahl_sleep(a.true_s, a.parallel_fraction),
                    "timeout_s": a.timeout_s, "min_cores": a.min_cores,
                    "max_cores": a.max_cores, "parallel_fraction": a.parallel_fraction,
                    "est_s": a.est_s, "task": spec.task, "name": a.name,
                    "trajectory": f"t{i}", "turn": k, "reward": a.reward})

        t0 = time.perf_counter()
        await asyncio.gather(*(trajectory(i, s) for i, s in enumerate(inst.steps[0])))
        step = time.perf_counter() - t0
    r = d.run_result()
    return float(r.act.mean()), step, int(r.counters["failed"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="coding")
    ap.add_argument("--trajectories", type=int, default=4)
    ap.add_argument("--scale", type=float, default=0.02, help="time scale (live seconds per "
                    "simulated second)")
    ap.add_argument("--schedulers", default="fifo,elastic_greedy,checkpoints/default")
    ap.add_argument("--seed", type=int, default=1_000_000)
    ap.add_argument("--isolation", default="bwrap",
                    help="comma-separated: bwrap, none, off (no isolation, no cgroups)")
    args = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    w, inst = scaled_step(args.profile, args.trajectories, args.scale, args.seed)
    cluster = ClusterConfig(name="local", cpu_nodes=1, cores_per_node=len(cores),
                            mem_gb_per_node=64.0, gpu_devices=0, gpu_mem_gb=0.0, endpoints={})
    n_actions = sum(len(t.turns) for t in inst.steps[0])
    print(f"{args.profile}: {args.trajectories} trajectories, {n_actions} actions, time x "
          f"{args.scale:g}, {len(cores)} cores, seed {args.seed}")
    print("| scheduler | isolation | mean ACT s sim | live | live ÷ sim | step s sim | live "
          "| live ÷ sim | failed (timeouts) sim / live |")
    print("|---|---|---|---|---|---|---|---|---|")
    for sched in args.schedulers.split(","):
        s_act, s_step, s_failed = simulate(w, inst, cluster, sched, args.seed)
        for isolation in args.isolation.split(","):
            l_act, l_step, l_failed = asyncio.run(live(inst, cores, sched, isolation))
            print(f"| {sched} | {isolation} | {s_act:.4f} | {l_act:.4f} | {l_act / s_act:.2f} "
                  f"| {s_step:.2f} | {l_step:.2f} | {l_step / s_step:.2f} "
                  f"| {s_failed} / {l_failed} |", flush=True)


if __name__ == "__main__":
    main()
