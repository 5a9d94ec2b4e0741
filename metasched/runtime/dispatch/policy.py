"""The dispatcher's scheduler: the configured one (a checkpoint or a heuristic), and
the fallback to ``elastic_greedy`` when it cannot load, cannot run on this machine,
fails to decide or makes an invalid grant."""

from __future__ import annotations

import logging
from typing import Protocol

import numpy as np

from metasched.core.observation import ObsConfig, ObservationEncoder
from metasched.core.scheduler import Scheduler
from metasched.runtime.dispatch.shared import Shared


class PolicyHost(Shared, Protocol):
    """What loading the scheduler asks of its dispatcher
    (the :class:`~.dispatcher.Dispatcher`)."""

    encoder: ObservationEncoder | None
    fallback_reason: str
    scheduler: Scheduler | None


log = logging.getLogger("metasched.dispatch")

FALLBACK = "elastic_greedy"


def load_scheduler(d: PolicyHost, given: Scheduler | None) -> Scheduler:
    """``given``, or the scheduler ``d.config`` names, reset on ``d``'s state, and the
    observation encoder (``d.encoder``; None if the machine exceeds its sizes)."""
    from metasched.agents import make_advisor, make_scheduler
    from metasched.agents.checkpoint import resolve_scheduler

    sched = given
    if sched is None:
        try:
            sched = make_scheduler(resolve_scheduler(d.config.scheduler),
                                   **d.config.scheduler_params)
        except Exception as e:  # noqa: BLE001 - any failure to load means the fallback
            return fall_back(d, f"cannot load scheduler {d.config.scheduler!r}: {e}")
    try:
        sched.reset(d.state, np.random.default_rng(0))
    except Exception as e:  # noqa: BLE001
        return fall_back(d, f"scheduler {sched.name!r} cannot run here: {e}")
    obs_cfg = getattr(sched, "obs_config", None) or ObsConfig()
    try:
        d.encoder = (getattr(sched, "encoder", None)
                     or ObservationEncoder(d.state, obs_cfg, make_advisor(obs_cfg)))
    except ValueError:
        d.encoder = None  # the machine exceeds the observation's sizes
    return sched


def fall_back(d: PolicyHost, why: str) -> Scheduler:
    """Switch ``d`` to the elastic_greedy heuristic, logging the reason once."""
    from metasched.agents import make_advisor, make_scheduler

    if not d.fallback_reason:
        d.fallback_reason = why
        log.warning("%s; falling back to %s", why, FALLBACK)
    sched = make_scheduler(FALLBACK)
    sched.reset(d.state, np.random.default_rng(0))
    d.scheduler = sched
    if d.encoder is None:
        try:
            obs_cfg = ObsConfig()
            d.encoder = ObservationEncoder(d.state, obs_cfg, make_advisor(obs_cfg))
        except ValueError:
            d.encoder = None
    return sched


__all__ = ["FALLBACK", "fall_back", "load_scheduler"]
