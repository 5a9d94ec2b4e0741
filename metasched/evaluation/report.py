"""Human-readable outputs of an evaluation: the markdown table and the plots."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from metasched.evaluation.formatting import fmt, fmt_ci
from metasched.evaluation.step_story import story_lines


def results_table(doc: dict[str, Any]) -> str:
    """The results as a markdown table, one row per scheduler."""
    lb = doc["lower_bound"]["mean_act_s"]
    head = ("| scheduler | mean ACT s (95% CI) | p50 | p95 | p99 | ACT/LB | mean step s (95% CI) "
            "| max step s | util cpu/gpu/api | idle-held cpu core-s | failed | guard |")
    lines = [f"Workload `{doc['workload']}`, {len(doc['seeds'])} evaluation seeds "
             f"({doc['seeds'][0]}..{doc['seeds'][-1]}); lower bound mean ACT {fmt(lb)} s.", "",
             head, "|" + "---|" * 12]
    for name, s in doc["schedulers"].items():
        ca, cs = s["ci95"]["mean_act_s"], s["ci95"]["mean_step_s"]
        u = s["utilisation"]
        lines.append(
            f"| {name} | {fmt(s['mean_act_s'])} ({fmt(ca[0])}–{fmt(ca[1])}) "
            f"| {fmt(s['p50_act_s'])} | {fmt(s['p95_act_s'])} | {fmt(s['p99_act_s'])} "
            f"| {s['act_over_lower_bound']:.2f} | {fmt(s['mean_step_s'])} "
            f"({fmt(cs[0])}–{fmt(cs[1])}) | {fmt(s['max_step_s'])} "
            f"| {u['cpu']:.1%} / {u['gpu']:.1%} / {u['api']:.1%} "
            f"| {fmt(s['idle_held_resource_s']['cpu'])} | {s['failed']} "
            f"| {s['guard_fired']} |")
    lines += ["", results_note(doc)]
    lines += rollout_table(doc)
    lines += paired_table(doc)
    lines += story_lines(doc, doc.get("heuristics", ()), doc.get("learned", ()))
    return "\n".join(lines) + "\n"


# What the results table's columns mean, said under it.
RESULTS_COLUMNS = (
    "mean ACT s: action completion time (queue wait + run), the mean over seeds of each "
    "seed's mean, 95% CI over seeds; p50/p95/p99: percentiles of every action's ACT; "
    "ACT/LB: mean ACT over its lower bound (each action started at once on the cores that "
    "run it fastest); mean step s: the RL step's time (its slowest trajectory), 95% CI; "
    "max step s: the longest step; util: busy fraction of each pool (api: of the request "
    "quota); idle-held cpu core-s: core-seconds held for a trajectory or task while idle; "
    "failed: actions that ended failed, all seeds together{failed}; guard: actions the "
    "starvation guard started (queued past max_wait_s), all seeds together.")
# Today's practice, introduced where a run has it.
PRACTICE = {"static": "today's practice: each trajectory holds its own share of the cores "
                      "for its whole life, GPU services pinned per task, a fixed semaphore "
                      "per API tool",
            "task_isolated": "the other common practice: pools partitioned per task"}


def results_note(doc: dict[str, Any]) -> str:
    """The line under the results table: what each column means, why ``failed`` is what
    it is where every scheduler has the same failures, and today's practice among the
    schedulers run."""
    reasons = [s.get("failure_reasons") or {} for s in doc["schedulers"].values()]
    failed = ""
    if reasons and reasons[0] and all(r == reasons[0] for r in reasons):
        why = ", ".join(f"{k} {v}" for k, v in sorted(reasons[0].items()))
        failed = f" (the same for every scheduler here: {why}; an action past its timeout " \
                 "fails whoever schedules it)"
    practice = [f"`{n}` is {what}" for n, what in PRACTICE.items() if n in doc["schedulers"]]
    return "Columns: " + RESULTS_COLUMNS.format(failed=failed) + "".join(
        f" {p[0].upper()}{p[1:]}." for p in practice)


def rollout_table(doc: dict[str, Any]) -> list[str]:
    """Lines of an asynchronous evaluation's throughput and latency (none for a
    synchronous one), paired against the run's reference where there is one."""
    names = [n for n, s in doc["schedulers"].items() if "trajectories_per_hour" in s]
    if not names:
        return []
    ofp = doc["schedulers"][names[0]]["max_offpolicyness"]
    ref = doc.get("reference")
    lines = ["", f"Asynchronous rollouts (max_offpolicyness {ofp}): trajectories per hour "
             "and mean trajectory latency (start to end), means over seeds with 95% CIs"
             + (f"; ratios paired against `{ref}`." if ref else "."), "",
             "| scheduler | trajectories/h | mean trajectory latency s | trajectories/h ÷ ref "
             "| latency ÷ ref | largest staleness |", "|---|---|---|---|---|---|"]
    for name in names:
        s = doc["schedulers"][name]
        ct, cl = s["ci95"]["trajectories_per_hour"], s["ci95"]["mean_traj_latency_s"]
        p = s.get("paired", {})
        ratio = [fmt_ci(p[m]["ratio"], p[m]["ratio_ci95"]) if m in p else "–"
                 for m in ("trajectories_per_hour", "mean_traj_latency_s")]
        lines.append(f"| {name} | {fmt(s['trajectories_per_hour'])} ({fmt(ct[0])}–{fmt(ct[1])}) "
                     f"| {fmt(s['mean_traj_latency_s'])} ({fmt(cl[0])}–{fmt(cl[1])}) "
                     f"| {ratio[0]} | {ratio[1]} | {s['max_staleness']} |")
    lines += ["", "Columns: trajectories/h: trajectories finished per hour of the run, 95% CI "
              "over seeds; mean trajectory latency s: a trajectory's start to its end; ÷ ref: "
              "each paired by seed with the reference; largest staleness: the most trainer "
              "versions between a trajectory's start and the batch that trains on it."]
    return lines


