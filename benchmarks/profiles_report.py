"""Scheduler quality on every profile: eval tables, static / elastic_greedy ratios, and
the resources metasched-plan says a scheduler saves at static's step time.

    python benchmarks/profiles_report.py [--seeds 8] [--plan-seeds 4] [--out outputs/report]
        [--schedulers static,task_isolated,fifo,sjf,elastic_greedy,random,checkpoints/default]

Prints markdown (paste into docs/benchmarks/quality.md) and writes each run's outputs under --out.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from metasched.cli.eval_app import run_eval
from metasched.cli.plan_app import run_plan
from metasched.compose import PROFILES, compose


def fmt(plan: dict) -> str:
    return ", ".join(f"{k} {v:.0%}" for k, v in (plan["resources_saved"] or {}).items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--plan-seeds", type=int, default=4)
    ap.add_argument("--profiles", default=",".join(PROFILES))
    ap.add_argument("--schedulers", default="static,task_isolated,fifo,sjf,elastic_greedy,random")
    ap.add_argument("--no-plan", action="store_true")
    ap.add_argument("--out", default="outputs/report")
    args = ap.parse_args()
    scheds = args.schedulers.split(",")
    lines = []
    summary = ["| profile | mean ACT static ÷ elastic | mean step static ÷ elastic "
               "| resources saved by elastic_greedy (all pools scaled together) "
               "| per pool alone |", "|---|---|---|---|---|"]
    for prof in args.profiles.split(","):
        out = Path(args.out) / prof
        cfg = compose("eval", [f"workload={prof}", f"n_seeds={args.seeds}", "plots=true",
                               f"schedulers=[{','.join(scheds)}]"])
        doc = run_eval(cfg, out / "eval", progress=False)
        s = doc["schedulers"]
        lines += [f"### {prof}", "", (out / "eval" / "results.md").read_text(), ""]
        act = s["static"]["mean_act_s"] / s["elastic_greedy"]["mean_act_s"]
        step = s["static"]["mean_step_s"] / s["elastic_greedy"]["mean_step_s"]
        joint = per = "—"
        if not args.no_plan:
            pcfg = compose("plan", [f"workload={prof}", f"n_seeds={args.plan_seeds}",
                                    "scheduler=elastic_greedy"])
            plan = run_plan(pcfg, out / "plan", progress=False)["schedulers"]["elastic_greedy"]
            joint = (f"scale {plan['scale']:.3f}: {fmt(plan)}" if plan["scale"] is not None
                     else "target not met")
            per = "; ".join(f"{k}: {fmt(p)}" if p["scale"] is not None else f"{k}: not met"
                            for k, p in plan["per_pool"].items()) or "—"
        summary.append(f"| {prof} | {act:.2f}× | {step:.3f}× | {joint} | {per} |")
    print("\n".join(summary))
    print()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
