"""Schedulers: heuristic baselines (and, later, learned policies) behind one interface.

``make_scheduler(name, **params)`` builds a scheduler by name; ``BASELINES`` lists the
heuristic names (:mod:`.baselines`), ``ORACLES`` the references that read true
durations, ``PREDICTED`` the step heuristics fed the learned predictor;
``make_advisor(obs_config)`` builds the heuristic an observation encoder asks.
"""

from __future__ import annotations

from typing import Any

from metasched.agents.baselines import BASELINES, ORACLES, PREDICTED, REGISTRY, make_advisor
from metasched.agents.checkpoint import is_checkpoint
from metasched.agents.elastic import ElasticGreedyScheduler
from metasched.agents.partitioned import StaticScheduler, TaskIsolatedScheduler
from metasched.agents.queue import FifoScheduler, RandomScheduler, SjfScheduler
from metasched.agents.rate_greedy import RateGreedyScheduler
from metasched.core.scheduler import Scheduler
from metasched.errors import ConfigError


def make_scheduler(name: str, **params: Any) -> Scheduler:
    """A fresh scheduler by name (one of ``BASELINES``) with optional parameters, or the
    learned scheduler of a checkpoint directory when ``name`` is its path (a meta-policy
    over the rules, :mod:`.meta_policy`, or a per-decision policy, :mod:`.learned`)."""
    if name not in REGISTRY and is_checkpoint(name):
        from metasched.agents.meta_policy import is_meta_checkpoint, load_meta_checkpoint

        if is_meta_checkpoint(name):  # a meta-policy over the rules
            return load_meta_checkpoint(name, **params)
        from metasched.agents.learned import LearnedScheduler

        return LearnedScheduler(name, **params)
    if name not in REGISTRY:
        raise ConfigError("schedulers", f"unknown scheduler {name!r} (known: "
                          f"{', '.join(BASELINES)}, or a checkpoint directory)")
    try:
        return REGISTRY[name](**params)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"scheduler_params.{name}", str(e)) from None


__all__ = ["BASELINES", "ORACLES", "PREDICTED", "ElasticGreedyScheduler", "FifoScheduler",
           "RandomScheduler", "RateGreedyScheduler", "SjfScheduler", "StaticScheduler",
           "TaskIsolatedScheduler",           "make_advisor", "make_scheduler"]
