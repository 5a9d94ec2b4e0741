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
simulated mean ACT and step time (with the live mean's 95% interval), then both by the
number of searches in a step and by action type.

Both sides measure the same thing, from a trace each (the replay records its own): the
ACT of every action the dispatcher ran for the trajectories (submission to finish:
queue wait and run; ``/run_code``'s write and run steps, searches with their quota
wait, the reward), and the step time, the first submission to the last finish of a
step's trajectories. The demonstration's own agent-side figures (an HTTP call's issue to
its answer) are printed beside them.

    python benchmarks/live_calibration.py [--seeds 0..15] [--trajectories 12]
        [--sim-seeds 40] [--scheduler checkpoints/default] [--out DIR] [--pause-s 0]
        [--trace TRACE]        # an existing trace: skip the live runs
"""

from __future__ import annotations

import argparse
import json
import math
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


def step_figures(trace: Path) -> list[dict]:
    """Per RL step of a recorded trace (live: the runs appended one after another; a
    simulated replay: its steps), as the dispatcher measures them: the mean ACT of the
    trajectories' actions, the step time (first submission to last finish), the number
    of API calls (searches), and each action type's ACTs."""
    from metasched.calibration.samples import read_samples
    from metasched.sim.trace import scan_trace

    steps = read_samples(trace).steps()
    windows = [(min(t.first_s for t in s), max(t.last_s for t in s)) for s in steps]
    tasks = [{r.task for r in s} for s in steps]
    out = [{"acts": [], "by_type": {}, "searches": 0} for _ in steps]
    for item in scan_trace(trace):
        m = item.measured
        if item.action is None or m is None or m.trajectory is None:
            continue
        t, spec = item.action.arrival_s, item.action.spec
        for i, (lo, hi) in enumerate(windows):
            if lo <= t <= hi and item.action.task in tasks[i]:
                act = m.queue_s + m.run_s
                out[i]["acts"].append(act)
                name = "reward" if spec.reward else spec.name
                out[i]["by_type"].setdefault(name, []).append(act)
                out[i]["searches"] += spec.kind == "api"
                break
    return [{"mean_act_s": float(np.mean(o["acts"])), "step_s": hi - lo,
             "actions": len(o["acts"]), "searches": o["searches"], "by_type": o["by_type"]}
            for o, (lo, hi) in zip(out, windows, strict=True)]


def replay(profile_dir: Path, name: str, scheduler: str, seeds: list[int], out: Path
           ) -> list[list[dict]]:
    """The calibrated profile simulated on its cluster with the dispatcher's online
    estimates, each seed recorded as a trace (``out``) and measured from it as the live
    runs are (:func:`step_figures`): per seed, its steps."""
    from metasched.agents.checkpoint import resolve_scheduler
    from metasched.compose import compose, load_profile
    from metasched.evaluation.recording import record_trace

    w, c = load_profile(compose("eval", [f"hydra.searchpath=[file://{profile_dir.resolve()}]",
                                         f"workload={name}"]))
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for s in tqdm(seeds, desc="simulated replays", unit="seed"):
        trace = out / f"replay.{s}.jsonl"
        trace.unlink(missing_ok=True)
        record_trace(w, c, trace, resolve_scheduler(scheduler), s, estimates="online")
        runs.append(step_figures(trace))
    return runs


def allowance(profile_dir: Path, name: str) -> int | None:
    """Calls one quota window admits on the calibrated cluster (its one endpoint)."""
    from metasched.compose import compose, load_profile

    _, c = load_profile(compose("eval", [f"hydra.searchpath=[file://{profile_dir.resolve()}]",
                                         f"workload={name}"]))
    eps = list(c.endpoints.values())
    return int(eps[0].req_capacity) if len(eps) == 1 else None


def stratified(live: list[dict], sim: list[dict], cap: int | None) -> list[str]:
    """Markdown rows: steps by their number of searches (each count, then at most and
    more than a window's allowance), live against the replay: how many steps, their
    mean step time and mean ACT."""
    def row(label: str, keep) -> str:
        lv = [r for r in live if keep(r["searches"])]
        sv = [r for r in sim if keep(r["searches"])]
        cells = [label]
        for rows, n_all in ((lv, len(live)), (sv, len(sim))):
            cells.append(f"{len(rows)} ({len(rows) / n_all:.0%})")
        for key in ("step_s", "mean_act_s"):
            a = np.mean([r[key] for r in lv]) if lv else math.nan
            b = np.mean([r[key] for r in sv]) if sv else math.nan
            cells += [f"{a:.2f}", f"{b:.2f}", f"{b / a:.3f}" if lv and sv else "–"]
        return "| " + " | ".join(cells) + " |"

    ks = sorted({r["searches"] for r in live} | {r["searches"] for r in sim})
    lines = ["| searches in the step | live steps | replayed steps | live step s | "
             "replayed step s | ÷ | live mean ACT s | replayed mean ACT s | ÷ |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [row(str(k), lambda x, k=k: x == k) for k in ks]
    if cap is not None:
        lines += [row(f"≤ {cap} (one window's allowance)", lambda x: x <= cap),
                  row(f"> {cap}", lambda x: x > cap)]
    return lines


def by_type(live: list[dict], sim: list[dict]) -> list[str]:
    """Markdown rows: mean ACT of each action type, pooled over steps, live against the
    replay."""
    names = sorted({n for r in live for n in r["by_type"]})
    lines = ["| action type | live actions | live mean ACT s | replayed mean ACT s | ÷ |",
             "|---|---|---|---|---|"]
    for n in names:
        lv = [x for r in live for x in r["by_type"].get(n, [])]
        sv = [x for r in sim for x in r["by_type"].get(n, [])]
        a, b = float(np.mean(lv)), float(np.mean(sv)) if sv else math.nan
        lines.append(f"| {n} | {len(lv)} | {a:.3f} | {b:.3f} | {b / a:.3f} |")
    return lines


def _seed_range(part: str) -> list[int]:
    """``"3"`` -> [3]; ``"0..15"`` -> 0 to 15 (both ends)."""
    lo, dots, hi = part.partition("..")
    if not dots:
        return [int(part)]
    if int(hi) < int(lo):
        raise ValueError(part)
    return list(range(int(lo), int(hi) + 1))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0..15",
                   help="the demonstration's seeds, one run each (commas, ranges A..B)")
    p.add_argument("--trajectories", type=int, default=12)
    p.add_argument("--sim-seeds", type=int, default=40)
    p.add_argument("--scheduler", default="checkpoints/default")
    p.add_argument("--out", type=Path, default=Path("outputs/live_calibration"))
    # Each demonstration run starts its own service, whose search quota starts full: the
    # trace says so (a cluster line per service start) and the calibrated profile
    # replays it (step_fresh_quotas), so the runs need no pause between them.
    p.add_argument("--pause-s", type=float, default=0.0,
                   help="seconds between live runs (default: 0)")
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
        seeds = [k for part in args.seeds.split(",") for k in _seed_range(part)]
    except ValueError:
        raise ConfigError("seeds", f"must be whole numbers or ranges A..B separated by "
                          f"commas (got {args.seeds!r})") from None
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
    live = step_figures(trace)
    name = "live"
    cal = run_calibrate({"trace": str(trace), "name": name, "out": str(args.out / "profile"),
                         "base": None, "plot": False, "quiet": True})
    seeds_ = list(range(EVAL_SEED_OFFSET, EVAL_SEED_OFFSET + args.sim_seeds))
    runs = replay(args.out / "profile", name, args.scheduler, seeds_, args.out / "replay")
    # One figure per seed (the mean over its steps), as the live side is one per run.
    sim = [{key: float(np.mean([st[key] for st in r])) for key in ("mean_act_s", "step_s")}
           for r in runs]
    sim_steps = [st for r in runs for st in r]
    print(f"\ntrace {trace}: {cal['actions']} actions, {cal['steps']} runs of "
          f"{cal['trajectories_per_step']} trajectories; scheduler {args.scheduler}; "
          f"replayed over {len(seeds_)} seeds of {cal['steps']} steps\n")
    print("| | live (mean of runs; range; 95% CI) | simulated replay (mean of seeds; 95% CI) "
          "| simulated ÷ live (the live CI's bounds) |")
    print("|---|---|---|---|")
    from metasched.evaluation.statistics import ci95

    strip = [{k: v for k, v in r.items() if k != "by_type"} for r in live]
    doc = {"trace": str(trace), "scheduler": args.scheduler, "live": strip, "demo": demo,
           "simulated": sim, "simulated_steps": [[{k: v for k, v in st.items()
                                                   if k != "by_type"} for st in r]
                                                 for r in runs]}
    for key, label in (("mean_act_s", "mean ACT (s)"), ("step_s", "step time (s)")):
        lv = [r[key] for r in live]
        sv = [r[key] for r in sim]
        lo, hi = ci95(sv)
        llo, lhi = ci95(lv)
        ratio = float(np.mean(sv) / np.mean(lv))
        doc[f"{key}_ratio"] = ratio
        doc[f"{key}_live_ci95"] = [llo, lhi]
        print(f"| {label} | {np.mean(lv):.3f} ({min(lv):.3f}–{max(lv):.3f}; {llo:.3f}–"
              f"{lhi:.3f}, ±{(lhi - llo) / 2 / np.mean(lv):.0%}) | {np.mean(sv):.3f} "
              f"({lo:.3f}–{hi:.3f}) | **{ratio:.3f}** ({np.mean(sv) / lhi:.3f}–"
              f"{np.mean(sv) / llo:.3f}) |")
    print("\nBy searches per step (live: the runs; replayed: every step of every seed):\n")
    print("\n".join(stratified(live, sim_steps, allowance(args.out / "profile", name))))
    print("\nBy action type (pooled over steps):\n")
    print("\n".join(by_type(live, sim_steps)))
    if demo:
        print(f"\nagent-side (the demonstration's own figures, issue to answer): mean ACT "
              f"{np.mean([d['mean_act_s'] for d in demo]):.3f} s, step "
              f"{np.mean([d['step_s'] for d in demo]):.3f} s")
    (args.out / "live_calibration.json").write_text(json.dumps(doc, indent=1))
    return doc


if __name__ == "__main__":
    main()
