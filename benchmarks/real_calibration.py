"""A profile calibrated from a real trace against the trace: the prompt's share of the
variance, measured the same way (one-way random-effects ANOVA, unbalanced groups by
the usual n0, so groups of 2-5 do not bias it upward; per action type, the nested
estimate that keeps a trajectory's persistence out of the prompt's share).

    python benchmarks/real_calibration.py [--trace benchmarks/data/real/agentcgroup.jsonl.gz]
        [--steps 40] [--seed 0] [--out outputs/real_calibration]

Replays the trace on an uncontended cluster (every action starts when its generation gap
ends) recording every action as the dispatcher records them, calibrates a profile from
that recording with ``metasched-calibrate``'s code, samples ``--steps`` RL steps of the
profile and prints each share beside the trace's, with the plain share of group means
(the variance of the prompts' means over the total; biased upward for small groups) for
comparison.

The trace is not kept in the repository: write it first with ``benchmarks/real_traces.py``
from the public repositories (``benchmarks/data/real/SOURCES.md`` gives the commands).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import yaml

from metasched.calibration.groups import group_figures, records_of
from metasched.cli.calibrate_app import run_calibrate
from metasched.compose import profile
from metasched.evaluation.recording import record_trace
from metasched.sim.groups import anova_share
from metasched.sim.sampling import sample_workload
from metasched.sim.trace import read_trace
from metasched.sim.workload_config import parse_workload

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_traces import produced  # noqa: E402  (the traces are written, not kept)

ROWS = ("turns", "tool_s", "generation_total_s")


def plain_share(values: np.ndarray, groups: np.ndarray) -> float:
    """The variance of the groups' means (each value given its group's) over the total
    variance: what a naive reading calls the prompt's share."""
    _, idx = np.unique(groups, return_inverse=True)
    means = np.bincount(idx, weights=values) / np.bincount(idx)
    return float(np.var(means[idx]) / np.var(values)) if np.var(values) > 0 else math.nan


def plain_shares(records) -> dict[str, float]:
    """:func:`plain_share` of the figures in ``ROWS``, over prompts run twice or more."""
    recs = [r for r in records if r.prompt is not None]
    counts: dict = {}
    for r in recs:
        counts[r.prompt] = counts.get(r.prompt, 0) + 1
    recs = [r for r in recs if counts[r.prompt] >= 2]
    pid = np.array([r.prompt for r in recs])
    cols = {"turns": np.log(np.array([r.turns for r in recs], float) + 1.0),
            "tool_s": np.log(np.maximum([r.tool_s for r in recs], 1e-3)),
            "generation_total_s": np.log(np.maximum([r.gen_s for r in recs], 1e-3))}
    return {k: plain_share(v, pid) for k, v in cols.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="benchmarks/data/real/agentcgroup.jsonl.gz")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="outputs/real_calibration")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    trace = read_trace(produced(a.trace))
    source = group_figures(records_of(trace))
    # An uncontended replay: one node with a core for every trajectory of a step.
    width = max(len(s) for s in trace.steps) * 4
    w, c = profile("swe_grouped", [f"workload.trace={Path(a.trace).resolve()}",
                                   f"cluster.cpu.cores_per_node={width}"])
    rec = out / "recorded.jsonl"
    rec.unlink(missing_ok=True)
    record_trace(w, c, rec, scheduler="fifo", seed=a.seed, max_wait_s=None)
    doc = run_calibrate({"trace": str(rec), "name": "real", "out": str(out), "plot": False,
                         "quiet": True, "base": None})
    cw = parse_workload(yaml.safe_load((out / "workload" / "real.yaml").read_text()))
    g = doc["groups"] or {}
    if cw.groups is not None and cw.groups.size > 1:  # its shares, measured as the source's
        inst = sample_workload(replace(cw, steps=a.steps), np.random.default_rng(a.seed))
        fitted = group_figures(records_of(inst))
        how = f"{a.steps} steps sampled, seed {a.seed}"
    else:  # groups of one: no prompt effect to sample; its fitted shares are the figures
        fitted = {"turns": g.get("turns", 0.0), "actions": {
            k: {"share": v} for k, v in g.get("actions", {}).items()},
            "generation_s": {"share": g.get("generation_s", 0.0)}}
        how = (f"groups of {g.get('size', 1)} (the most common): the profile samples no "
               "prompt effect; its fitted shares shown")
    plain = plain_shares(records_of(trace))
    adjusted = task_adjusted(trace)
    print(f"source {a.trace}: {source['trajectories']} trajectories, {source['prompts']} "
          f"prompts; profile {out}/workload/real.yaml: {how}")
    print(f"{'share of the variance':<30}{'source':>8}{'source, task-adj.':>19}"
          f"{'profile':>9}{'plain (source)':>16}")
    for k in ROWS:
        print(f"{'log ' + k:<30}{source[k]:>8.2f}{adjusted[k]:>19.2f}"
              f"{fitted.get(k, math.nan):>9.2f}{plain[k]:>16.2f}")
    for name, row in source["actions"].items():
        got = fitted.get("actions", {}).get(name, {}).get("share", math.nan)
        if row["n"] >= 100:
            print(f"{'log duration ' + name:<30}{row['share']:>8.2f}{'':>19}{got:>9.2f}")
    gs = source.get("generation_s")
    if gs:
        got = fitted.get("generation_s", {}).get("share", math.nan)
        print(f"{'log generation gap':<30}{gs['share']:>8.2f}{'':>19}{got:>9.2f}")


def task_adjusted(trace) -> dict[str, float]:
    """The ANOVA shares of ``ROWS`` by prompt after each task's mean is taken out (the
    tasks here are models, and a prompt's runs may be of different models)."""
    ts = [t for s in trace.steps for t in s]
    recs = records_of(trace)
    task = np.array([t.task for t in ts])
    pid = np.array([t.prompt for t in ts])
    cols = {"turns": np.log(np.array([r.turns for r in recs], float) + 1.0),
            "tool_s": np.log(np.maximum([r.tool_s for r in recs], 1e-3)),
            "generation_total_s": np.log(np.maximum([r.gen_s for r in recs], 1e-3))}
    out = {}
    for k, v in cols.items():
        r = v.copy()
        for t in set(task):
            r[task == t] -= v[task == t].mean()
        out[k] = anova_share(r, pid)
    return out


if __name__ == "__main__":
    main()
