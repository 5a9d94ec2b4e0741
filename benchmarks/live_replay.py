"""Sim-to-live fidelity: the same workload instance in the simulator and, time-scaled,
through the live dispatcher on this machine.

Draws one RL step of a CPU-only profile (``coding`` by default) with ``--trajectories``
trajectories, scales every duration by ``--scale``, and runs it (a) in the simulator
on a cluster of this machine's cores and (b) live, ``--repeats`` times: one coroutine
per trajectory sleeps through each LLM generation gap, then submits the turn's action
and waits for its result; the action is a command that sleeps for its true duration at
the granted core count (Amdahl, from ``OMP_NUM_THREADS``), so a grant of more cores
really shortens it. Sandboxes are left out on both sides (the dispatcher does not
manage containers; their start-up delay is folded into the first generation gap).
Prints mean ACT and step time, simulated and live (mean and range over the repeats),
per scheduler.

    python benchmarks/live_replay.py [--profile coding] [--trajectories 16] [--scale 0.1]
        [--schedulers static,...,checkpoints/default] [--repeats 3] [--seed 1000000]
        [--estimates online|profile] [--launch-s auto|<seconds>]

The simulator is given what the dispatcher has: the online cost model's estimates
(``--estimates online``, the default: learned from measured durations, as live; the
profile's noisy per-action estimates only as the first hint), the start-up cost of a
command on this machine (``cluster.cpu_launch_s``; ``auto`` measures it first: the
median run of ``--launch-samples`` do-nothing commands of the same form), and the
workload's expected demand per task (for ``static`` and ``task_isolated``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from dataclasses import fields, replace

import numpy as np
from tqdm import tqdm

from metasched.agents import BASELINES, make_scheduler
from metasched.agents.checkpoint import resolve_scheduler
from metasched.compose import profile
from metasched.core.actions import Turn, amdahl_run_s
from metasched.core.cluster_config import ClusterConfig
from metasched.core.cost_model import CostModel
from metasched.runtime.dispatcher import Dispatcher, DispatcherConfig
from metasched.sim.sampling import TrajectorySpec, WorkloadInstance, sample_workload
from metasched.sim.simulator import Simulator

MAX_WAIT_S = 300.0  # the dispatcher's default guard, on both sides


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
                raise SystemExit(f"error: --profile: live replay runs cpu actions only "
                                 f"({profile_name} has a {a.kind} action)")
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


def dispatcher_cost_model() -> CostModel:
    """A cost model with the dispatcher's default settings."""
    d = {f.name: f.default for f in fields(DispatcherConfig)}
    return CostModel(d["cost_alpha"], d["default_est_s"])


def simulate(w, inst, cluster: ClusterConfig, sched: str, seed: int, online: bool
             ) -> tuple[float, float, int]:
    sim = Simulator(w, cluster, seed, instance=inst, max_wait_s=MAX_WAIT_S,
                    cost_model=dispatcher_cost_model() if online else None)
    r = sim.run(make_scheduler(resolve_scheduler(sched)))
    return float(r.act.mean()), float(r.step_s[0]), int(r.counters["failed"])


async def measure_launch_s(cores: list[int], n: int) -> float:
    """Median run time of ``n`` do-nothing commands of the replay's form, one at a time."""
    runs = []
    async with Dispatcher(DispatcherConfig(scheduler="fifo", cores=cores)) as d:
        for i in range(n):
            r = await d.submit({"kind": "cpu", "argv": amdahl_sleep(0.0, 0.0),
                                "timeout_s": 10.0, "name": "launch", "id": f"launch-{i}"})
            if r.status != "done":
                raise SystemExit(f"error: a do-nothing command failed: {r.reason}")
            runs.append(r.finished_at - r.started_at)
    return float(np.median(runs))


async def live(inst, cores: list[int], sched: str) -> tuple[float, float, int, float]:
    """Mean ACT, step time, failures and the median start-up of a command (its measured
    run less the sleep it was asked for) of one live run."""
    cfg = DispatcherConfig(scheduler=sched, cores=cores, sample_interval_s=0.5,
                           max_wait_s=MAX_WAIT_S, task_demand=inst.demand_by_task())
    async with Dispatcher(cfg) as d:
        if d.fallback_reason:
            raise SystemExit(f"error: --schedulers: {sched}: {d.fallback_reason}")

        startup: list[float] = []

        async def trajectory(i: int, spec: TrajectorySpec) -> None:
            for k, turn in enumerate(spec.turns):
                await asyncio.sleep(turn.gen_s)
                a = turn.action
                r = await d.submit({
                    "kind": "cpu", "argv": amdahl_sleep(a.true_s, a.parallel_fraction),
                    "timeout_s": a.timeout_s, "min_cores": a.min_cores,
                    "max_cores": a.max_cores, "parallel_fraction": a.parallel_fraction,
                    "est_s": a.est_s, "task": spec.task, "name": a.name,
                    "trajectory": f"t{i}", "turn": k, "reward": a.reward})
                if r.status == "done":
                    k = len(r.allocation["cores"])
                    startup.append(r.finished_at - r.started_at
                                   - amdahl_run_s(a.true_s, a.parallel_fraction, k))

        t0 = time.perf_counter()
        await asyncio.gather(*(trajectory(i, s) for i, s in enumerate(inst.steps[0])))
        step = time.perf_counter() - t0
    r = d.run_result()
    return float(r.act.mean()), step, int(r.counters["failed"]), float(np.median(startup))


