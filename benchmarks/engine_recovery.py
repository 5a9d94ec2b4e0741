"""Recovery of the engine model: a generation pool traced by the simulator and its
costs fitted back by ``metasched-calibrate``, over seeds.

Runs ``swe_grouped`` (its trajectories per step cut to ``--trajectories``) with its LLM
turns on ``--replicas`` replicas of a known engine (``metasched.core.engine``'s
defaults, Llama-3.1-8B on an H100, with ``--prefill-base-s``: the default 0 cannot be
told apart within a ratio), records each seed's trace, calibrates it and prints, per
cost, the true value, the fitted range over the seeds and the largest relative error
(the target: 10%).

    python benchmarks/engine_recovery.py [--seeds 3] [--replicas 2] [--trajectories 32]
        [--preemption swap]
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

from metasched.agents import make_scheduler
from metasched.calibration.engine_fit import COSTS
from metasched.cli.calibrate_app import run_calibrate
from metasched.compose import compose, load_profile
from metasched.core.trace_writer import TraceWriter
from metasched.sim.simulator import Simulator


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--trajectories", type=int, default=32)
    ap.add_argument("--prefill-base-s", type=float, default=0.002)
    ap.add_argument("--preemption", choices=("recompute", "swap"), default="recompute")
    a = ap.parse_args(argv)
    w, c = load_profile(compose("eval", [
        "workload=swe_grouped", "+generation=swe_grouped", "workload.steps=1",
        f"workload.trajectories_per_step={a.trajectories}",
        f"generation.replicas={a.replicas}",
        f"+generation.engine.prefill_base_s={a.prefill_base_s}",
        f"+generation.engine.preemption={a.preemption}"]))
    true = w.generation.engine
    fitted: dict[str, list[float]] = {k: [] for k in COSTS}
    told: dict[str, bool] = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(a.seeds):
            path = Path(tmp) / f"seed{seed}.jsonl"
            with TraceWriter(path, c, w.services) as tw:
                Simulator(dataclasses.replace(w), c, seed, trace_writer=tw).run(
                    make_scheduler("rate_greedy"))
            doc = run_calibrate({"trace": str(path), "out": str(Path(tmp) / f"out{seed}"),
                                 "plot": False, "quiet": True})
            for k in COSTS:
                fitted[k].append(doc["engine"]["costs"][k])
            told = doc["engine"]["fitted"]
            print(f"seed {seed}: {doc['engine']['generations']} generations, residual "
                  f"{doc['engine']['rel_rmse']:.2e} of the mean run time")
    print(f"\n{'cost':<22}{'true':>12}{'fitted min':>14}{'fitted max':>14}{'max error':>11}")
    for k in COSTS:
        v = getattr(true, k)
        lo, hi = min(fitted[k]), max(fitted[k])
        err = max(abs(x - v) for x in fitted[k]) / v if v else float("nan")
        note = "" if told.get(k) else "  (not in the trace: default kept)"
        print(f"{k:<22}{v:>12.4g}{lo:>14.4g}{hi:>14.4g}{err:>10.2%}{note}")
    print(f"{a.seeds} seeds in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
