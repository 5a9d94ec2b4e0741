"""The meta-policy's regret against every rule it chooses among, at every grid point.

At each synchronous point of the grid (``benchmarks/grid.py``), every option of
:mod:`metasched.agents.meta_options` runs as a fixed rule, and every checkpoint given,
on the evaluation seeds (1,000,000.., never a training seed). Per point and checkpoint:

- its mean step ÷ the best rule's by mean step (the best chosen in hindsight at that
  point), paired by seed with a 95% interval; the same by mean ACT;
- with ``--cap act=1.10``: the best rule variant whose mean ACT is within 1.10 × the
  best rule's mean ACT there, the checkpoint's step ÷ that rule's, and the bound any
  per-run choice among the options can reach under the cap (per seed, the best option
  by step among those within the cap on that seed, ÷ the best variant's step).

Points run one after another and each point's runs are saved as it ends. Per rule: its
worst regret (mean step ÷ the best rule's, and mean ACT ÷ the best's) over
the points. Runs are kept in ``--out``/runs.json and reused (a run is a point, a label
and a seed), so adding a checkpoint runs only its own runs (after retraining one, give
a fresh ``--out``).

    python benchmarks/meta_regret.py --checkpoints checkpoints/default,checkpoints/act
        [--seeds 8] [--points retool,retool_grouped] [--cap act=1.10] [--workers 2]
        [--out outputs/meta_regret]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from metasched.agents.checkpoint import resolve_scheduler
from metasched.agents.meta_options import OPTIONS
from metasched.compose import compose, load_profile
from metasched.evaluation.runs import Job, run_jobs
from metasched.evaluation.step_story import ratio_entry
from metasched.sim.seeds import EVAL_SEED_OFFSET

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grid import POINTS  # noqa: E402  (the grid's points, one definition)

SYNC_POINTS = [p for p in POINTS if not p.endswith("-async")]


def _fmt(e: dict[str, Any]) -> str:
    lo, hi = e["ratio_ci95"]
    return f"{e['ratio']:.3f} ({lo:.3f}–{hi:.3f})"


def run_all(points: list[str], labels: dict[str, tuple[str, dict]], seeds: list[int],
            cache: dict[str, dict], workers: int) -> None:
    """Run what ``cache`` lacks (key ``point|label|seed``) and add it."""
    jobs = []
    for p in points:
        prof, overrides = POINTS[p]
        w, c = load_profile(compose("eval", [f"workload={prof}", *overrides]))
        for s in seeds:
            for label, (sched, params) in labels.items():
                if f"{p}|{label}|{s}" not in cache:
                    jobs.append(Job(w, c, sched, params, s, max_wait_s=300.0, label=label,
                                    group=p))
    if jobs:
        for r in run_jobs(jobs, workers=workers):
            cache[f"{r['group']}|{r['scheduler']}|{r['seed']}"] = {
                "step": float(np.mean(r["step_s"])), "act": r["mean_act_s"]}


def point_table(p: str, rules: list[str], ckpts: list[str], seeds: list[int],
                cache: dict[str, dict], caps: dict[str, float]) -> dict[str, Any]:
    """One point's comparison (see the module docstring)."""
    def per_seed(label: str, fig: str) -> list[float]:
        return [cache[f"{p}|{label}|{s}"][fig] for s in seeds]

    mean = {lab: {f: float(np.mean(per_seed(lab, f))) for f in ("step", "act")}
            for lab in [*rules, *ckpts]}
    best = {f: min(rules, key=lambda r: mean[r][f]) for f in ("step", "act")}
    out: dict[str, Any] = {"best": best, "mean": mean, "rules": {}, "checkpoints": {}}
    for lab in [*rules, *ckpts]:
        row = {f"{f}_vs_best": ratio_entry(per_seed(lab, f), per_seed(best[f], f))
               for f in ("step", "act")}
        out["rules" if lab in rules else "checkpoints"][lab] = row
    for fig, cap in caps.items():  # e.g. act <= 1.10 x the best rule's
        ok = [r for r in rules if mean[r][fig] <= cap * mean[best[fig]][fig]]
        variant = min(ok, key=lambda r: mean[r]["step"])
        bound = []
        for s in seeds:
            c = {r: cache[f"{p}|{r}|{s}"] for r in rules}
            lim = cap * min(v[fig] for v in c.values())
            bound.append(min(v["step"] for v in c.values() if v[fig] <= lim))
        out[f"cap_{fig}"] = {
            "cap": cap, "variant": variant,
            "bound": ratio_entry(bound, per_seed(variant, "step")),
            "checkpoints": {k: {"step_vs_variant": ratio_entry(per_seed(k, "step"),
                                                               per_seed(variant, "step")),
                                f"{fig}_vs_best": ratio_entry(per_seed(k, fig),
                                                              per_seed(best[fig], fig))}
                            for k in ckpts}}
    return out


