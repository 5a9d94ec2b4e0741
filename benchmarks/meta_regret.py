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

With ``--real``, the real traces of ``benchmarks/data/real/`` (written by
``benchmarks/real_traces.py``, not kept in the repository) are points too: each replayed
on ``swe_grouped``'s cluster (``real-<source>``), the predictor, for a rule that reads
it, fitted out of sample (``predictor.fit_on: cross``: by prompt group, 5 folds). A
replay's seeds vary only what the trace does not fix (the scheduler's and the launch
streams).

Points run one after another and each point's runs are saved as it ends. Per rule: its
worst regret (mean step ÷ the best rule's, and mean ACT ÷ the best's) over
the points. Runs are kept in ``--out``/runs.json and reused (a run is a point, a label
and a seed; a checkpoint's label carries its files' digest), so adding or retraining a
checkpoint runs only its own runs.

A checkpoint's run is a rule's run, decision for decision, where it picks that rule at
the first decision and its gate cannot act on that rule's run (the gate is off for the
fallback; for the step objective, the rule's mean step after each finished step stays
under the gate's limit). So a checkpoint runs on the first seed of each point, and on
the others only where that is not so; elsewhere it takes the rule's figures (marked
``reused``). Where the first seed's run differs from the rule it would reuse, it runs on
every seed. ``meta_regret.json`` counts the reused runs.

    python benchmarks/meta_regret.py [--checkpoints checkpoints/default,checkpoints/meta_act]
        [--seeds 8] [--points retool,retool_grouped] [--real agentcgroup,mini_swe_agent]
        [--cap act=1.10] [--workers 2] [--out outputs/meta_regret]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from metasched.agents.checkpoint import resolve_scheduler
from metasched.agents.meta_options import OPTIONS, workload_features
from metasched.compose import compose, load_profile
from metasched.evaluation.runs import Job, run_jobs
from metasched.evaluation.step_story import ratio_entry
from metasched.sim.seeds import EVAL_SEED_OFFSET
from metasched.sim.simulator import Simulator

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grid import POINTS  # noqa: E402  (the grid's points, one definition)
from real_traces import produced  # noqa: E402  (the traces are written, not kept)

SYNC_POINTS = [p for p in POINTS if not p.endswith("-async")]
REAL_DIR = Path(__file__).resolve().parent / "data" / "real"
REAL_SOURCES = ("agentcgroup", "mini_swe_agent")
REAL_PROFILE = "swe_grouped"  # the cluster a real trace is replayed on


def real_point(source: str) -> tuple[str, tuple[str, ...]]:
    """(profile, overrides) replaying the real trace ``source`` (exits in one line where
    the file is absent)."""
    path = produced(REAL_DIR / f"{source}.jsonl.gz").resolve()
    return REAL_PROFILE, (f"workload.trace={path}",)


def _fmt(e: dict[str, Any]) -> str:
    lo, hi = e["ratio_ci95"]
    return f"{e['ratio']:.3f} ({lo:.3f}–{hi:.3f})"


def checkpoint_key(name: str) -> str:
    """``name@<digest>``: a checkpoint's runs are kept under its files' sha256, so a
    retrained checkpoint runs again while the rules' runs are reused."""
    path = Path(resolve_scheduler(name))
    h = hashlib.sha256()
    for f in sorted(path.iterdir()):
        if f.is_file():
            h.update(f.name.encode() + f.read_bytes())
    return f"{name}@{h.hexdigest()[:12]}"


def first_features(w: Any, c: Any, seed: int) -> np.ndarray | None:
    """The workload features at a run's first decision (the state there is the same under
    every scheduler: none has acted yet); None for a run with no decision."""
    sim = Simulator(w, c, seed, max_wait_s=300.0)
    return workload_features(sim.state) if sim.next_decision() else None


def reused_rule(meta: Any, x: np.ndarray | None, rules: set[str],
                row: dict[str, Any] | None) -> str | None:
    """The rule whose run a checkpoint's run is, decision for decision, on this seed: the
    option it picks at the first decision, where its gate cannot act on that rule's run
    (the gate is off for that choice, or, for the step objective, the mean step after
    every finished step stays within the gate's limit). None: run the checkpoint."""
    if x is None or row is None:
        return None
    k = meta.choose(x)
    name = meta.options[k].name
    if name not in rules:
        return None
    limit = meta.gate_limit(x, k)
    if limit is None:
        return name
    if meta.objective != "step" or "steps" not in row:
        return None
    spans = np.asarray(row["steps"])
    means = np.cumsum(spans) / np.arange(1, len(spans) + 1)
    return name if bool(np.all(np.log(means) <= limit)) else None


def _row(r: dict[str, Any]) -> dict[str, Any]:
    return {"step": float(np.mean(r["step_s"])), "act": r["mean_act_s"],
            "steps": [float(v) for v in r["step_s"]]}


