"""The step story of an evaluation: each scheduler's mean step against the best heuristic
by mean step, and its mean ACT against the best heuristic by mean ACT, paired by seed.

The two metrics pull apart where tools set the step (the step orders buy step with mean
ACT; ``rate_greedy`` the reverse), so a scheduler is judged against the best heuristic
on each, not against one reference. ``metasched-eval`` prints it under its results;
``benchmarks/grid.py`` adds the predictor-fed rules, the oracle and the step's lower
bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from metasched.evaluation.formatting import fmt, fmt_ci
from metasched.evaluation.statistics import paired_ratio


def ratio_entry(x: Sequence[float], ref: Sequence[float]) -> dict[str, Any]:
    """``{"ratio", "ratio_ci95"}``: mean of ``x`` ÷ mean of ``ref``, paired by seed."""
    r, ci = paired_ratio(x, ref)
    return {"ratio": r, "ratio_ci95": ci}


def step_ratios(doc: dict[str, Any], heuristics: list[str], lower_bound: list[float] | None,
                oracle: str | None = None, predicted: Sequence[str] = ()
                ) -> dict[str, Any]:
    """The step comparison of one point's results document: the best heuristic by mean
    step and by mean ACT (among ``heuristics``), and per scheduler, paired by seed with
    95% intervals: ``step_vs_best`` (step ÷ the best by step), ``act_vs_best`` (ACT ÷ the
    best by ACT), ``step_vs_predicted`` (step ÷ the best of ``predicted`` by step; None
    when none ran), ``step_vs_oracle`` (step ÷ ``oracle``'s; None when it did not run)
    and ``step_vs_bound`` (step ÷ ``lower_bound``, per seed; None when there is none)."""
    sch = doc["schedulers"]
    cands = [n for n in heuristics if n in sch]
    best_step = min(cands, key=lambda n: sch[n]["mean_step_s"], default=None)
    best_act = min(cands, key=lambda n: sch[n]["mean_act_s"], default=None)
    best_pred = min((n for n in predicted if n in sch), key=lambda n: sch[n]["mean_step_s"],
                    default=None)
    if oracle is not None and oracle not in sch:
        oracle = None
    rows: dict[str, Any] = {}
    for n, s in sch.items():
        step, act = s["per_seed"]["mean_step_s"], s["per_seed"]["mean_act_s"]
        rows[n] = {
            "mean_step_s": s["mean_step_s"], "mean_act_s": s["mean_act_s"],
            "step_vs_best": (ratio_entry(step, sch[best_step]["per_seed"]["mean_step_s"])
                             if best_step else None),
            "act_vs_best": (ratio_entry(act, sch[best_act]["per_seed"]["mean_act_s"])
                            if best_act else None),
            "step_vs_predicted": (ratio_entry(step, sch[best_pred]["per_seed"]["mean_step_s"])
                                  if best_pred else None),
            "step_vs_oracle": (ratio_entry(step, sch[oracle]["per_seed"]["mean_step_s"])
                               if oracle else None),
            "step_vs_bound": ratio_entry(step, lower_bound) if lower_bound else None,
        }
    return {"best_by_step": best_step, "best_by_act": best_act, "best_predicted": best_pred,
            "oracle": oracle,
            "lower_bound_s": (sum(lower_bound) / len(lower_bound)) if lower_bound else None,
            "schedulers": rows}



def _compared(r: dict[str, Any], metric: str, less: str, more: str) -> str:
    """"the same <metric> as" where the ratio's interval holds 1, else "a <metric> N%
    <less|more> than"."""
    lo, hi = r["ratio_ci95"]
    if lo <= 1.0 <= hi:
        return f"the same {metric} as"
    return f"a {metric} {abs(r['ratio'] - 1.0):.0%} {less if r['ratio'] < 1 else more} than"


def story_lines(doc: dict[str, Any], heuristics: Sequence[str],
                learned: Sequence[str]) -> list[str]:
    """Lines of the step story (none for an asynchronous evaluation or one with no
    heuristic): per scheduler, step ÷ the best heuristic by step and ACT ÷ the best
    heuristic by ACT (95% CIs), then one sentence per scheduler of ``learned`` saying
    what it buys against them."""
    sch = doc["schedulers"]
    if any("trajectories_per_hour" in s for s in sch.values()):
        return []
    st = step_ratios(doc, list(heuristics), None)
    bs, ba = st["best_by_step"], st["best_by_act"]
    if bs is None:
        return []
    lines = ["", f"The step story: each scheduler against the best heuristic by mean step "
             f"(`{bs}`, {fmt(sch[bs]['mean_step_s'])} s) and by mean ACT (`{ba}`, "
             f"{fmt(sch[ba]['mean_act_s'])} s), paired by seed (95% CIs).", "",
             "| scheduler | mean step s | step ÷ best by step | mean ACT s | ACT ÷ best by ACT |",
             "|---|---|---|---|---|"]
    for name, r in st["schedulers"].items():
        s, a = r["step_vs_best"], r["act_vs_best"]
        lines.append(f"| {name} | {fmt(r['mean_step_s'])} | {fmt_ci(s['ratio'], s['ratio_ci95'])} "
                     f"| {fmt(r['mean_act_s'])} | {fmt_ci(a['ratio'], a['ratio_ci95'])} |")
    for name in learned:
        r = st["schedulers"].get(name)
        if r is None:
            continue
        step = _compared(r["step_vs_best"], "step", "shorter", "longer")
        act = _compared(r["act_vs_best"], "mean ACT", "lower", "higher")
        lines.append("")
        lines.append(f"`{name}`: {step} `{bs}` (the best heuristic by step) and {act} "
                     f"`{ba}` (the best by ACT), within the 95% intervals above.")
    return lines


__all__ = ["ratio_entry", "step_ratios", "story_lines"]
