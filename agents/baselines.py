"""The heuristic baselines by name, and the advisor an observation encoder asks.

Below everything that builds an encoder (the learned scheduler, the Gymnasium env, the
dispatcher): the core's encoder only names its advisor (``ObsConfig.advisor``), and the
heuristic is built here.
"""

from __future__ import annotations

from metasched.agents.elastic import ElasticGreedyScheduler
from metasched.agents.partitioned import StaticScheduler, TaskIsolatedScheduler
from metasched.agents.queue import FifoScheduler, RandomScheduler, SjfScheduler
from metasched.agents.rate_greedy import (
    RateGreedyScheduler,
    RateGreedyStepPredictedScheduler,
    RateGreedyStepScheduler,
)
from metasched.agents.slack_first import (
    SlackFirstOracleScheduler,
    SlackFirstPredictedScheduler,
    SlackFirstScheduler,
)
from metasched.agents.step_order import (
    CriticalPathPredictedScheduler,
    CriticalPathScheduler,
    LearnedPriorityScheduler,
    LeastSlackPredictedScheduler,
    LeastSlackScheduler,
    OracleScheduler,
)
from metasched.core.observation import ObsConfig
from metasched.core.scheduler import Scheduler
from metasched.errors import ConfigError

# The heuristics: schedulers on estimates alone, in the order tables list them.
_HEURISTICS: tuple[type[Scheduler], ...] = (
    StaticScheduler, TaskIsolatedScheduler, FifoScheduler, SjfScheduler,
    ElasticGreedyScheduler, RateGreedyScheduler, RandomScheduler, RateGreedyStepScheduler,
    CriticalPathScheduler, LeastSlackScheduler, SlackFirstScheduler)
# References that read what schedulers may not (true durations): run by name, never a
# heuristic (not a point's best heuristic, not an advisor, not for the live dispatcher).
_ORACLES: tuple[type[Scheduler], ...] = (OracleScheduler, SlackFirstOracleScheduler)
# The step heuristics fed the learned remaining-work predictor (``estimates: predictor``):
# run by name, compared with the heuristics on static estimates, never one of them.
_PREDICTED: tuple[type[Scheduler], ...] = (
    RateGreedyStepPredictedScheduler, CriticalPathPredictedScheduler,
    LeastSlackPredictedScheduler, SlackFirstPredictedScheduler)
# A learned priority rule over the predictor (run by name; :mod:`metasched.core.ranker`).
_LEARNED_RULES: tuple[type[Scheduler], ...] = (LearnedPriorityScheduler,)
REGISTRY: dict[str, type[Scheduler]] = {
    cls.name: cls for cls in (*_HEURISTICS, *_ORACLES, *_PREDICTED, *_LEARNED_RULES)}
BASELINES: tuple[str, ...] = tuple(cls.name for cls in _HEURISTICS)
ORACLES: tuple[str, ...] = tuple(cls.name for cls in _ORACLES)
PREDICTED: tuple[str, ...] = tuple(cls.name for cls in _PREDICTED)


def make_advisor(cfg: ObsConfig) -> Scheduler | None:
    """A fresh instance of the heuristic ``cfg.advisor`` names (None: no advisor), to
    hand to :class:`~metasched.core.observation.ObservationEncoder`.

    Raises:
        ConfigError: ``cfg.advisor`` is no heuristic's name.
    """
    if cfg.advisor is None:
        return None
    if cfg.advisor not in BASELINES:
        raise ConfigError("obs.advisor", f"unknown heuristic {cfg.advisor!r} (known: "
                          f"{', '.join(BASELINES)})")
    return REGISTRY[cfg.advisor]()


__all__ = ["BASELINES", "ORACLES", "PREDICTED", "REGISTRY", "make_advisor"]
