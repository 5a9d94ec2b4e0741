"""Live run -> trace -> calibrated profile -> simulated replay, and how close the replay
comes to the live run.

Runs the live demonstration (``examples/agent_rollout.py --mode metasched``: N agent
trajectories through ``metasched-serve``, Python programs and test runs via ``/run_code``,
searches through the quota proxy to a local server that answers 429 past its quota, a
torch reward model on the CPU stand-in GPU) once per ``--seeds`` entry, every run
appending to one trace (``--trace``); calibrates the trace (``metasched-calibrate``);
then simulates the calibrated profile on the cluster the trace records (this machine's
cores, the stand-in GPU and its service, the proxy's quota) with the same scheduler and
the dispatcher's online estimates, over ``--sim-seeds`` seeds, and prints live against
simulated mean ACT and step time.

Both sides measure the same thing: the ACT of every action the dispatcher ran for the
trajectories (submission to finish, as the dispatcher records it: queue wait and run;
``/run_code``'s write and run steps, searches with their quota wait, the reward), and
the step time, the first submission to the last finish of a run's trajectories. The
demonstration's own agent-side figures (an HTTP call's issue to its answer) are printed
beside them.

    python benchmarks/live_calibration.py [--seeds 0,1,2,3,4,5,6,7] [--trajectories 12]
        [--sim-seeds 40] [--scheduler checkpoints/default] [--out DIR]
        [--trace TRACE]        # an existing trace: skip the live runs
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from metasched.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "examples" / "agent_rollout.py"


def live_runs(trace: Path, seeds: list[int], trajectories: int, scheduler: str,
              out: Path, pause_s: float = 0.0) -> list[dict]:
    """Run the demonstration once per seed, appending to ``trace``, ``pause_s`` apart;
    its results."""
    results = []
    for i, s in enumerate(tqdm(seeds, desc="live runs", unit="run")):
        if i:
            time.sleep(pause_s)
        res = out / f"demo.seed{s}.json"
        cmd = [sys.executable, str(DEMO), "--mode", "metasched", "--seed", str(s),
               "--trajectories", str(trajectories), "--scheduler", scheduler,
               "--trace", str(trace), "--out", str(res)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            sys.exit(f"error: the demonstration failed (seed {s}): {p.stderr[-2000:]}")
        results.append(json.loads(res.read_text())["metasched"])
    return results


def live_figures(trace: Path) -> list[dict[str, float]]:
    """Per run (an RL step of the trace: runs appended one after the other), the mean
    ACT of the trajectories' actions and the step time, as the dispatcher measured them."""
    from metasched.calibration.samples import read_samples
    from metasched.sim.trace import scan_trace

    steps = read_samples(trace).steps()
    windows = [(min(t.first_s for t in s), max(t.last_s for t in s)) for s in steps]
    acts: list[list[float]] = [[] for _ in steps]
    for item in scan_trace(trace):
        m = item.measured
        if item.action is None or m is None or m.trajectory is None:
            continue
        t = item.action.arrival_s
        for i, (lo, hi) in enumerate(windows):
            if lo <= t <= hi and item.action.task in {r.task for r in steps[i]}:
                acts[i].append(m.queue_s + m.run_s)
                break
    return [{"mean_act_s": float(np.mean(a)), "step_s": hi - lo, "actions": len(a)}
            for a, (lo, hi) in zip(acts, windows, strict=True)]


