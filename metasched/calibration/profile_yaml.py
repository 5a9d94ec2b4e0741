"""Writing a fitted profile (:class:`~metasched.calibration.fitted.Calibration`) as the
YAML files ``metasched-eval``, ``-plan`` and ``-train`` read: ``workload/<name>.yaml``
(:func:`workload_yaml`) and ``cluster/<name>.yaml`` (:func:`cluster_yaml`), each value
with a comment saying where it came from.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from metasched.calibration.fitted import Calibration, TypeFit
from metasched.calibration.groups import groups_yaml
from metasched.calibration.samples import mode

COMMENT_COL = 34  # where a value's comment starts, as in the shipped profiles


def _stage_yaml(stage: tuple[tuple[str, ...], ...]) -> Any:
    """A stage as the profile writes it: a name alone, else a list of names and chains
    (a chain of one action is its name)."""
    items = [c[0] if len(c) == 1 else list(c) for c in stage]
    return items[0] if len(items) == 1 and isinstance(items[0], str) else items


def _num(v: float) -> str:
    """A number for YAML: 4 significant digits, always readable back as a number."""
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        return str(int(v))
    r = repr(float(f"{float(v):.4g}"))
    mant, e, exp = r.partition("e")
    if e and "." not in mant:
        r = f"{mant}.0e{exp}"
    return r


def _flow(d: dict[str, Any] | float) -> str:
    if not isinstance(d, dict):
        return _num(d)
    return "{" + ", ".join(f"{k}: {_num(v)}" for k, v in d.items()) + "}"


def _line(indent: int, key: str, value: str, comment: str = "") -> str:
    text = f"{' ' * indent}{key}: {value}"
    if comment:
        text = f"{text.ljust(COMMENT_COL - 1)} # {comment}"
    return text


def _duration_comment(f: TypeFit) -> str:
    d = f.duration
    what = {"cpu": "one-core s", "gpu": "batch-of-one s", "api": "call s"}[f.samples.kind]
    parts = [f"{what}: quantiles of {d.n:,} runs"]
    if d.censored:
        parts.append(f"{d.censored:,} killed at the timeout")
    if d.tail_from_censoring:
        parts.append("p99 from the fraction killed")
    if f.samples.kind == "cpu" and f.amdahl is not None:
        parts.append("scaled to one core by the fitted Amdahl fraction")
    if d.ks == d.ks:
        parts.append(f"KS {d.ks:.3f}")
    return "; ".join(parts)


def _action_lines(f: TypeFit, indent: int, reward: bool) -> list[str]:
    s = f.samples
    out = [_line(indent, "kind", s.kind)]
    if not reward:
        out.append(_line(indent, "prob", repr(f.prob),
                         f"{s.n:,} of {f.n_in_task:,} tool actions of the task"))
    out.append(_line(indent, "duration_s", _flow(f.duration.config()), _duration_comment(f)))
    if s.kind == "cpu":
        lo, hi = s.core_range
        out.append(_line(indent, "cores", f"[{lo}, {hi}]", "the range the requests declared"))
        if f.amdahl is not None:
            a = f.amdahl
            out.append(_line(indent, "parallel_fraction", _num(f.parallel_fraction),
                             f"Amdahl fit: {a.n:,} runs on {len(a.core_counts)} core counts "
                             f"({a.core_counts[0]}-{a.core_counts[-1]}), rmse of log run "
                             f"{a.rmse:.3f}"))
        else:
            out.append(_line(indent, "parallel_fraction", _num(f.parallel_fraction),
                             f"as declared by {s.n:,} runs (one core count: not fitted)"))
    elif s.kind == "gpu":
        out.append(_line(indent, "service", mode(s.services), f"{s.n:,} runs"))
    else:
        out.append(_line(indent, "endpoint", mode(s.endpoints), f"{s.n:,} calls"))
        if f.tokens is not None:
            out.append(_line(indent, "tokens", _flow(f.tokens.config()),
                             f"quantiles of {f.tokens.n:,} calls"))
    out.append(_line(indent, "timeout_s", _num(f.timeout_s),
                     f"declared; {f.timeout_rate:.2%} killed (the fit: "
                     f"{f.fitted_timeout_rate:.2%}); estimate error sigma {f.est_sigma:.3f}"))
    return out


def workload_yaml(c: Calibration) -> str:
    s = c.samples
    lines = [f"# Calibrated by metasched-calibrate from {s.path}: {s.n_actions:,} measured "
             f"actions,",
             f"# {sum(t.n_traj for t in c.tasks):,} finished trajectories in {c.steps} RL "
             f"steps. Every figure: its fit and sample size.",
             _line(0, "name", c.name),
             _line(0, "steps", str(c.steps), "RL steps in the trace"),
             _line(0, "trajectories_per_step", str(c.trajectories_per_step),
                   "finished trajectories per step in the trace (mean)"),
             _line(0, "estimate_error", _num(c.estimate_error),
                   "sigma of log(estimate / duration), pooled over types"),
             *([_line(0, "step_gap_s", _num(c.step_gap[0]),
                      f"pause between steps: median of {c.step_gap[1]:,} gaps (the next "
                      "step's first submission - the last finish, less a generation)")]
               if c.step_gap[0] > 0 else []),
             *([_line(0, "step_fresh_quotas", "true",
                      f"each of the {c.fresh_steps[1]:,} steps after the first began on a "
                      "service started anew: its quotas full")]
               if c.step_fresh_quotas else []),
             _line(0, "trace", "null")]
    if c.services:
        lines.append("services:")
        for name, spec in c.services.items():
            lines.append(f"  {name}:")
            lines += [_line(4, k, _num(v), why) for k, (v, why) in spec.items()]
    if c.groups is not None and c.groups.size > 1:
        lines += groups_yaml(c.groups, _line)
    lines.append("tasks:")
    for t in c.tasks:
        lines.append(f"  {t.name}:")
        lines.append(_line(4, "share", _num(t.share), f"{t.n_traj:,} of the trace's "
                           "finished trajectories"))
        lines.append(_line(4, "turns", _flow(t.turns.config()),
                           f"{'agent turns' if t.turn_groups else 'tool actions'} per "
                           f"trajectory: quantiles of {t.turns.n:,} trajectories (counts as "
                           "rounded values), observed range"))
        if t.gaps is not None:
            lines.append(_line(4, "generation_s", _flow(t.gaps.config()),
                               f"gaps (submission - previous finish"
                               f"{', before a turn' if t.turn_groups else ''}): quantiles of "
                               f"{t.gaps.n:,}"
                               + (f" ({t.gaps.zero:.1%} zero: calls made together; the "
                                  "quantiles are the others')" if t.gaps.zero else "")
                               + f"; KS {t.gaps.ks:.3f}"))
        else:
            lines.append(_line(4, "generation_s", "0",
                               "no gap in the trace (trajectories of one action)"))
        if t.turn_groups:
            n_turns = sum(n for _, _, n in t.turn_groups)
            lines.append("    turn_groups:".ljust(COMMENT_COL - 1) + f" # what one agent turn "
                         f"submitted: {n_turns:,} turns (turns and generation_s are per turn)")
            for p, order, n in t.turn_groups:
                names = ", ".join(json.dumps(_stage_yaml(st)) for st in order)
                lines.append(_line(6, "- prob", f"{p!r}, actions: [{names}]",
                                   f"{n:,} turns").replace("- prob:", "- {prob:", 1)
                             .replace(f"[{names}]", f"[{names}]}}", 1))
        if t.sandbox is not None:
            sb = t.sandbox
            lines.append(_line(4, "sandbox", _flow({"mem_gb": sb["mem_gb"],
                                                    "startup_s": sb["startup_s"]}),
                               "from the base profile (the trace has no sandboxes)"))
        else:
            lines.append(_line(4, "sandbox", "null", "none recorded"))
        if t.actions:
            lines.append("    actions:")
            for f in t.actions:
                lines.append(f"      {f.samples.name}:")
                lines += _action_lines(f, 8, False)
        else:
            lines.append(_line(4, "actions", "{}", "no tool action recorded"))
        lines.append("    reward:".ljust(COMMENT_COL - 1) + f" # {t.reward.samples.name}: "
                     f"{t.reward.samples.n:,} runs")
        lines += _action_lines(t.reward, 6, True)
    return "\n".join(lines) + "\n"


def cluster_yaml(c: Calibration) -> str:
    d = c.cluster
    head = [f"# Cluster of the calibrated profile {c.name}: from {c.cluster_source}."]
    if "defaults" in d:
        return "\n".join(head + ["defaults:", f"  - {d['defaults'][0]}", "  - _self_",
                                 f"name: {c.name}"]) + "\n"
    lines = head + [f"name: {c.name}", _line(0, "scale", "1.0", "multiplies every pool "
                                             "(docs/concepts/workloads.md)")]
    cpu, gpu = d.get("cpu") or {}, d.get("gpu") or {}
    lines += ["cpu:", _line(2, "nodes", str(cpu.get("nodes", 0))),
              _line(2, "cores_per_node", str(cpu.get("cores_per_node", 0))),
              _line(2, "mem_gb_per_node", _num(cpu.get("mem_gb_per_node", 0.0))),
              "gpu:", _line(2, "devices", str(gpu.get("devices", 0))),
              _line(2, "mem_gb", _num(gpu.get("mem_gb", 0.0))), "api:"]
    eps = (d.get("api") or {}).get("endpoints") or {}
    if not eps:
        lines.append("  endpoints: {}")
    else:
        lines.append("  endpoints:")
        for name, e in eps.items():
            # At the precision recorded: a quota derated by the proxy's margin (5.975
            # RPM over 60.25 s) admits its whole allowance only unrounded (5.975 over
            # 60.25 s is 5.9999 requests: 5 a window, not 6).
            lines.append(f"    {name}: {{" + ", ".join(f"{k}: {v!r}" for k, v in e.items())
                         + "}")
    return "\n".join(lines) + "\n"


__all__ = ["cluster_yaml", "workload_yaml"]