def markdown(doc: dict[str, Any], ckpts: list[str], rules: list[str]) -> str:
    lines = ["| point | best rule by step | best rule by ACT | "
             + " | ".join(f"{k}: step ÷ best (95% CI) | {k}: ACT ÷ best (95% CI)" for k in ckpts)
             + " |", "|---|---|---|" + "---|---|" * len(ckpts)]
    for p, t in doc["points"].items():
        cells = [f"{_fmt(t['checkpoints'][k]['step_vs_best'])} | "
                 f"{_fmt(t['checkpoints'][k]['act_vs_best'])}" for k in ckpts]
        lines.append(f"| {p} | {t['best']['step']} | {t['best']['act']} | "
                     + " | ".join(cells) + " |")
    lines += ["", "| rule | worst step ÷ best (point) | worst ACT ÷ best (point) |",
              "|---|---|---|"]
    for r in rules:
        cells = []
        for f in ("step", "act"):
            p, t = max(doc["points"].items(), key=lambda kv: kv[1]["rules"][r][f"{f}_vs_best"]
                       ["ratio"])
            cells.append(f"{_fmt(t['rules'][r][f'{f}_vs_best'])} ({p})")
        lines.append(f"| {r} | {cells[0]} | {cells[1]} |")
    for p, t in doc["points"].items():
        for key in [k for k in t if k.startswith("cap_")]:
            c = t[key]
            if key == next(k for k in t if k.startswith("cap_")) and p == next(iter(doc["points"])):
                lines += ["", f"| point | rule variant meeting {key[4:]} ≤ {c['cap']}× best | "
                          "bound: per-seed best option under the cap ÷ it | "
                          + " | ".join(f"{k}: step ÷ it | {k}: {key[4:]} ÷ best" for k in ckpts)
                          + " |", "|---|---|---|" + "---|---|" * len(ckpts)]
            cells = [f"{_fmt(c['checkpoints'][k]['step_vs_variant'])} | "
                     f"{_fmt(c['checkpoints'][k][key[4:] + '_vs_best'])}" for k in ckpts]
            lines.append(f"| {p} | {c['variant']} | {_fmt(c['bound'])} | " + " | ".join(cells)
                         + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoints", default="checkpoints/default")
    ap.add_argument("--points", default=",".join(SYNC_POINTS))
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--cap", action="append", default=[], help="FIGURE=FACTOR, e.g. act=1.10")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default="outputs/meta_regret")
    args = ap.parse_args(argv)
    points = [p for p in args.points.split(",") if p]
    unknown = [p for p in points if p not in SYNC_POINTS]
    if unknown:
        print(f"error: --points: unknown {', '.join(unknown)} (known: {', '.join(SYNC_POINTS)})",
              file=sys.stderr)
        return 2
    caps = {}
    for c in args.cap:
        fig, _, val = c.partition("=")
        if fig not in ("act", "step") or not val:
            print(f"error: --cap: {c!r} is not FIGURE=FACTOR (act or step)", file=sys.stderr)
            return 2
        caps[fig] = float(val)
    ckpts = [c for c in args.checkpoints.split(",") if c]
    labels = {o.name: (o.rule, dict(o.params)) for o in OPTIONS}
    labels.update({k: (resolve_scheduler(k), {}) for k in ckpts})
    seeds = list(range(EVAL_SEED_OFFSET, EVAL_SEED_OFFSET + args.seeds))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache_path = out / "runs.json"
    cache = json.loads(cache_path.read_text()) if cache_path.is_file() else {}
    t0 = time.perf_counter()
    for p in points:  # point by point, each saved as it ends (a long run can be resumed)
        run_all([p], labels, seeds, cache, args.workers)
        cache_path.write_text(json.dumps(cache) + "\n")
    rules = [o.name for o in OPTIONS]
    doc = {"seeds": seeds, "wall_s": time.perf_counter() - t0,
           "points": {p: point_table(p, rules, ckpts, seeds, cache, caps) for p in points}}
    (out / "meta_regret.json").write_text(json.dumps(doc, indent=2) + "\n")
    md = markdown(doc, ckpts, rules)
    (out / "meta_regret.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
