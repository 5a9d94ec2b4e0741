"""The remaining-work predictor an evaluation feeds to schedulers that ask for it
(``estimates: predictor``: ``critical_path_predicted`` and the like).

It is fitted (design ``boost``, :mod:`metasched.core.predictor`) on ``TRAIN_TRAJECTORIES``
trajectories of whole RL steps of the evaluated workload, sampled with training seed
``TRAIN_SEED`` (below the evaluation seeds, which start at 1,000,000), the steps after
the first cut where their turns (decision points) pass ``TRAIN_DECISIONS`` (long
trajectories: ``swe_grouped`` keeps 17 steps, 1,088 trajectories): the runs then update
it online on their own clock. A trace workload trains it on the trace itself.
One fit per workload (and time scale) and process; every run gets a fresh copy of its
online state. ``learned_priority`` gets a ranker fitted on the same trajectories
(:func:`fitted_ranker`).

A replay that runs the workload faster (every duration and gap times ``time_scale``, as
``benchmarks/live_replay.py`` does) fits on the training trajectories scaled alike: a
pure time scale shifts every log duration by the same constant, which the type
residuals absorb, but not the fitted trees, which split on absolute log times (the
static estimate, the type's mean, ``log1p`` of the elapsed time).
"""

from __future__ import annotations

import pickle
from dataclasses import replace

import numpy as np

from metasched.core.predictor import Predictor, TrajRecord, records_of
from metasched.core.ranker import Ranker, fit_ranker
from metasched.sim.sampling import sample_workload
from metasched.sim.workload_config import WorkloadConfig

TRAIN_SEED = 0
TRAIN_TRAJECTORIES = 3456  # as benchmarks/predictor_accuracy.py's default
TRAIN_DECISIONS = 80_000  # the fit's cost grows with them (a replay, then the trees)
DESIGN = "boost"

_FITTED: dict[bytes, Predictor] = {}
_RANKERS: dict[bytes, Ranker] = {}
_RECORDS: dict[bytes, list[TrajRecord]] = {}


def _records(workload: WorkloadConfig, time_scale: float = 1.0) -> list[TrajRecord]:
    key = pickle.dumps((workload, time_scale))
    recs = _RECORDS.get(key)
    if recs is None:
        if workload.trace is not None:
            from metasched.sim.trace import read_trace

            steps = read_trace(workload.trace).steps
        else:
            n = -(-TRAIN_TRAJECTORIES // max(1, workload.trajectories_per_step))
            steps = sample_workload(replace(workload, steps=n),
                                    np.random.default_rng(TRAIN_SEED)).steps
            turns = np.cumsum([sum(len(t.turns) for t in step) for step in steps])
            steps = steps[:max(1, int(np.searchsorted(turns, TRAIN_DECISIONS, side="right")))]
        recs = _RECORDS[key] = [
            TrajRecord(r.task, r.group, tuple((n, g * time_scale, d * time_scale)
                                              for n, g, d in r.turns))
            for r in records_of(steps)]
    return recs


def fitted_predictor(workload: WorkloadConfig, time_scale: float = 1.0) -> Predictor:
    """A predictor fitted for ``workload`` (see the module docstring), its online state
    empty and its own; ``time_scale``: for a replay of it with every duration and gap
    times this."""
    key = pickle.dumps((workload, time_scale))
    p = _FITTED.get(key)
    if p is None:
        p = _FITTED[key] = Predictor.fit(_records(workload, time_scale), DESIGN)
    return replace(p, trajs={}, groups={}, finished={})


def fitted_ranker(workload: WorkloadConfig, time_scale: float = 1.0) -> Ranker:
    """The learned priority (:mod:`metasched.core.ranker`) fitted on the same training
    trajectories through :func:`fitted_predictor`'s predictor (``time_scale`` as
    there)."""
    key = pickle.dumps((workload, time_scale))
    r = _RANKERS.get(key)
    if r is None:
        r = _RANKERS[key] = fit_ranker(fitted_predictor(workload, time_scale),
                                       _records(workload, time_scale))
    return r


__all__ = ["DESIGN", "TRAIN_DECISIONS", "TRAIN_SEED", "TRAIN_TRAJECTORIES", "fitted_predictor",
           "fitted_ranker"]