def run_point(p: str, spec: tuple[str, tuple[str, ...]], rules: dict[str, tuple[str, dict]],
              ckpts: dict[str, str], seeds: list[int], cache: dict[str, dict],
              workers: int) -> None:
    """Run what ``cache`` lacks at point ``p`` (keys ``point|label|seed``; ``ckpts`` maps a
    checkpoint's cache label to its path). Every rule runs; a checkpoint runs on the first
    seed, and on the others where its run is not provably one of the rules' runs
    (:func:`reused_rule`); there it takes that rule's figures, marked ``reused``. Where
    the first seed's run differs from the rule it reuses, every seed runs."""
    from metasched.agents import make_scheduler

    prof, overrides = spec
    w, c = load_profile(compose("eval", [f"workload={prof}", *overrides]))

    def job(label: str, sched: str, params: dict, s: int) -> Job:
        return Job(w, c, sched, params, s, max_wait_s=300.0, label=label, group=p,
                   fit_on="cross")

    def run(jobs: list[Job]) -> None:
        for r in run_jobs(jobs, workers=workers) if jobs else ():
            cache[f"{p}|{r['scheduler']}|{r['seed']}"] = _row(r)

    todo = {(lab, s) for lab in ckpts for s in seeds if f"{p}|{lab}|{s}" not in cache}
    run([job(lab, sched, params, s) for s in seeds for lab, (sched, params) in rules.items()
         if f"{p}|{lab}|{s}" not in cache]
        + [job(lab, ckpts[lab], {}, s) for lab, s in sorted(todo) if s == seeds[0]])
    feats: dict[int, np.ndarray | None] = {}

    def rule_of(lab: str, s: int) -> str | None:  # the rule lab's run is on seed s, or None
        if s not in feats:
            feats[s] = first_features(w, c, s)
        meta, x = metas[lab], feats[s]
        pick = None if x is None else meta.options[meta.choose(x)].name
        return reused_rule(meta, x, set(rules), cache.get(f"{p}|{pick}|{s}"))

    metas = {lab: make_scheduler(path) for lab, path in ckpts.items()}
    full = []
    for lab in ckpts:
        first, rule0 = cache[f"{p}|{lab}|{seeds[0]}"], rule_of(lab, seeds[0])
        verified = rule0 is not None and all(
            first.get(f) == cache[f"{p}|{rule0}|{seeds[0]}"].get(f) for f in ("step", "act"))
        for s in seeds[1:]:
            if (lab, s) not in todo:
                continue
            rule = rule_of(lab, s) if verified else None
            if rule is None:
                full.append(job(lab, ckpts[lab], {}, s))
            else:
                cache[f"{p}|{lab}|{s}"] = {**cache[f"{p}|{rule}|{s}"], "reused": rule}
    run(full)


def point_table(p: str, rules: list[str], ckpts: list[str], seeds: list[int],
                cache: dict[str, dict], caps: dict[str, float],
                keys: dict[str, str]) -> dict[str, Any]:
    """One point's comparison (see the module docstring); ``keys`` maps a checkpoint to
    its label in ``cache``."""
    def per_seed(label: str, fig: str) -> list[float]:
        return [cache[f"{p}|{keys.get(label, label)}|{s}"][fig] for s in seeds]

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
    ap.add_argument("--checkpoints", default="checkpoints/default,checkpoints/meta_act")
    ap.add_argument("--points", default=",".join(SYNC_POINTS),
                    help="grid points (empty: none)")
    ap.add_argument("--real", default="", help="real traces to replay, e.g. "
                    f"{','.join(REAL_SOURCES)} (default: none)")
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
    sources = [r for r in args.real.split(",") if r]
    unknown = [r for r in sources if r not in REAL_SOURCES]
    if unknown:
        print(f"error: --real: unknown {', '.join(unknown)} (known: {', '.join(REAL_SOURCES)})",
              file=sys.stderr)
        return 2
    where = {p: POINTS[p] for p in points}
    where.update({f"real-{r}": real_point(r) for r in sources})
    caps = {}
    for c in args.cap:
        fig, _, val = c.partition("=")
        if fig not in ("act", "step") or not val:
            print(f"error: --cap: {c!r} is not FIGURE=FACTOR (act or step)", file=sys.stderr)
            return 2
        caps[fig] = float(val)
    ckpts = [c for c in args.checkpoints.split(",") if c]
    rule_jobs = {o.name: (o.rule, dict(o.params)) for o in OPTIONS}
    keys = {k: checkpoint_key(k) for k in ckpts}
    seeds = list(range(EVAL_SEED_OFFSET, EVAL_SEED_OFFSET + args.seeds))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache_path = out / "runs.json"
    cache = json.loads(cache_path.read_text()) if cache_path.is_file() else {}
    t0 = time.perf_counter()
    for p, spec in where.items():  # point by point, each saved as it ends (resumable)
        run_point(p, spec, rule_jobs, {keys[k]: resolve_scheduler(k) for k in ckpts}, seeds,
                  cache, args.workers)
        cache_path.write_text(json.dumps(cache) + "\n")
    rules = [o.name for o in OPTIONS]
    doc = {"seeds": seeds, "wall_s": time.perf_counter() - t0, "checkpoints": keys,
           "reused": {k: {p: sum("reused" in cache[f"{p}|{keys[k]}|{s}"] for s in seeds)
                          for p in where} for k in ckpts},
           "points": {p: point_table(p, rules, ckpts, seeds, cache, caps, keys)
                      for p in where}}
    (out / "meta_regret.json").write_text(json.dumps(doc, indent=2) + "\n")
    md = markdown(doc, ckpts, rules)
    (out / "meta_regret.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