def replay(profile_dir: Path, name: str, scheduler: str, seeds: list[int]
           ) -> list[dict[str, float]]:
    """The calibrated profile simulated on its cluster, one figure per seed and step."""
    from metasched.agents import make_scheduler
    from metasched.agents.checkpoint import resolve_scheduler
    from metasched.compose import compose, load_profile
    from metasched.sim.simulator import Simulator, cost_model_for

    w, c = load_profile(compose("eval", [f"hydra.searchpath=[file://{profile_dir.resolve()}]",
                                         f"workload={name}"]))
    out = []
    for s in tqdm(seeds, desc="simulated replays", unit="seed"):
        r = Simulator(w, c, s, max_wait_s=300.0, cost_model=cost_model_for("online")).run(
            make_scheduler(resolve_scheduler(scheduler)))
        out.append({"mean_act_s": float(r.act.mean()), "step_s": float(r.step_s.mean())})
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0,1,2,3,4,5,6,7",
                   help="the demonstration's seeds, one run each")
    p.add_argument("--trajectories", type=int, default=12)
    p.add_argument("--sim-seeds", type=int, default=40)
    p.add_argument("--scheduler", default="checkpoints/default")
    p.add_argument("--out", type=Path, default=Path("outputs/live_calibration"))
    # Each demonstration run starts its own service, whose search quota starts full; a
    # pause of one quota window between runs (60 s, and the proxy's margin) puts that in
    # the trace too: the calibrated pause between steps then starts every replayed step
    # with a full window, as live. Runs closer together would each start with a full
    # quota live but with the last step's burst still counted in the replay.
    p.add_argument("--pause-s", type=float, default=61.0,
                   help="seconds between live runs (default: one quota window)")
    p.add_argument("--trace", type=Path, default=None,
                   help="an existing trace of the demonstration: skip the live runs")
    args = p.parse_args(argv)
    try:
        return run(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def run(args: argparse.Namespace) -> dict:
    from metasched.cli.calibrate_app import run_calibrate
    from metasched.sim.seeds import EVAL_SEED_OFFSET

    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        raise ConfigError("seeds", f"must be whole numbers separated by commas (got "
                          f"{args.seeds!r})") from None
    if args.trajectories < 1:
        raise ConfigError("trajectories", f"must be >= 1 (got {args.trajectories})")
    if args.pause_s < 0:
        raise ConfigError("pause-s", f"must be >= 0 (got {args.pause_s:g})")
    if args.sim_seeds < 2:
        raise ConfigError("sim-seeds", f"must be >= 2 (got {args.sim_seeds})")
    if args.trace is not None and not args.trace.is_file():
        raise ConfigError("trace", f"{args.trace}: no such file")

    args.out.mkdir(parents=True, exist_ok=True)
    demo = []
    if args.trace is None:
        trace = args.out / "live.jsonl"
        trace.unlink(missing_ok=True)
        demo = live_runs(trace, seeds, args.trajectories, args.scheduler, args.out,
                         args.pause_s)
    else:
        trace = args.trace
    live = live_figures(trace)
    name = "live"
    cal = run_calibrate(argparse.Namespace(trace=str(trace), name=name,
                                           out=str(args.out / "profile"), base=None,
                                           no_plot=True, quiet=True))
    sim = replay(args.out / "profile", name,
                 args.scheduler, list(range(EVAL_SEED_OFFSET, EVAL_SEED_OFFSET + args.sim_seeds)))
    rows = []
    print(f"\ntrace {trace}: {cal['actions']} actions, {cal['steps']} runs of "
          f"{cal['trajectories_per_step']} trajectories; scheduler {args.scheduler}\n")
    print("| | live (mean of runs; range) | simulated replay (mean of seeds; 95% CI) | "
          "simulated ÷ live |")
    print("|---|---|---|---|")
    from metasched.evaluation.statistics import ci95

    doc = {"trace": str(trace), "scheduler": args.scheduler, "live": live, "demo": demo,
           "simulated": sim}
    for key, label in (("mean_act_s", "mean ACT (s)"), ("step_s", "step time (s)")):
        lv = [r[key] for r in live]
        sv = [r[key] for r in sim]
        lo, hi = ci95(sv)
        ratio = float(np.mean(sv) / np.mean(lv))
        doc[f"{key}_ratio"] = ratio
        rows.append(f"| {label} | {np.mean(lv):.3f} ({min(lv):.3f}–{max(lv):.3f}) | "
                    f"{np.mean(sv):.3f} ({lo:.3f}–{hi:.3f}) | {ratio:.3f} |")
    print("\n".join(rows))
    if demo:
        print(f"\nagent-side (the demonstration's own figures, issue to answer): mean ACT "
              f"{np.mean([d['mean_act_s'] for d in demo]):.3f} s, step "
              f"{np.mean([d['step_s'] for d in demo]):.3f} s")
    (args.out / "live_calibration.json").write_text(json.dumps(doc, indent=1))
    return doc


if __name__ == "__main__":
    main()
