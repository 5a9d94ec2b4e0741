"""A remaining-work predictor cross-fitted by prompt group, for a replay of the very
trajectories it learns from (a trace workload): ``folds`` predictors, each fitted on the
trajectories of the other folds, and each trajectory served by the one that never saw
its prompt group. So no figure of a trace replay reads a model fitted on what it
replays.

A trajectory's fold is its prompt's (a stable hash of the prompt id), so siblings share
one; a trajectory without a prompt takes its RL step's. :class:`CrossFitted` answers
every call the simulator and the schedulers make of a
:class:`~metasched.core.predictor.Predictor` by handing it to the trajectory's fold's
predictor.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping

from metasched.core.predictor import Predictor, Quantiles, TrajRecord
from metasched.core.prompt_features import PromptInfo


def fold_of(prompt: str | None, step: int, folds: int) -> int:
    """The fold of a trajectory of ``prompt`` (None: unknown) in RL step ``step``."""
    if prompt is not None:
        return zlib.crc32(prompt.encode()) % folds
    return step % folds


def folds_of(steps: Iterable[Iterable], k: int) -> list[int]:
    """The fold of every trajectory spec of RL steps ``steps`` (in
    :func:`~metasched.core.predictor.records_of`'s order)."""
    return [fold_of(ts.prompt, i, k) for i, step in enumerate(steps) for ts in step]


class CrossFitted:
    """The cross-fitted predictor of the module docstring (build it with :meth:`fit`)."""

    def __init__(self, parts: list[Predictor]) -> None:
        self.parts = parts
        self.design = parts[0].design
        self._fold: dict[object, int] = {}

    @classmethod
    def fit(cls, records: list[TrajRecord], folds: list[int], k: int, design: str = "boost",
            prompts: Mapping[str, PromptInfo] | None = None) -> CrossFitted:
        """Fit on ``records`` whose folds (of ``k``) are ``folds`` (:func:`folds_of`).

        Raises:
            ValueError: fewer than two folds have trajectories (no prompts and one step).
        """
        if len(set(folds)) < 2:
            raise ValueError("cross-fitting needs prompt ids or several RL steps (give the "
                             "predictor other trajectories to fit on)")
        return cls([Predictor.fit([r for r, f in zip(records, folds, strict=True) if f != j],
                                  design, prompts) for j in range(k)])

    # ---------------------------------------------------------------- routing

    def _of_traj(self, traj) -> Predictor:
        k = self._fold.get(traj.id)
        if k is None:
            k = self._fold[traj.id] = fold_of(traj.prompt, traj.step, len(self.parts))
        return self.parts[k]

    def _of_key(self, key: object) -> Predictor | None:
        k = self._fold.get(key)
        return None if k is None else self.parts[k]

    # ---------------------------------------------------------------- the Predictor calls

    def observe_action(self, a, run_s: float) -> None:
        """As :meth:`Predictor.observe_action`, on the trajectory's fold."""
        if a.traj is not None:
            self._of_traj(a.traj).observe_action(a, run_s)

    def observe_gap(self, traj, gap_s: float) -> None:
        """As :meth:`Predictor.observe_gap`."""
        self._of_traj(traj).observe_gap(traj, gap_s)

    def remaining_of(self, traj, name: str | None = None) -> Quantiles:
        """As :meth:`Predictor.remaining_of`."""
        return self._of_traj(traj).remaining_of(traj, name)

    def remaining(self, key: object, task: str | None = None, group: object = None,
                  name: str | None = None) -> Quantiles:
        """As :meth:`Predictor.remaining` (a trajectory seen before)."""
        return self._part(key, group).remaining(key, task, group, name)

    def features(self, key: object):
        """As :meth:`Predictor.features` (a trajectory seen before)."""
        return self._part(key, None).features(key)

    def duration(self, key: object, name: str, task: str | None = None,
                 group: object = None) -> float:
        """As :meth:`Predictor.duration`."""
        return self._part(key, group).duration(key, name, task, group)

    def _part(self, key: object, group: object) -> Predictor:
        p = self._of_key(key)
        if p is not None:
            return p
        prompt = group[1] if isinstance(group, tuple) else None
        step = group[0] if isinstance(group, tuple) else 0
        self._fold[key] = fold_of(prompt, step, len(self.parts))
        return self.parts[self._fold[key]]

    def finish(self, key: object, turns: int | None = None) -> None:
        """As :meth:`Predictor.finish`."""
        p = self._of_key(key)
        if p is not None:
            p.finish(key, turns)

    def close(self, key: object, turns: int | None = None) -> None:
        """As :meth:`Predictor.close`."""
        p = self._of_key(key)
        if p is not None:
            p.close(key, turns)

    def forget_group(self, group: object) -> None:
        """As :meth:`Predictor.forget_group`."""
        for p in self.parts:
            p.forget_group(group)

    def static_duration(self, name: str) -> float:
        """The first fold's :meth:`Predictor.static_duration`."""
        return self.parts[0].static_duration(name)

    def static_remaining(self, task: str, turn: int) -> float:
        """The first fold's :meth:`Predictor.static_remaining`."""
        return self.parts[0].static_remaining(task, turn)

    def reset(self) -> None:
        """Forget all online state."""
        self._fold.clear()
        for p in self.parts:
            p.reset()

    def fresh(self) -> CrossFitted:
        """A copy with empty online state of its own (the fitted models shared)."""
        from dataclasses import replace

        return CrossFitted([replace(p, trajs={}, groups={}, finished={}) for p in self.parts])


__all__ = ["CrossFitted", "fold_of", "folds_of"]