def paired_table(doc: dict[str, Any]) -> list[str]:
    """Lines of the paired comparison against the run's reference (none without one)."""
    ref = doc.get("reference")
    if ref is None:
        return []
    best = doc.get("best_heuristic")
    why = "the best heuristic by mean ACT" if ref == best else f"best heuristic: `{best}`"
    lines = ["", f"Paired against `{ref}` ({why}), same seeds: ratio and difference of "
             "means with 95% CIs.", "",
             "| scheduler | mean ACT ÷ ref | mean ACT − ref s | mean step ÷ ref "
             "| mean step − ref s |", "|---|---|---|---|---|"]
    for name, s in doc["schedulers"].items():
        p = s.get("paired")
        if p is None:
            continue
        a, st = p["mean_act_s"], p["mean_step_s"]
        lines.append(f"| {name} | {fmt_ci(a['ratio'], a['ratio_ci95'])} "
                     f"| {fmt_ci(a['diff'], a['diff_ci95'], 3)} "
                     f"| {fmt_ci(st['ratio'], st['ratio_ci95'], 4)} "
                     f"| {fmt_ci(st['diff'], st['diff_ci95'], 1)} |")
    lines += ["", "Columns: ÷ ref: the scheduler's mean over the reference's, − ref: their "
              "difference, each over the same seeds, 95% CI; below 1 (or 0) is better than "
              "the reference."]
    return lines


def tied_groups(series: dict[str, Sequence[Any]]) -> list[list[str]]:
    """The names grouped by identical series (each a sequence of arrays, compared
    exactly), in the order the names first appear: plots draw one line or box per group,
    labelled ``fifo = static``, instead of identical ones on top of each other."""
    groups: list[tuple[Sequence[Any], list[str]]] = []
    for name, arrays in series.items():
        for first, group in groups:
            if len(first) == len(arrays) and all(
                    np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
                    zip(first, arrays, strict=True)):
                group.append(name)
                break
        else:
            groups.append((arrays, [name]))
    return [g for _, g in groups]


