"""Sim-to-live fidelity: the same workload instance in the simulator and, time-scaled,
through the live dispatcher on this machine.

Draws one RL step of a CPU-only profile (``coding`` by default) with ``--trajectories``
trajectories, scales every duration by ``--scale``, and runs it (a) in the simulator
on a cluster of this machine's cores and (b) live, ``--repeats`` times: one coroutine
per trajectory sleeps through each LLM generation gap, then submits the turn's action
and waits for its result (with its trajectory's ``prompt`` where the profile groups
trajectories, as the simulator's have it); the action is a command that sleeps for its
true duration at the granted core count (Amdahl, from ``OMP_NUM_THREADS``), so a grant
of more cores really shortens it. The profile's sandbox start-up is left out of the simulated side
(its delay is folded into the first generation gap); live, each command runs in its
trajectory's sandbox by default (``--isolation``: ``bwrap``, or ``off`` for commands on
the host without cgroups; several modes are run one after the other per scheduler).
Prints mean ACT and step time, simulated and live (mean and range over the repeats),
per scheduler and isolation, and each learned policy's live mean ACT and step time
against the best heuristic's (by live mean ACT): the ratio of means over the repeats and
its paired 95% interval (Fieller, ``metasched.evaluation.statistics``). The live runs go
in rounds, every scheduler once a round, so that run k of each met the same stretch of
the machine's load and the rounds pair.

    python benchmarks/live_replay.py [--profile coding] [--trajectories 16] [--scale 0.1]
        [--schedulers static,...,checkpoints/default] [--repeats 3] [--sim-runs 10]
        [--seed 1000000] [--estimates online|given] [--launch-s live|auto|<s>]
        [--launch-mean-s <s>] [--isolation bwrap,off] [--deadline-slack-s <s>]
        [--work sleep|spin] [--trace <file>]

Deadlines (``--deadline-slack-s S``): every action's caller waits its (scaled) timeout
plus ``S`` seconds: live, each request's ``deadline_s``; in the simulator, each action's
``start_by_s`` (its deadline less its timeout and the dispatcher's
``deadlines.margin_s``), so both clocks time-share an action still queued then
(``metasched.core.deadlines``). A time-shared command that sleeps is not slowed by
its neighbours as the simulator's shared cores slow it: ``--work spin`` makes each
command burn its duration in CPU time instead (its serial part in one process, its
parallel part in one process per granted core), so sharing stretches it live as in
simulation. Live, the lending of idle commands' cores (``deadlines.idle_share``) is off:
the simulator does not model it, and a sleeping stand-in would look idle.

The simulator is given what the dispatcher has: the online cost model's estimates
(``--estimates online``, the default: learned from measured durations, as live; the
profile's noisy per-action estimates only as the first hint; ``--estimates given``
gives both sides each action's profile estimate instead), the start-up of a command
on this machine, drawn per action in simulation from the log-normal with a measured
median and mean: ``live`` (the default) pools every command's start-up in the live runs
of every scheduler, per isolation mode, and simulates after them (one figure of the
machine over the same stretch of its load, the same for every scheduler); ``auto``
measures, before each scheduler's simulated runs, about ``--launch-samples`` do-nothing
commands of the same form, submitted as the replay submits its actions, in
trajectories' sandboxes (on a loaded machine such a probe meets a different stretch of
load than the live runs do, and its tail differs by up to 3x), and the
workload's expected demand per task (for ``static`` and ``task_isolated``). One
instance of a step is chaotic: a few ms more or less on one action reorders the queue
behind it, so the simulator's figure is the mean of ``--sim-runs`` runs that differ in
their start-up draws, as live runs differ.

A scheduler that reads the learned remaining-work predictor (``estimates: predictor``:
``metasched.agents.PREDICTED``, ``learned_priority``) gets the one an evaluation fits
for the profile (``metasched.evaluation.predictors``: training seed 0's trajectories,
never the replayed seed, which may then not be 0), fitted on those trajectories
time-scaled by ``--scale`` as the replay is (its trees split on absolute log times: a
model fitted unscaled would misread a scaled run), and ``learned_priority`` its ranker
fitted on the same. Each simulated run gets a fresh copy of its online state, and so
does each live run's dispatcher (``Dispatcher(..., predictor=...)``), which updates it
online with measured runs, generation gaps, trajectory ends and, on a grouped profile,
the prompt groups the requests name.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import time
from dataclasses import replace

import numpy as np
from tqdm import tqdm

from metasched.agents import BASELINES, make_scheduler
from metasched.agents.checkpoint import resolve_scheduler
from metasched.compose import profile
from metasched.core.actions import Turn, amdahl_run_s
from metasched.core.cluster_config import ClusterConfig
from metasched.core.cost_model import CostModel
from metasched.core.predictor import Predictor
from metasched.core.scheduler import Scheduler
from metasched.errors import ConfigError
from metasched.evaluation.predictors import TRAIN_SEED, fitted_predictor, fitted_ranker
from metasched.evaluation.statistics import paired_comparison
from metasched.runtime.dispatch import Dispatcher, DispatcherConfig
from metasched.runtime.dispatch.deadline_config import DeadlineConfig
from metasched.runtime.sandbox.config import SandboxConfig
from metasched.sim.sampling import TrajectorySpec, WorkloadInstance, sample_workload
from metasched.sim.simulator import Simulator
from metasched.sim.workload_config import WorkloadConfig

MAX_WAIT_S = 300.0  # the dispatcher's default guard, on both sides


def scaled_step(profile_name: str, n: int, scale: float, seed: int):
    """One step of ``n`` trajectories, every duration times ``scale``, no sandboxes (the
    prompts kept: a grouped profile's siblings share theirs, live as in simulation)."""
    w, _ = profile(profile_name)
    w = replace(w, trajectories_per_step=n, steps=1)
    inst = sample_workload(w, np.random.default_rng(seed))
    trajs = []
    for t in inst.steps[0]:
        turns = []
        for i, turn in enumerate(t.turns):
            a = turn.action
            if a.kind != "cpu":
                raise ConfigError("profile", f"live replay runs cpu actions only "
                                  f"({profile_name} has a {a.kind} action)")
            gen = turn.gen_s
            if i == 0 and t.sandbox is not None:
                gen = max(gen, t.sandbox.startup_s)  # start-up overlaps the first gap
            turns.append(Turn(gen * scale, replace(
                a, true_s=a.true_s * scale, est_s=a.est_s * scale,
                timeout_s=a.timeout_s * scale)))
        trajs.append(TrajectorySpec(t.task, tuple(turns), None, t.prompt))
    return w, WorkloadInstance(steps=[trajs])


def amdahl_sleep(base_s: float, p: float) -> list[str]:
    """A command sleeping ``base_s x ((1 - p) + p / k)`` for ``k`` = its granted cores."""
    b, q = int(base_s * 1e6), int(round(p * 1000))
    script = (f't=$(( {b} * (1000 - {q}) / 1000 + {b} * {q} / 1000 / OMP_NUM_THREADS )); '
              'exec sleep "$((t / 1000000)).$(printf %06d $((t % 1000000)))"')
    return ["/bin/sh", "-c", script]


def amdahl_spin(base_s: float, p: float) -> list[str]:
    """A command burning ``base_s x (1 - p)`` CPU seconds in one process, then
    ``base_s x p / k`` in each of ``k`` processes (``k``: its granted cores): its wall time
    is ``amdahl_run_s`` on cores of its own, longer on cores it shares."""
    script = (
        "import os, time\n"
        "def spin(s):\n"
        "    end = time.process_time() + s\n"
        "    while time.process_time() < end:\n"
        "        pass\n"
        f"b, p = {base_s!r}, {p!r}\n"
        "k = int(os.environ.get('OMP_NUM_THREADS', '1'))\n"
        "spin(b * (1 - p))\n"
        "kids = [pid for pid in (os.fork() for _ in range(k - 1)) if pid]\n"
        "if len(kids) < k - 1:\n"
        "    spin(b * p / k)\n"
        "    os._exit(0)\n"
        "spin(b * p / k)\n"
        "for pid in kids:\n"
        "    os.waitpid(pid, 0)\n")
    return ["python3", "-c", script]


def with_deadlines(inst: WorkloadInstance, slack_s: float | None) -> WorkloadInstance:
    """``inst`` with every action's latest start (``start_by_s``) for callers who wait
    its timeout plus ``slack_s`` (None: ``inst`` itself), as the dispatcher computes it
    from the request's ``deadline_s``."""
    if slack_s is None:
        return inst
    margin = DeadlineConfig().margin_s
    steps = [[TrajectorySpec(t.task, tuple(
        Turn(turn.gen_s, replace(turn.action, start_by_s=slack_s - margin), turn.together,
             turn.chained, turn.same_turn) for turn in t.turns), t.sandbox, t.prompt)
        for t in step] for step in inst.steps]
    return WorkloadInstance(steps=steps, independent=inst.independent)


def dispatcher_cost_model() -> CostModel:
    """A cost model with the dispatcher's default settings."""
    d = {n: f.default for n, f in DispatcherConfig.model_fields.items()}
    return CostModel(d["cost_alpha"], d["default_est_s"])


def fed(sched: str, train: WorkloadConfig | None, scale: float
        ) -> tuple[Scheduler, Predictor | None]:
    """A fresh ``sched`` and, where it reads one, the predictor an evaluation fits for
    profile workload ``train`` (on training seed ``TRAIN_SEED``'s trajectories),
    time-scaled by ``scale`` as the replay is, with online state of its own (and
    ``learned_priority``'s ranker, fitted on the same)."""
    s = make_scheduler(resolve_scheduler(sched))
    if getattr(s, "estimates", None) != "predictor":
        return s, None
    if train is None:
        raise ConfigError("schedulers", f"{sched} reads the predictor: no workload to fit "
                          "it for")
    if getattr(s, "ranker", False) is None:  # a learned priority, not yet fitted
        s.ranker = fitted_ranker(train, scale)
    return s, fitted_predictor(train, scale)


def simulate(w, inst, cluster: ClusterConfig, sched: str, seed: int, online: bool,
             train: WorkloadConfig | None = None, scale: float = 1.0
             ) -> tuple[float, float, int]:
    """Mean ACT, step time and failures of one simulated run (``seed``: the scheduler's
    and the start-up draws' generators; the instance is fixed; ``train``: the profile
    workload a predictor-fed scheduler's predictor is fitted for, at ``scale``)."""
    s, predictor = fed(sched, train, scale)
    sim = Simulator(w, cluster, seed, instance=inst, max_wait_s=MAX_WAIT_S,
                    cost_model=dispatcher_cost_model() if online else None,
                    predictor=predictor)
    r = sim.run(s)
    shared = sim.deadlines.fired if sim.deadlines is not None else 0
    return float(r.act.mean()), float(r.step_s[0]), int(r.counters["failed"]), shared


def sandbox_config(isolation: str) -> SandboxConfig:
    """The dispatcher's sandbox settings for an ``--isolation`` mode."""
    return (SandboxConfig(isolation="none", cgroups="none") if isolation == "off"
            else SandboxConfig(isolation=isolation))


async def measure_launch_s(inst: WorkloadInstance, cores: list[int], n: int,
                           isolation: str) -> tuple[float, float]:
    """Median and mean run time of about ``n`` do-nothing commands of the replay's form,
    on this machine now, submitted as the replay submits: one coroutine per trajectory
    sleeps through its first generation gaps and submits a do-nothing command after
    each, each in its trajectory's sandbox. (Commands started one after another, with
    nothing else going on, start faster and with a far lighter tail than commands that
    start after idle spells, several at once, on a loaded machine.)"""
    trajs = inst.steps[0]
    per = -(-n // len(trajs))
    cfg = DispatcherConfig(scheduler="fifo", cores=cores, sandbox=sandbox_config(isolation))
    runs: list[float] = []
    async with Dispatcher(cfg) as d:

        async def trajectory(i: int, spec: TrajectorySpec) -> None:
            for k, turn in enumerate(spec.turns[:per]):
                await asyncio.sleep(turn.gen_s)
                r = await d.submit({"kind": "cpu", "argv": amdahl_sleep(0.0, 0.0),
                                    "timeout_s": 10.0, "name": "launch",
                                    "trajectory": f"launch-{i}", "turn": k})
                if r.status != "done":
                    raise ConfigError("isolation", f"{isolation}: a do-nothing command "
                                      f"failed: {r.reason}")
                runs.append(r.finished_at - r.started_at)

        await asyncio.gather(*(trajectory(i, s) for i, s in enumerate(trajs)))
    return float(np.median(runs)), float(np.mean(runs))


def sigma_from_mean(median_s: float, mean_s: float) -> float:
    """The sigma of the log-normal with this median and mean (its mean is
    median x exp(sigma² / 2)): the mean start-up, tail included, is what mean ACT feels."""
    return math.sqrt(2.0 * math.log(mean_s / median_s)) if mean_s > median_s > 0 else 0.0


async def live(inst, cores: list[int], sched: str, online: bool, isolation: str,
               slack_s: float | None = None, work: str = "sleep",
               train: WorkloadConfig | None = None, scale: float = 1.0,
               trace: str | None = None) -> tuple[float, float, int, float, float]:
    """Mean ACT, step time, failures, the median and mean start-up of a command (its
    measured run less the sleep it was asked for) and every command's start-up, of one
    live run (``train``, ``scale``: as :func:`simulate`'s; the dispatcher updates the
    predictor online; ``trace``: a file the dispatcher appends the run's actions to)."""
    cfg = DispatcherConfig(scheduler=sched, cores=cores, sample_interval_s=0.5,
                           max_wait_s=MAX_WAIT_S, task_demand=inst.demand_by_task(),
                           estimates="online" if online else "given",
                           sandbox=sandbox_config(isolation),
                           deadlines=DeadlineConfig(idle_share=False), trace=trace)
    command = amdahl_spin if work == "spin" else amdahl_sleep
    s, predictor = fed(sched, train, scale)
    given = s if getattr(s, "ranker", None) is not None else None  # learned_priority's
    async with Dispatcher(cfg, scheduler=given, predictor=predictor) as d:
        if d.fallback_reason:
            raise ConfigError("schedulers", f"{sched}: {d.fallback_reason}")

        startup: list[float] = []

        async def trajectory(i: int, spec: TrajectorySpec) -> None:
            for k, turn in enumerate(spec.turns):
                await asyncio.sleep(turn.gen_s)
                a = turn.action
                deadline = {} if slack_s is None else {"deadline_s": a.timeout_s + slack_s}
                r = await d.submit({
                    **deadline,
                    "kind": "cpu", "argv": command(a.true_s, a.parallel_fraction),
                    "timeout_s": a.timeout_s, "min_cores": a.min_cores,
                    "max_cores": a.max_cores, "parallel_fraction": a.parallel_fraction,
                    "est_s": a.est_s, "task": spec.task, "name": a.name,
                    "trajectory": f"t{i}", "prompt": spec.prompt, "turn": k,
                    "reward": a.reward})
                if r.status == "done" and not r.allocation.get("shared"):
                    # (a time-shared command's run is stretched by its neighbours)
                    k = len(r.allocation["cores"])
                    startup.append(r.finished_at - r.started_at
                                   - amdahl_run_s(a.true_s, a.parallel_fraction, k))

        t0 = time.perf_counter()
        await asyncio.gather(*(trajectory(i, s) for i, s in enumerate(inst.steps[0])))
        step = time.perf_counter() - t0
    r = d.run_result()
    return (float(r.act.mean()), step, int(r.counters["failed"]), float(np.median(startup)),
            float(np.mean(startup)), startup, d.stats()["deadline_shared"])


def spread(xs: list[float], digits: int = 3) -> str:
    """Mean (min-max) of several runs."""
    if len(xs) == 1:
        return f"{xs[0]:.{digits}f}"
    return f"{np.mean(xs):.{digits}f} ({min(xs):.{digits}f}–{max(xs):.{digits}f})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="coding")
    ap.add_argument("--trajectories", type=int, default=16)
    ap.add_argument("--scale", type=float, default=0.1, help="time scale (live seconds per "
                    "simulated second)")
    ap.add_argument("--schedulers", default=",".join([*BASELINES, "checkpoints/default"]))
    ap.add_argument("--repeats", type=int, default=3, help="live runs per scheduler (0: "
                    "simulate only)")
    ap.add_argument("--sim-runs", type=int, default=10, help="simulated runs per scheduler "
                    "(start-up draws and the scheduler's generator differ; the instance not)")
    ap.add_argument("--seed", type=int, default=1_000_000)
    ap.add_argument("--estimates", default="online",
                    help="estimates on both sides: the online cost model's (the "
                    "dispatcher's default) or the profile's per-action ones (live: each "
                    "request's est_s, estimates='given')")
    ap.add_argument("--launch-s", default="live", help="a command's start-up in the "
                    "simulator (median), seconds; 'live': pooled from every scheduler's "
                    "live runs; 'auto': measured by a probe before each scheduler's "
                    "simulated runs")
    ap.add_argument("--launch-mean-s", type=float, default=None, help="its mean with a "
                    "given --launch-s (log-normal; default: constant)")
    ap.add_argument("--launch-samples", type=int, default=200)
    ap.add_argument("--isolation", default="bwrap",
                    help="comma-separated: bwrap, none, off (no isolation, no cgroups)")
    ap.add_argument("--deadline-slack-s", type=float, default=None, help="every caller "
                    "waits its action's timeout plus this (default: no deadlines)")
    ap.add_argument("--work", default="sleep", choices=("sleep", "spin"),
                    help="live commands sleep or burn CPU for their duration")
    ap.add_argument("--trace", default=None, help="append every live run's actions to this "
                    "trace (JSONL, the dispatcher's trace=)")
    args = ap.parse_args(argv)
    try:
        return replay(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def replay(args: argparse.Namespace) -> int:
    """Check the arguments, run the table, print it; 0 when done."""
    for name, lo in (("trajectories", 1), ("repeats", 0), ("sim_runs", 1),
                     ("launch_samples", 1)):
        if getattr(args, name) < lo:
            raise ConfigError(name.replace("_", "-"), f"must be >= {lo}")
    if not args.scale > 0:
        raise ConfigError("scale", f"must be > 0 (got {args.scale:g})")
    modes = args.isolation.split(",")
    for m in modes:
        if m not in ("bwrap", "none", "off"):
            raise ConfigError("isolation", f"{m!r} is not one of bwrap, none, off")
    if args.estimates not in ("online", "given"):
        raise ConfigError("estimates", f"must be online or given (got {args.estimates!r})")
    fixed = None
    if args.launch_s == "live" and args.repeats == 0:
        raise ConfigError("launch-s", "'live' needs live runs (--repeats >= 1); give "
                          "seconds or 'auto'")
    if args.launch_s not in ("auto", "live"):
        try:
            fixed = float(args.launch_s)
        except ValueError:
            raise ConfigError("launch-s", f"must be 'live', 'auto' or seconds (got "
                              f"{args.launch_s!r})") from None
        mean = fixed if args.launch_mean_s is None else args.launch_mean_s
        if not 0 <= fixed <= mean:
            raise ConfigError("launch-mean-s", "need 0 <= launch-s <= launch-mean-s")
        fixed = (fixed, mean)
    if args.deadline_slack_s is not None and not args.deadline_slack_s > 0:
        raise ConfigError("deadline-slack-s", f"must be > 0 (got {args.deadline_slack_s:g})")
    cores = sorted(os.sched_getaffinity(0))
    w, inst = scaled_step(args.profile, args.trajectories, args.scale, args.seed)
    sim_inst = with_deadlines(inst, args.deadline_slack_s)
    base = ClusterConfig(name="local", cpu_nodes=1, cores_per_node=len(cores),
                         mem_gb_per_node=64.0, gpu_devices=0, gpu_mem_gb=0.0, endpoints={})
    scheds = args.schedulers.split(",")
    # (A bad name fails before anything runs.) A scheduler that reads the predictor
    # gets the one an evaluation of the profile fits, for the replay's time scale.
    reads = [getattr(make_scheduler(resolve_scheduler(s)), "estimates", None) == "predictor"
             for s in scheds]  # as an evaluation asks (PREDICTED, learned_priority)
    train = profile(args.profile)[0] if any(reads) else None
    if train is not None:
        if args.seed == TRAIN_SEED:
            raise ConfigError("seed", f"{TRAIN_SEED} is the predictor's training seed: "
                              "replay another")
        fitted_predictor(train, args.scale)  # fitted once, before any run
    n_actions = sum(len(t.turns) for t in inst.steps[0])
    slack = args.deadline_slack_s
    dl = "none" if slack is None else f"timeout + {slack:g} s"
    print(f"{args.profile}: {args.trajectories} trajectories, {n_actions} actions, time x "
          f"{args.scale:g}, {len(cores)} cores, seed {args.seed}; simulator: {args.estimates} "
          f"estimates, {args.sim_runs} runs; live: {args.repeats} runs ({args.work}); "
          f"deadlines: {dl}; mean (min–max)")
    print("| scheduler | isolation | mean ACT s sim | live | live ÷ sim | step s sim | live "
          "| live ÷ sim | failed (timeouts) sim / live | start-up ms sim (median / mean) "
          "| start-up ms live (median / mean) | at their latest start sim / live |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    bar = tqdm(total=len(scheds) * len(modes) * (args.sim_runs + args.repeats), desc="runs",
               unit="run")
    keys = [(sched, mode) for sched in scheds for mode in modes]
    sims: dict[tuple[str, str], list] = {key: [] for key in keys}
    launch: dict[tuple[str, str], tuple[float, float]] = {}
    lives: dict[tuple[str, str], list] = {key: [] for key in keys}

    def simulate_all() -> None:
        pooled: dict[str, tuple[float, float]] = {}
        if args.launch_s == "live":
            for mode in modes:
                xs = [x for s in scheds for run in lives[s, mode] for x in run[5]]
                pooled[mode] = float(np.median(xs)), float(np.mean(xs))
        for sched, mode in keys:
            if args.launch_s == "live":
                median, mean = pooled[mode]
            else:
                median, mean = fixed or asyncio.run(measure_launch_s(
                    inst, cores, args.launch_samples, mode))
            launch[sched, mode] = median, mean
            cluster = replace(base, cpu_launch_s=median,
                              cpu_launch_sigma=sigma_from_mean(median, mean))
            for i in range(args.sim_runs):
                sims[sched, mode].append(simulate(w, sim_inst, cluster, sched, args.seed + i,
                                                  args.estimates == "online", train,
                                                  args.scale))
                bar.update()

    if args.launch_s != "live":
        simulate_all()
    # Live runs in rounds, every scheduler once a round: run k of two schedulers met the
    # same stretch of the machine's load, so they pair.
    for _ in range(args.repeats):
        for sched, mode in keys:
            lives[sched, mode].append(asyncio.run(live(
                inst, cores, sched, args.estimates == "online", mode, args.deadline_slack_s,
                args.work, train, args.scale, args.trace)))
            bar.update()
    if args.launch_s == "live":
        simulate_all()
    bar.close()
    for sched in scheds:
        for mode in modes:
            print(row(sched, mode, sims[sched, mode], lives[sched, mode], *launch[sched, mode]))
    for mode in modes:
        line = paired_line(scheds, mode, lives)
        if line:
            print(line)
    return 0


def paired_line(scheds: list[str], mode: str, lives: dict[tuple[str, str], list]) -> str:
    """Each learned policy's live mean ACT and step time against the best heuristic's
    (by live mean ACT), paired by round: ratio of means and its 95% interval."""
    heuristics = [s for s in scheds if s in BASELINES and len(lives[s, mode]) >= 2]
    if not heuristics:
        return ""
    best = min(heuristics, key=lambda s: np.mean([x[0] for x in lives[s, mode]]))
    out = []
    for s in scheds:
        if s in BASELINES or len(lives[s, mode]) < 2:
            continue
        act = paired_comparison([x[0] for x in lives[s, mode]], [x[0] for x in lives[best, mode]])
        step = paired_comparison([x[1] for x in lives[s, mode]],
                                 [x[1] for x in lives[best, mode]])
        out.append(f"{s} ÷ {best} (the best heuristic live, {mode}), {len(lives[s, mode])} "
                   f"paired rounds: mean ACT {act['ratio']:.3f} (95% CI "
                   f"{act['ratio_ci95'][0]:.3f}–{act['ratio_ci95'][1]:.3f}), step "
                   f"{step['ratio']:.3f} ({step['ratio_ci95'][0]:.3f}–"
                   f"{step['ratio_ci95'][1]:.3f})")
    return "\n".join(out)


def row(sched: str, mode: str, sims: list, lives: list, median: float, mean: float) -> str:
    """One line of the table: simulated runs, live runs and the start-up used."""
    s_act, s_step = float(np.mean([x[0] for x in sims])), float(np.mean([x[1] for x in sims]))
    cells = [spread([x[0] for x in sims], 4), "–", "–", spread([x[1] for x in sims], 2),
             "–", "–", f"{'-'.join(str(x[2]) for x in sims)} / –",
             f"{median * 1e3:.2f} / {mean * 1e3:.2f}", "–",
             f"{'-'.join(str(x[3]) for x in sims)} / –"]
    if lives:
        acts, steps = [x[0] for x in lives], [x[1] for x in lives]
        cells[1:3] = [spread(acts, 4), spread([a / s_act for a in acts])]
        cells[4:6] = [spread(steps, 2), spread([s / s_step for s in steps])]
        cells[6] = (f"{'-'.join(str(x[2]) for x in sims)} / "
                    f"{'-'.join(str(x[2]) for x in lives)}")
        cells[8] = (f"{spread([x[3] * 1e3 for x in lives], 2)} / "
                    f"{spread([x[4] * 1e3 for x in lives], 2)}")
        cells[9] = (f"{'-'.join(str(x[3]) for x in sims)} / "
                    f"{'-'.join(str(x[6]) for x in lives)}")
    return f"| {sched} | {mode} | " + " | ".join(cells) + " |"


if __name__ == "__main__":
    sys.exit(main())
