"""What a meta-policy chooses among, and what it sees when it chooses.

An *option* is a rule with its settings (``rate_greedy`` with an endgame fraction is one
option per fraction): the meta-policy's action picks one, and that rule decides until
the policy or its gate picks another. ``OPTIONS`` is the default set, in a fixed order
(a checkpoint records the names it was trained on); adding an option is one line here.

The *workload features* are what both clocks know when the first decision is asked:
the cluster's pools (from its config), the trajectories open so far (how many, whether
they come in prompt groups and how large, how many tasks, whether they hold sandboxes)
and the queue at that moment (its mix of kinds, the mean estimate). They are computed
once per choice, never per decision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from metasched.agents.baselines import REGISTRY
from metasched.core.scheduler import Scheduler
from metasched.core.state import ClusterState


@dataclass(frozen=True)
class Option:
    """One choice of the meta-policy: a rule of the registry with its parameters."""

    name: str
    rule: str
    params: dict[str, Any] = field(default_factory=dict)
    generation: str | None = None  # the generation pool's order it sets (None: as set)

    def build(self) -> Scheduler:
        """A fresh instance of the rule."""
        return REGISTRY[self.rule](**self.params)


def _endgame(f: float) -> Option:
    return Option(f"rate_greedy@endgame={f:g}", "rate_greedy", {"endgame": f})


# The default option set: the queue rules, the ACT rules, rate_greedy's endgame switch at
# three fractions (1.0 is rate_greedy_step) and the step orders.
OPTIONS: tuple[Option, ...] = (
    Option("fifo", "fifo"),
    Option("elastic_greedy", "elastic_greedy"),
    Option("rate_greedy", "rate_greedy"),
    _endgame(0.25),
    _endgame(0.5),
    Option("rate_greedy_step", "rate_greedy_step"),
    Option("critical_path", "critical_path"),
    Option("least_slack", "least_slack"),
    Option("slack_first", "slack_first"),
)
# Options that also set the generation pool's order (a profile's ``generation:``; the
# front door's order live): the default set, then these, appended so that a checkpoint's
# option indices keep their meaning. A checkpoint names its options: one trained on
# ``OPTIONS`` loads as it was; train on this set by naming it (``options=``).
GENERATION_OPTIONS: tuple[Option, ...] = OPTIONS + (
    Option("rate_greedy+generation=predicted", "rate_greedy", generation="predicted"),
)
OPTIONS_BY_NAME: dict[str, Option] = {o.name: o for o in GENERATION_OPTIONS}

FEATURES: tuple[str, ...] = (
    "log_cores", "log_cores_per_node", "log_gpu_devices", "n_endpoints", "log_api_rpm",
    "log_api_concurrency", "log_trajectories", "log_trajectories_per_core", "grouped",
    "log_group_size", "log_tasks", "sandboxed", "pending_cpu", "pending_gpu", "pending_api",
    "log_pending_est_s",
)


def option(name: str) -> Option:
    """The known option called ``name`` (ValueError for an unknown one)."""
    if name not in OPTIONS_BY_NAME:
        raise ValueError(f"unknown option {name!r} (known: {', '.join(OPTIONS_BY_NAME)})")
    return OPTIONS_BY_NAME[name]


def workload_features(state: ClusterState) -> np.ndarray:
    """The features of ``FEATURES``, in order, from what ``state`` holds now."""
    c = state.cluster
    cores = c.cpu_nodes * c.cores_per_node
    eps = list(c.endpoints.values())
    trajs = list(state.trajectories.values())
    n = len(trajs)
    prompts = [t.prompt for t in trajs if t.prompt is not None]
    groups = len(set(prompts))
    pend = {k: len(v) for k, v in state.pending.items()}
    n_pend = sum(pend.values())
    est = [a.spec.est_s for q in state.pending.values() for a in q.values()]
    return np.array([
        math.log1p(cores), math.log1p(c.cores_per_node), math.log1p(c.gpu_devices),
        float(len(eps)), math.log1p(sum(e.rpm for e in eps)),
        math.log1p(sum(e.max_concurrency for e in eps)),
        math.log1p(n), math.log((n + 1) / (cores + 1)),
        len(prompts) / n if n else 0.0,
        math.log(len(prompts) / groups) if groups else 0.0,
        math.log1p(len({t.task for t in trajs})),
        sum(t.sandbox is not None for t in trajs) / n if n else 0.0,
        *(pend.get(k, 0) / n_pend if n_pend else 0.0 for k in ("cpu", "gpu", "api")),
        math.log1p(float(np.mean(est))) if est else 0.0,
    ], dtype=np.float64)


__all__ = ["FEATURES", "GENERATION_OPTIONS", "OPTIONS", "OPTIONS_BY_NAME", "Option", "option",
           "workload_features"]
