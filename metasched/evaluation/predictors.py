"""The remaining-work predictor an evaluation feeds to schedulers that ask for it
(``estimates: predictor``: ``critical_path_predicted`` and the like).

It is fitted (design ``boost``, :mod:`metasched.core.predictor`) on ``TRAIN_TRAJECTORIES``
trajectories of whole RL steps of the evaluated workload, sampled with training seed
``TRAIN_SEED`` (below the evaluation seeds, which start at 1,000,000), the steps after
the first cut where their turns (decision points) pass ``TRAIN_DECISIONS`` (long
trajectories: ``swe_grouped`` keeps 17 steps, 1,088 trajectories): the runs then update
it online on their own clock. A trace workload is never replayed through a model fitted
on it: ``fit_on`` (the evaluation's ``predictor.fit_on``) is ``auto`` (a sampled profile:
its training seed; a trace: cross-fitted by prompt group, ``FOLDS`` folds, each
trajectory served by the fold's model that never saw its group,
:mod:`metasched.core.predictor_folds`), ``cross`` (the same for a trace) or the path of
another trace to fit on (its every trajectory).
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
from metasched.core.predictor_folds import CrossFitted, folds_of
from metasched.core.ranker import Ranker, fit_ranker
from metasched.sim.sampling import sample_workload
from metasched.sim.workload_config import WorkloadConfig

TRAIN_SEED = 0
TRAIN_TRAJECTORIES = 3456  # as benchmarks/predictor_accuracy.py's default
TRAIN_DECISIONS = 80_000  # the fit's cost grows with them (a replay, then the trees)
DESIGN = "boost"
FOLDS = 5  # the folds of a cross-fitted trace replay
FIT_ON = ("auto", "cross")  # or a trace's path

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


def fitted_predictor(workload: WorkloadConfig, time_scale: float = 1.0,
                     fit_on: str = "auto", design: str = DESIGN) -> Predictor | CrossFitted:
    """A predictor fitted for ``workload`` (see the module docstring), its online state
    empty and its own; ``time_scale``: for a replay of it with every duration and gap
    times this; ``fit_on``: ``auto``, ``cross`` or another trace's path; ``design``: one
    of :data:`~metasched.core.predictor.DESIGNS` (``reward_static``: the baseline a
    learned design is judged beside).

    Raises:
        ConfigError: ``fit_on`` is none of those, or cannot be fitted on.
    """
    key = pickle.dumps((workload, time_scale, fit_on, design))
    p = _FITTED.get(key)
    if p is None:
        p = _FITTED[key] = _fit(workload, time_scale, fit_on, design)
    if isinstance(p, CrossFitted):
        return p.fresh()
    return replace(p, trajs={}, groups={}, finished={})


def _fit(workload: WorkloadConfig, time_scale: float, fit_on: str,
         design: str) -> Predictor | CrossFitted:
    from metasched.errors import ConfigError

    if fit_on not in FIT_ON:
        other = replace(workload, trace=fit_on)
        try:
            return Predictor.fit(_records(other, time_scale), design)
        except ValueError as e:
            raise ConfigError("predictor.fit_on", f"{fit_on}: {e}") from None
    if workload.trace is None:
        if fit_on == "cross":
            raise ConfigError("predictor.fit_on", "cross is for a trace workload (a "
                              "sampled profile fits on a training seed: use auto)")
        return Predictor.fit(_records(workload, time_scale), design)
    from metasched.sim.trace import read_trace

    folds = folds_of(read_trace(workload.trace).steps, FOLDS)
    try:
        return CrossFitted.fit(_records(workload, time_scale), folds, FOLDS, design)
    except ValueError as e:
        raise ConfigError("predictor.fit_on", f"{workload.trace}: {e}") from None


def fitted_ranker(workload: WorkloadConfig, time_scale: float = 1.0) -> Ranker:
    """The learned priority (:mod:`metasched.core.ranker`) fitted on the same training
    trajectories through :func:`fitted_predictor`'s predictor (``time_scale`` as
    there)."""
    key = pickle.dumps((workload, time_scale))
    r = _RANKERS.get(key)
    if r is None:
        p = fitted_predictor(workload, time_scale)
        if isinstance(p, CrossFitted):
            from metasched.errors import ConfigError

            raise ConfigError("learned_priority", "its ranker learns from the trajectories "
                              "it would rank: on a trace workload it is not run")
        r = _RANKERS[key] = fit_ranker(p,
                                       _records(workload, time_scale))
    return r


__all__ = ["DESIGN", "FIT_ON", "FOLDS", "TRAIN_DECISIONS", "TRAIN_SEED", "TRAIN_TRAJECTORIES",
           "fitted_predictor", "fitted_ranker"]
