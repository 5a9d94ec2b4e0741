"""Measuring the prompt-group structure of rollouts: the figures a profile's ``groups:``
is fitted to (``metasched.sim.groups``), from a sampled instance or a recorded trace.

Per trajectory: its prompt, agent turns, total tool time, total generation time, its
actions (type, duration) in order and its generation gaps. From them:

- the prompt's share of the variance (one-way random-effects ANOVA,
  :func:`~metasched.sim.groups.anova_share`) of log(turns + 1), log total tool time and
  log total generation time; per action type, of log duration, and of a generation
  gap's log, the prompt's and the trajectory's shares as nested moment estimates
  (:func:`~metasched.sim.groups.nested_shares`: the trajectory's persistence apart);
- the mean |log error| of a duration estimate: the type's median over every run
  (static), and the trajectory's own running median of the type where it has run the
  type before (history), falling back to the static one;
- the correlation of the mean generation gap of a trajectory's first half with its
  second half's (trajectories of 4 gaps or more);
- the correlation of turns done with turns remaining, over every tool turn of every
  trajectory (done: the turns before it; remaining: it and those after it).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import numpy as np

from metasched.sim.groups import anova_share, nested_shares
from metasched.sim.sampling import WorkloadInstance


@dataclass
class RunRecord:
    """What the group figures need of one trajectory."""

    prompt: str | None
    turns: int  # agent turns with tool actions
    tool_s: float = 0.0
    gen_s: float = 0.0
    actions: list[tuple[str, float]] = field(default_factory=list)  # (type, duration)
    gaps: list[float] = field(default_factory=list)


def records_of(instance: WorkloadInstance) -> list[RunRecord]:
    """The trajectories of a sampled instance (true durations)."""
    out = []
    for step in instance.steps:
        for ts in step:
            tools = [t for t in ts.turns if not t.action.reward]
            r = RunRecord(ts.prompt, sum(1 for t in tools if not t.same_turn),
                          float(sum(t.action.true_s for t in tools)),
                          float(sum(t.gen_s for t in ts.turns)),
                          [(t.action.name, t.action.true_s) for t in tools],
                          [t.gen_s for t in ts.turns if not t.same_turn])
            out.append(r)
    return out


def _share_pair(values: list[float], prompts: list, trajs: list) -> tuple[float, float, int]:
    v = np.log(np.asarray(values, float))
    return (*nested_shares(v, np.asarray(prompts), np.asarray(trajs)), len(v))


def group_figures(records: list[RunRecord]) -> dict:
    """The figures of the module docstring (shares: nan where not measurable)."""
    recs = [r for r in records if r.prompt is not None]
    out: dict = {"trajectories": len(recs), "prompts": len({r.prompt for r in recs})}
    if not recs:
        return out
    sizes = np.unique([r.prompt for r in recs], return_counts=True)[1]
    out["size"] = int(np.bincount(sizes).argmax())
    pid = np.array([r.prompt for r in recs])
    out["turns"] = anova_share(np.log(np.array([r.turns for r in recs], float) + 1.0), pid)
    tool = np.array([r.tool_s for r in recs])
    out["tool_s"] = anova_share(np.log(tool[tool > 0]), pid[tool > 0])
    gen = np.array([r.gen_s for r in recs])
    out["generation_total_s"] = anova_share(np.log(gen[gen > 0]), pid[gen > 0])
    by_type: dict[str, tuple[list, list, list]] = {}
    for i, r in enumerate(recs):
        for name, x in r.actions:
            if x > 0:
                v, p, t = by_type.setdefault(name, ([], [], []))
                v.append(x), p.append(r.prompt), t.append(i)
    out["actions"] = {name: dict(zip(("share", "trajectory_share", "n"), _share_pair(*vpt),
                                     strict=True)) for name, vpt in sorted(by_type.items())}
    gv, gp, gt = [], [], []
    for i, r in enumerate(recs):
        for x in r.gaps:
            if x > 0:
                gv.append(x), gp.append(r.prompt), gt.append(i)
    if gv:
        s, st, n = _share_pair(gv, gp, gt)
        out["generation_s"] = {"share": s, "trajectory_share": st, "n": n}
    out.update(history_errors(recs))
    out["gap_halves_corr"] = gap_halves_corr(recs)
    out["done_remaining_corr"] = done_remaining_corr(recs)
    return out


def history_errors(records: list[RunRecord]) -> dict[str, float]:
    """Mean |log error| of a duration estimate: the type's median over all runs
    (``static_log_error``) and the trajectory's running median of the type, where it has
    one (``history_log_error``)."""
    logs: dict[str, list[float]] = {}
    for r in records:
        for name, x in r.actions:
            if x > 0:
                logs.setdefault(name, []).append(math.log(x))
    med = {name: float(np.median(v)) for name, v in logs.items()}
    static, hist = [], []
    for r in records:
        seen: dict[str, list[float]] = {}
        for name, x in r.actions:
            if x <= 0:
                continue
            lx = math.log(x)
            past = seen.setdefault(name, [])  # kept sorted
            static.append(abs(lx - med[name]))
            k = len(past)
            est = (med[name] if not k else past[k // 2] if k % 2
                   else 0.5 * (past[k // 2 - 1] + past[k // 2]))
            hist.append(abs(lx - est))
            bisect.insort(past, lx)
    if not static:
        return {}
    return {"static_log_error": float(np.mean(static)),
            "history_log_error": float(np.mean(hist))}


def gap_halves_corr(records: list[RunRecord]) -> float:
    """Correlation across trajectories of the mean gap of the first half with the second
    half's (trajectories of 4 gaps or more)."""
    a, b = [], []
    for r in records:
        g = r.gaps
        if len(g) >= 4:
            h = len(g) // 2
            a.append(float(np.mean(g[:h])))
            b.append(float(np.mean(g[h:])))
    return float(np.corrcoef(a, b)[0, 1]) if len(a) > 2 else math.nan


