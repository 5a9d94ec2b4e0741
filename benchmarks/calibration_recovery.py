"""Recovery: a known profile traced by the simulator and calibrated back, over seeds.

Samples the known profile of the recovery test (``tests/data/recovery_profile.yaml``:
every action kind, core counts that vary, a type killed at its timeout), records one
trace per seed with the simulator (``record_trace``: queue waits, allocations, batches,
timeouts), calibrates each with ``metasched-calibrate`` and prints, per fitted parameter,
the profile's value, the range fitted over the seeds and the largest error beside the
tolerance the test states (5% for medians, p90s and turns; 0.05 for Amdahl fractions).

    python benchmarks/calibration_recovery.py [--seeds 5] [--seed-offset 0] [--scheduler random]
    python benchmarks/calibration_recovery.py --profile coding --scheduler elastic_greedy

``--profile`` traces a shipped profile on its own cluster instead (its small action
types hold too few runs for the test's tolerances: the table shows how far they get).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

from metasched.cli.calibrate_app import run_calibrate
from metasched.compose import profile
from metasched.core.cluster_config import parse_cluster
from metasched.evaluation.recording import record_trace
from metasched.sim.workload_config import parse_workload

ROOT = Path(__file__).resolve().parent.parent
PROFILE = ROOT / "tests" / "data" / "recovery_profile.yaml"
CLUSTER = {"name": "recovery", "cpu": {"nodes": 2, "cores_per_node": 32, "mem_gb_per_node": 64},
           "gpu": {"devices": 1, "mem_gb": 24},
           "api": {"endpoints": {"web": {"rpm": 1200, "max_concurrency": 32}}}}


def parameters(w) -> dict[str, tuple[float, str]]:
    """Every checked parameter of a parsed profile: value and how it is compared."""
    out: dict[str, tuple[float, str]] = {}
    for t in w.tasks:
        for label, a in [(f"{t.name}/{a.name}", a) for a in t.actions] + [
                (f"{t.name}/reward", t.reward)]:
            q = a.duration_s.quantile(np.array([0.5, 0.9]))
            out[f"{label} median s"] = (float(q[0]), "rel")
            out[f"{label} p90 s"] = (float(q[1]), "rel")
            if a.kind == "cpu" and a.max_cores > a.min_cores:
                out[f"{label} Amdahl p"] = (a.parallel_fraction, "abs")
        for name, d in (("turns", t.turns), ("generation gap s", t.generation_s)):
            q = d.quantile(np.array([0.5, 0.9]))
            out[f"{t.name} {name} median"] = (float(q[0]), "rel")
            out[f"{t.name} {name} p90"] = (float(q[1]), "rel")
        out[f"{t.name} share"] = (t.share, "abs")
    out["estimate error sigma"] = (w.estimate_error, "abs")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--seed-offset", type=int, default=0)
    ap.add_argument("--scheduler", default="random")
    ap.add_argument("--profile", help="a shipped profile instead of the known one")
    args = ap.parse_args()
    if args.profile:
        truth, cluster = profile(args.profile)
    else:
        truth = parse_workload(yaml.safe_load(PROFILE.read_text()))
        cluster = parse_cluster(CLUSTER)
    want = parameters(truth)
    fitted: dict[str, list[float]] = {k: [] for k in want}
    n_runs: dict[str, list[int]] = {}
    own: dict[str, list[float]] = {}  # relative error against the trace's own sample
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seed_offset, args.seed_offset + args.seeds):
            trace = Path(tmp) / f"trace-{seed}.jsonl"
            t0 = time.perf_counter()
            _, n = record_trace(truth, cluster, trace, scheduler=args.scheduler, seed=seed)
            t1 = time.perf_counter()
            out = Path(tmp) / f"out-{seed}"
            run_calibrate({"trace": str(trace), "name": "rec", "out": str(out),
                           "quiet": True, "plot": False})
            t2 = time.perf_counter()
            times.append((n, t1 - t0, t2 - t1))
            got = parameters(parse_workload(yaml.safe_load(
                (out / "workload" / "rec.yaml").read_text())))
            for k in want:
                fitted[k].append(got[k][0] if k in got else float("nan"))
            # The sample's own quantiles (the simulator writes true durations): what a
            # perfect fit of this trace would give, apart from sampling.
            durations: dict[str, list[float]] = {}
            for line in trace.read_text().splitlines()[1:]:
                row = json.loads(line)
                a = row["action"]
                label = f"{row['task']}/{'reward' if a.get('reward') else a['name']}"
                durations.setdefault(label, []).append(a["duration_s"])
            for label, xs in durations.items():
                for q, name in ((0.5, "median"), (0.9, "p90")):
                    k = f"{label} {name} s"
                    if k in fitted:
                        own.setdefault(k, []).append(fitted[k][-1] / np.quantile(xs, q) - 1)
            counts = json.loads((out / "calibration.json").read_text())["types"]
            for label, t in counts.items():
                n_runs.setdefault(label, []).append(t["n"])
                if not t["amdahl_fitted"] and f"{label} Amdahl p" in fitted:
                    fitted[f"{label} Amdahl p"][-1] = float("nan")  # declared, not fitted
    print(f"{args.profile or 'the known profile'}: {args.seeds} seeds ({args.seed_offset}..), "
          f"scheduler {args.scheduler}; actions per "
          f"trace {min(t[0] for t in times):,}-{max(t[0] for t in times):,}; simulate and "
          f"record {np.median([t[1] for t in times]):.1f} s, calibrate "
          f"{np.median([t[2] for t in times]):.1f} s (medians)\n")
    print("| parameter | runs (min) | profile | fitted (min–max over seeds) | largest error | "
          "tolerance | largest error against the trace's own sample |")
    print("|---|---|---|---|---|---|---|")
    for k, (v, how) in want.items():
        f = np.array(fitted[k])
        if np.isnan(f).all():
            print(f"| {k} | | {v:.4g} | not fitted (one core count in the trace) | | | |")
            continue
        n_fit = int(np.sum(~np.isnan(f)))
        note = f" (fitted on {n_fit} of {len(f)} seeds)" if n_fit < len(f) else ""
        f = f[~np.isnan(f)]
        if how == "rel":
            err = float(np.max(np.abs(f / v - 1)))
            e_txt, tol = f"{err:.1%}", ("5%" if ("median" in k or "p90" in k) else "—")
        else:
            err = float(np.max(np.abs(f - v)))
            e_txt, tol = f"{err:.3f}", ("0.05" if "Amdahl" in k else "—")
        label = k.split(" ")[0]
        runs = f"{min(n_runs[label]):,}" if label in n_runs else ""
        own_txt = f"{np.max(np.abs(own[k])):.1%}" if k in own else ""
        print(f"| {k} | {runs} | {v:.4g} | {f.min():.4g}–{f.max():.4g}{note} | {e_txt} | {tol} "
              f"| {own_txt} |")


if __name__ == "__main__":
    main()
