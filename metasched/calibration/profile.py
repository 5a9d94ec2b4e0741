"""Fitting a workload profile to a recorded trace; :mod:`metasched.calibration.profile_yaml`
writes it as the YAML files ``metasched-eval``, ``-plan`` and ``-train`` read
(``workload/<name>.yaml`` and ``cluster/<name>.yaml`` under one ``--config-dir``).

Per action type (``task``, ``name``): the duration distribution in the profiles' form
(one-core seconds for cpu, using the fitted Amdahl fraction; batch-of-one latency for
gpu; call latency for api), the Amdahl fraction where core counts varied, the estimate
error and the timeout rate. Per task: its share of trajectories, turns per trajectory
and generation gaps. Steps and trajectories per step from the trace's RL steps. GPU
service restores from measured setup times. What a trace cannot say (a sandbox, a
service's memory, a cluster the trace has no line for) comes from a base profile, or is
marked as an assumption.
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from metasched.calibration.fits import (
    dist_cdf,
    estimate_sigma,
    fit_amdahl,
    fit_counts,
    fit_duration,
    fit_gaps,
)
from metasched.calibration.fitted import Calibration, TaskFit, TypeFit
from metasched.calibration.groups import fit_groups
from metasched.calibration.samples import Stages, TraceSamples, TypeSamples, mode
from metasched.errors import ConfigError

NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def _fit_type(ts: TypeSamples, services: dict[str, dict[str, tuple[Any, str]]]) -> TypeFit:
    a = ts.arrays()
    run, setup, cores, batch, censored = (a["run_s"], a["setup_s"], a["cores"], a["batch"],
                                          a["timed_out"])
    work = np.maximum(run - setup, 0.0)
    amdahl = None
    pf = 0.0
    if ts.kind == "cpu":
        pf = float(mode(ts.declared_pf))
        if ts.core_range[1] > ts.core_range[0]:
            ok = ~censored
            amdahl = fit_amdahl(work[ok], cores[ok], a["est_s"][ok])
            if amdahl is not None:
                pf = amdahl.p
        g = (1.0 - pf) + pf / np.maximum(cores, 1)
        x = work / g
        keep = np.ones(len(x), bool)
    elif ts.kind == "gpu":
        g = np.ones(len(work))
        single = batch == 1
        # Batch-of-one runs are the latencies themselves; with too few of them, batches
        # are scaled back by the service's marginal cost (their slowest member's time).
        if single.sum() >= 10:
            keep = single
            x = work
        else:
            svc = services.get(mode(ts.services), {})
            m = float(svc.get("batch_marginal", (0.0, ""))[0])
            keep = np.ones(len(work), bool)
            x = work / (1.0 + m * (batch - 1))
    else:
        g = np.ones(len(work))
        x = work
        keep = np.ones(len(x), bool)
    x = np.maximum(x, 1e-6)
    fit = fit_duration(x[keep], censored[keep])
    timeout_s = float(mode(ts.timeouts_s))
    timeout_rate = float(censored.mean())
    # The fit's prediction for the same allocations: P(base x g > timeout).
    timeouts = np.array([timeout_s] * len(g))
    fitted_rate = float(np.mean(1.0 - dist_cdf(fit.dist, timeouts / g)))
    done = keep & ~censored
    est_sigma = estimate_sigma(a["est_s"][done], x[done])
    tokens = None
    if ts.kind == "api" and ts.tokens:
        tokens = fit_duration(np.maximum(np.asarray(ts.tokens, float), 0.0))
    return TypeFit(ts, fit, x[keep], censored[keep], amdahl, pf, timeout_s, timeout_rate,
                   fitted_rate, est_sigma, tokens)


def _fit_services(samples: TraceSamples, base: dict[str, Any] | None
                  ) -> dict[str, dict[str, tuple[Any, str]]]:
    """GPU services named in the trace: measured restores, the rest from the trace's
    cluster line, the base profile, or assumptions."""
    header = samples.header.services if samples.header is not None else {}
    base_svc = ((base or {}).get("workload") or {}).get("services") or {}
    names = sorted({s for ts in samples.types.values() for s in ts.services})
    out: dict[str, dict[str, tuple[Any, str]]] = {}
    for name in names:
        setups = np.array([s for ts in samples.types.values() if name in ts.services
                           for s, sv in zip(ts.setup_s, _service_of(ts), strict=True)
                           if sv == name and s > 0])
        batches = [b for ts in samples.types.values() if name in ts.services
                   for b, sv in zip(ts.batch, _service_of(ts), strict=True) if sv == name]
        spec: dict[str, tuple[Any, str]] = {}
        if name in header:
            h = header[name]
            src = "the trace's cluster line"
            known = {"mem_gb": h.mem_gb, "restore_s": h.restore_s, "max_batch": h.max_batch,
                     "batch_marginal": h.batch_marginal}
        elif name in base_svc:
            src = "the base profile"
            known = dict(base_svc[name])
        else:
            src = None
            known = {}
        spec["mem_gb"] = ((known["mem_gb"], f"from {src}") if "mem_gb" in known
                          else (1.0, "assumption: the trace does not say"))
        if len(setups):
            spec["restore_s"] = (float(np.median(setups)),
                                 f"median of {len(setups):,} measured restores")
        elif "restore_s" in known:
            spec["restore_s"] = (known["restore_s"], f"from {src} (no restore in the trace)")
        else:
            spec["restore_s"] = (0.0, "assumption: no restore in the trace")
        biggest = max(batches, default=1)
        if "max_batch" in known:
            spec["max_batch"] = (int(known["max_batch"]),
                                 f"from {src} (largest batch in the trace: {biggest})")
        else:
            spec["max_batch"] = (biggest, "largest batch in the trace")
        spec["batch_marginal"] = ((known["batch_marginal"], f"from {src}")
                                  if "batch_marginal" in known
                                  else (0.0, "assumption: not fitted"))
        out[name] = spec
    return out


def _service_of(ts: TypeSamples) -> list[str]:
    # Runs of one type name one service in practice; the most common stands for all.
    return [mode(ts.services)] * ts.n


def calibrate(samples: TraceSamples, name: str, base: dict[str, Any] | None = None
              ) -> Calibration:
    """Fit a workload profile to ``samples``.

    Args:
        samples: a trace's measurements (:func:`~metasched.calibration.samples.read_samples`).
        name: the profile's name (its YAML files' names).
        base: a composed config (``metasched.compose.compose``) whose workload supplies
            sandboxes and service sizes the trace cannot give, and whose cluster is
            used when the trace has no cluster line.

    Raises:
        ConfigError: the name is not a file name, or the trace has no finished
            trajectory to fit tasks to.
    """
    if not NAME_RE.match(name):
        raise ConfigError("name", f"must be letters, digits, '_', '-' or '.' (got {name!r})")
    notes: list[str] = []
    services = _fit_services(samples, base)
    fits = {key: _fit_type(ts, services) for key, ts in sorted(samples.types.items())}
    steps = samples.steps()
    if not steps:
        raise ConfigError(samples.path, "no finished trajectory (an action with "
                          "measured.trajectory and a reward action closing it): calibration "
                          "fits trajectories")
    n_traj = sum(len(s) for s in steps)
    base_tasks = ((base or {}).get("workload") or {}).get("tasks") or {}
    tasks: list[TaskFit] = []
    for task in sorted({t.task for s in steps for t in s}):
        trajs = [t for s in steps for t in s if t.task == task]
        tools = [f for (tk, _, reward), f in fits.items() if tk == task and not reward]
        rewards = sorted((f for (tk, _, reward), f in fits.items() if tk == task and reward),
                         key=lambda f: -f.samples.n)
        if not rewards:
            notes.append(f"task {task}: no reward action recorded; left out")
            continue
        n_tools = sum(f.samples.n for f in tools)
        for f in tools:
            # Six decimals, the largest share taking the rounding: they sum to 1.
            f.prob, f.n_in_task = round(f.samples.n / n_tools, 6), n_tools
        if tools:
            top = max(tools, key=lambda f: f.samples.n)
            top.prob = round(1.0 - sum(f.prob for f in tools if f is not top), 6)
        gaps = samples.gaps.get(task)
        counts = np.array([t.tools for t in trajs])
        groups = _turn_groups(samples.turn_groups.get(task) or {})
        if groups:  # turns of several actions: agent turns, the generation before each
            gaps = samples.turn_gaps.get(task)
            counts = np.array([t.groups for t in trajs])
        sandbox = (base_tasks.get(task) or {}).get("sandbox")
        tasks.append(TaskFit(
            task, len(trajs), len(trajs) / n_traj, fit_counts(counts),
            fit_gaps(np.asarray(gaps, float)) if gaps else None, tools, rewards[0],
            [f.samples.name for f in rewards[1:]], sandbox, groups))
    if not tasks:
        raise ConfigError(samples.path, "no task has a recorded reward action")
    for t in tasks:
        if t.unused_rewards:
            notes.append(f"task {t.name}: reward types {t.unused_rewards} are not in the "
                         f"profile (one reward type per task; {t.reward.samples.name} kept)")
    weights = [(f.samples.n, f.est_sigma) for f in fits.values() if f.est_sigma == f.est_sigma]
    est_err = (math.sqrt(sum(n * s * s for n, s in weights) / sum(n for n, _ in weights))
               if weights else 0.5)
    if samples.header is not None:
        cluster = dict(samples.header.doc)
        cluster["name"] = name
        cluster_source = "the trace's cluster line (the resources it ran on)"
    elif base is not None:
        cluster = {"defaults": [base["cluster"].get("name")]}
        cluster_source = f"the base profile's cluster ({base['cluster'].get('name')})"
    else:
        raise ConfigError("base", "the trace has no cluster line: give a base profile whose "
                          "cluster to use (e.g. base=coding)")
    return Calibration(name, samples, list(fits.values()), tasks, len(steps),
                       max(1, round(n_traj / len(steps))), est_err, services, cluster,
                       cluster_source, notes, _step_gap(steps, tasks),
                       _fresh_steps(steps, samples.restarts_s),
                       fit_groups(samples, list(fits.values()), steps))


def _step_gap(steps: list, tasks: list[TaskFit]) -> tuple[float, int]:
    """The pause between RL steps (the trainer's update; runs of a service started one
    after another): the median of the next step's first submission less the last
    finish before it, less one generation gap (its first submission follows one), at
    least 0; and how many gaps were measured."""
    gaps = [min(t.first_s for t in b) - max(t.last_s for t in a)
            for a, b in zip(steps, steps[1:], strict=False)]
    if not gaps:
        return 0.0, 0
    gen = [t.gaps.dist.quantile(0.5) for t in tasks if t.gaps is not None]
    return max(0.0, float(np.median(gaps)) - float(np.mean(gen) if gen else 0.0)), len(gaps)


def _fresh_steps(steps: list, restarts_s: list[float]) -> tuple[int, int]:
    """How many steps after the first began on a service started after the previous
    step's last finish (a cluster line between them: the live runs of a demonstration,
    each its own service), of how many steps after the first."""
    bounds = [(max(t.last_s for t in a), min(t.first_s for t in b))
              for a, b in zip(steps, steps[1:], strict=False)]
    fresh = sum(any(lo <= r <= hi for r in restarts_s) for lo, hi in bounds)
    return fresh, len(bounds)


def _turn_groups(seen: dict[tuple[str, ...], dict[Stages, int]]
                 ) -> list[tuple[float, Stages, int]]:
    """Turn groups from what the trace's turns submitted (the multiset of names -> the
    stages it came in -> count): each multiset in its most common stages, with its share
    of turns (six decimals, the largest taking the rounding); none where every turn
    submitted one action (what the profile's per-action draw already is)."""
    if not any(len(k) > 1 for k in seen):
        return []
    rows = sorted(((sum(o.values()), max(o.items(), key=lambda kv: (kv[1], kv[0]))[0])
                   for o in seen.values()), key=lambda r: (-r[0], r[1]))
    total = sum(n for n, _ in rows)
    out = [[round(n / total, 6), order, n] for n, order in rows]
    out[0][0] = round(1.0 - sum(r[0] for r in out[1:]), 6)
    return [(p, order, n) for p, order, n in out]


__all__ = ["Calibration", "TaskFit", "TypeFit", "calibrate"]