def done_remaining_corr(records: list[RunRecord]) -> float:
    """Pearson correlation of turns done and turns remaining over every tool turn."""
    n = np.array([r.turns for r in records if r.turns > 0])
    if len(n) < 2:
        return math.nan
    done = np.concatenate([np.arange(k) for k in n]).astype(float)
    left = np.concatenate([np.arange(k, 0, -1) for k in n]).astype(float)
    return float(np.corrcoef(done, left)[0, 1])




# ---------------------------------------------------------------- fitting a trace


@dataclass
class GroupFit:
    """The group structure fitted to a recorded trace (``groups:`` of the profile), with
    the figures it was measured from."""

    size: int
    prompts: int
    trajectories: int
    turns: float
    generation_s: float
    generation_persistence: float
    actions: dict[str, tuple[float, float, int]]  # name -> (share, trajectory share, n)
    duration_s: float  # tool actions pooled (weighted by runs)
    persistence: float
    figures: dict  # group_figures of the trace's trajectories

    def config(self) -> dict:
        """The profile's ``groups:`` mapping."""
        return {"size": self.size, "turns": self.turns, "generation_s": self.generation_s,
                "generation_persistence": self.generation_persistence,
                "duration_s": self.duration_s,
                "actions": {k: v[0] for k, v in self.actions.items()},
                "persistence": self.persistence}


def _clean(x: float) -> float:
    """A share as a profile takes it: in [0, 0.99], 0 where not measurable."""
    return 0.0 if not x == x else round(min(max(x, 0.0), 0.99), 4)


def fit_groups(samples, types, steps) -> GroupFit | None:
    """The prompt-group structure of a trace whose trajectories carry prompt ids
    (``measured.prompt``): None unless some prompt has two finished trajectories.

    ``types``: the fitted action types (``TypeFit``: their durations ``x`` as fitted,
    one-core seconds, and which runs were kept); ``steps``: the finished trajectories by
    RL step. Each share is the one-way random-effects ANOVA share of the log of a draw by
    prompt; persistence, the share by trajectory less it."""
    done = {id(t) for s in steps for t in s}
    keys = {k: t for k, t in samples.trajectories.items() if id(t) in done}
    recs = [RunRecord(t.prompt, t.groups or t.tools, t.tool_s, float(sum(t.gap_s)),
                      [], [g for g in t.gap_s if g > 0]) for t in keys.values()]
    with_prompt = [r for r in recs if r.prompt is not None]
    if not with_prompt or max(np.unique([r.prompt for r in with_prompt],
                                        return_counts=True)[1]) < 2:
        return None
    figures = group_figures(recs)
    actions: dict[str, tuple[float, float, int]] = {}
    for f in types:
        s = f.samples
        kept = [k for k, keep in zip(s.traj, _kept(f), strict=True) if keep]
        rows = [(math.log(x), keys[k].prompt, k) for x, k in zip(f.x, kept, strict=True)
                if k in keys and keys[k].prompt is not None and x > 0]
        if len(rows) < 2:
            continue
        v, p, t = (np.array(c) for c in zip(*rows, strict=True))
        name = "reward" if s.reward else s.name
        if s.reward:  # one a trajectory: no persistence to tell apart
            actions[name] = (anova_share(v, p), math.nan, len(v))
        else:
            actions[name] = (*nested_shares(v, p, t), len(v))
    tools = [(n, a, b) for name, (a, b, n) in actions.items() if name != "reward"
             and a == a and b == b]
    total = sum(n for n, _, _ in tools)
    pooled = sum(n * a for n, a, _ in tools) / total if total else 0.0
    persistence = sum(n * max(0.0, b - a) for n, a, b in tools) / total if total else 0.0
    gen = figures.get("generation_s", {})
    g_share = gen.get("share", math.nan)
    g_pers = gen.get("trajectory_share", math.nan) - g_share
    return GroupFit(figures["size"], figures["prompts"], figures["trajectories"],
                    _clean(figures["turns"]), _clean(g_share), _clean(g_pers),
                    {k: (_clean(a), b, n) for k, (a, b, n) in sorted(actions.items())},
                    _clean(pooled), _clean(persistence), figures)