def tie_label(group: list[str]) -> str:
    """A series' label: its scheduler, or every scheduler it stands for."""
    return " = ".join(group)


def plot_all(doc: dict[str, Any], runs: list[dict[str, Any]], out: Path) -> list[Path]:
    """Write act_cdf.png, utilisation.png and step_time.png into ``out``."""
    return [_save(fig, out / f"{name}.png") for name, fig in plot_figures(doc, runs).items()]


def plot_figures(doc: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The evaluation's figures by file stem (act_cdf, utilisation, step_time).
    Schedulers with identical series share one line or box, labelled with all their
    names (:func:`tied_groups`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(doc["schedulers"])
    by = {n: [r for r in runs if r["scheduler"] == n] for n in names}
    figs = {}

    fig, ax = plt.subplots(figsize=(7, 4.5))
    acts = {n: np.sort(np.concatenate([r["act"] for r in by[n]])) for n in names}
    for group in tied_groups({n: (acts[n],) for n in names}):
        act = acts[group[0]]
        if act.size:
            ax.plot(np.maximum(act, 1e-3), np.arange(1, act.size + 1) / act.size,
                    label=tie_label(group))
    ax.set_xscale("log")
    ax.set_xlabel("action completion time (s, log)")
    ax.set_ylabel("fraction of actions")
    ax.set_title(f"ACT CDF — {doc['workload']}")
    ax.grid(alpha=0.3)
    ax.legend()
    figs["act_cdf"] = fig

    pools = [p for p in ("cpu", "gpu", "api") if any(by[n][0]["timeline"][p] for n in names)]
    fig, axes = plt.subplots(len(pools) or 1, 1, figsize=(10, 3.0 * max(1, len(pools))),
                             squeeze=False)
    for ax, pool in zip(axes[:, 0], pools, strict=False):
        tls = {n: by[n][0]["timeline"] for n in names}
        series = {n: (tls[n]["t"], tls[n][pool], tls[n].get(f"{pool}_held") or [])
                  for n in names}
        groups = [g for g in tied_groups(series) if tls[g[0]][pool]]
        for i, group in enumerate(groups):
            tl = tls[group[0]]
            # Widest first, each drawn over the last: where lines coincide (every
            # scheduler at full use) each still shows as a stripe of its own colour.
            lw = _stripe_width(i, len(groups))
            (line,) = ax.plot(tl["t"], tl[pool], label=tie_label(group), lw=lw)
            held = tl.get(f"{pool}_held")
            if held and any(h > b + 1e-9 for h, b in zip(held, tl[pool], strict=True)):
                ax.plot(tl["t"], held, ls="--", lw=lw, color=line.get_color())
        ax.set_ylabel(f"{pool} utilisation")
        ax.set_ylim(0, 1.08)
        ax.grid(alpha=0.3)
        # Beside the axes, never over the data.
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    axes[-1, 0].set_xlabel(f"time (s), seed {doc['seeds'][0]}")
    axes[0, 0].set_title(f"Utilisation over time — {doc['workload']} "
                         "(dashed: busy or held for a trajectory/task)")
    figs["utilisation"] = fig

    fig, ax = plt.subplots(figsize=(7, 4.5))
    steps = {n: [s for r in by[n] for s in r["step_s"]] for n in names}
    groups = tied_groups({n: (steps[n],) for n in names})
    ax.boxplot([steps[g[0]] for g in groups], showmeans=True)
    ax.set_xticks(range(1, len(groups) + 1), ["\n= ".join(g) for g in groups], rotation=20)
    ax.set_ylabel("RL step time (s)")
    ax.set_title(f"Step time — {doc['workload']}")
    ax.grid(alpha=0.3, axis="y")
    figs["step_time"] = fig
    return figs


def _stripe_width(i: int, n: int, thin: float = 0.9, wide: float = 3.2) -> float:
    """The line width of the ``i``-th of ``n`` lines drawn in order: from ``wide`` down
    to ``thin``."""
    return thin if n == 1 else wide - (wide - thin) * i / (n - 1)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