def spread(xs: list[float]) -> str:
    """Mean (min-max) of the repeats."""
    return f"{np.mean(xs):.3f} ({min(xs):.3f}–{max(xs):.3f})" if len(xs) > 1 else f"{xs[0]:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="coding")
    ap.add_argument("--trajectories", type=int, default=16)
    ap.add_argument("--scale", type=float, default=0.1, help="time scale (live seconds per "
                    "simulated second)")
    ap.add_argument("--schedulers", default=",".join([*BASELINES, "checkpoints/default"]))
    ap.add_argument("--repeats", type=int, default=3, help="live runs per scheduler (0: "
                    "simulate only)")
    ap.add_argument("--seed", type=int, default=1_000_000)
    ap.add_argument("--estimates", choices=("online", "profile"), default="online",
                    help="the simulator's estimates: the online cost model's (as live) or "
                    "the profile's per-action ones")
    ap.add_argument("--launch-s", default="auto", help="a command's start-up in the "
                    "simulator, seconds, or 'auto' (measured here first)")
    ap.add_argument("--launch-samples", type=int, default=200)
    args = ap.parse_args()
    for name, lo in (("trajectories", 1), ("repeats", 0), ("launch_samples", 1)):
        if getattr(args, name) < lo:
            ap.error(f"--{name.replace('_', '-')}: must be >= {lo}")
    if not args.scale > 0:
        ap.error("--scale: must be > 0")
    cores = sorted(os.sched_getaffinity(0))
    w, inst = scaled_step(args.profile, args.trajectories, args.scale, args.seed)
    if args.launch_s == "auto":
        launch_s = asyncio.run(measure_launch_s(cores, args.launch_samples))
    else:
        try:
            launch_s = float(args.launch_s)
        except ValueError:
            ap.error(f"--launch-s: must be 'auto' or seconds (got {args.launch_s!r})")
        if not launch_s >= 0:
            ap.error(f"--launch-s: must be >= 0 (got {launch_s})")
    cluster = ClusterConfig(name="local", cpu_nodes=1, cores_per_node=len(cores),
                            mem_gb_per_node=64.0, gpu_devices=0, gpu_mem_gb=0.0, endpoints={},
                            cpu_launch_s=launch_s)
    scheds = args.schedulers.split(",")
    for s in scheds:
        make_scheduler(resolve_scheduler(s))  # a bad name fails before anything runs
    n_actions = sum(len(t.turns) for t in inst.steps[0])
    print(f"{args.profile}: {args.trajectories} trajectories, {n_actions} actions, time x "
          f"{args.scale:g}, {len(cores)} cores, seed {args.seed}; simulator: {args.estimates} "
          f"estimates, command start-up {launch_s * 1e3:.2f} ms"
          f"{' (measured)' if args.launch_s == 'auto' else ''}; live: {args.repeats} "
          "runs, mean (min–max)")
    rows = []
    bar = tqdm(total=len(scheds) * args.repeats, desc="live runs", unit="run")
    for sched in scheds:
        s_act, s_step, s_failed = simulate(w, inst, cluster, sched, args.seed,
                                           args.estimates == "online")
        lives = []
        for _ in range(args.repeats):
            lives.append(asyncio.run(live(inst, cores, sched)))
            bar.update()
        if not lives:
            rows.append(f"| {sched} | {s_act:.4f} | – | – | {s_step:.2f} | – | – "
                        f"| {s_failed} / – | – |")
            continue
        acts, steps = [x[0] for x in lives], [x[1] for x in lives]
        rows.append(
            f"| {sched} | {s_act:.4f} | {spread(acts)} | {spread([a / s_act for a in acts])} "
            f"| {s_step:.2f} | {spread(steps)} | {spread([s / s_step for s in steps])} "
            f"| {s_failed} / {'-'.join(str(x[2]) for x in lives)} "
            f"| {spread([x[3] * 1e3 for x in lives])} |")
    bar.close()
    print("| scheduler | mean ACT s sim | live | live ÷ sim | step s sim | live | live ÷ sim "
          "| failed (timeouts) sim / live | start-up ms live |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