def _kept(f) -> list[bool]:
    """Which of a type's runs its fitted ``x`` holds (gpu: the batches of one, when
    there were enough of them)."""
    s = f.samples
    if len(f.x) == s.n:
        return [True] * s.n
    return [b == 1 for b in s.batch]


def groups_yaml(g: GroupFit, line) -> list[str]:
    """The ``groups:`` block of a calibrated profile (``line``: the profile writer's)."""
    fig = g.figures
    out = ["groups:".ljust(33) + f" # prompt groups: {g.prompts:,} prompts, "
           f"{g.trajectories:,} trajectories; shares of the log's variance (turns: one-way "
           "ANOVA; actions, gaps: nested estimates)",
           line(2, "size", str(g.size), "the most common number of responses per prompt"),
           line(2, "turns", repr(g.turns), "share of log(turns + 1)"),
           line(2, "generation_s", repr(g.generation_s), f"share of a gap's log; total "
                f"generation time: {fig.get('generation_total_s', math.nan):.3f}"),
           line(2, "generation_persistence", repr(g.generation_persistence),
                "by trajectory, less the prompt's"),
           line(2, "duration_s", repr(g.duration_s), f"tool actions pooled; total tool time: "
                f"{fig.get('tool_s', math.nan):.3f}"),
           "  actions:"]
    out += [line(4, name, repr(a), f"{n:,} runs; " + (f"by trajectory {b:.3f}" if b == b
                                                      else "one a trajectory"))
            for name, (a, b, n) in g.actions.items()]
    out.append(line(2, "persistence", repr(g.persistence), "by trajectory, less the "
                    "prompt's (tool actions pooled)"))
    out.append(line(2, "turns_coupling", "1.0", "not fitted (one latent)"))
    return out


def groups_report(g: GroupFit) -> list[str]:
    """The fit report's lines on the group structure."""
    fig = g.figures
    lines = ["", f"Prompt groups: {g.prompts:,} prompts of {g.size} responses (most common), "
             f"{g.trajectories:,} trajectories. Share of variance of the log explained by "
             "the prompt (one-way random-effects ANOVA), and by the trajectory:", "",
             "| quantity | n | prompt | trajectory |", "|---|---|---|---|",
             f"| turns + 1 | {g.trajectories:,} | {fig.get('turns', math.nan):.3f} | — |",
             f"| total tool time | {g.trajectories:,} | {fig.get('tool_s', math.nan):.3f} | — |",
             f"| total generation time | {g.trajectories:,} | "
             f"{fig.get('generation_total_s', math.nan):.3f} | — |"]
    gen = fig.get("generation_s")
    if gen:
        lines.append(f"| generation gap | {gen['n']:,} | {gen['share']:.3f} | "
                     f"{gen['trajectory_share']:.3f} |")
    lines += [f"| {name} | {n:,} | {a:.3f} | {b:.3f} |" if b == b else
              f"| {name} | {n:,} | {a:.3f} | — |" for name, (a, b, n) in g.actions.items()]
    return lines


__all__ = ["GroupFit", "RunRecord", "done_remaining_corr", "fit_groups", "gap_halves_corr",
           "group_figures", "groups_report", "groups_yaml", "history_errors", "records_of"]
