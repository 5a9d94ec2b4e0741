"""The online cost model: an action's estimated duration as the live dispatcher knows it.

A live dispatcher cannot know an action's duration in advance: it learns one per action
signature (``kind:task:name``) as an exponentially weighted moving average of measured
durations, normalised to the simulator's units (one core for cpu actions, via the
action's Amdahl parallel fraction; one request alone for gpu; the call for api). Before
a signature has been measured, the caller's ``est_s`` is used, then ``default_s``.

The simulator runs the same model when given one (``Simulator(cost_model=...)``), so
that a scheduler judged in simulation sees the estimates it will see live, instead of
the profile's per-action estimates.

A cost model may hold a remaining-work predictor (``predictor``, see
:mod:`metasched.core.predictor`): every measurement ``learn`` takes is handed to it too,
so it is updated online on both clocks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from metasched.core.actions import Action, amdahl_run_s
from metasched.errors import one_of

if TYPE_CHECKING:
    from metasched.core.predictor import Predictor


def signature(kind: str, task: str | None, name: str) -> str:
    """``kind:task:name``: what the cost model learns durations of."""
    return f"{kind}:{task}:{name}"


class CostModel:
    """EWMA of measured durations per action signature.

    Args:
        alpha: weight of the newest measurement (0 < alpha <= 1).
        default_s: estimate for a signature never measured and without a caller's hint.
        floor_s: smallest estimate handed out (the encoder takes logs of estimates).
        predictor: a remaining-work predictor that ``learn`` feeds as well (None: none).
    """

    def __init__(self, alpha: float = 0.3, default_s: float = 1.0, floor_s: float = 1e-3,
                 predictor: Predictor | None = None) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1] (got {alpha})")
        if not default_s > 0.0 or not floor_s > 0.0:
            raise ValueError("default_s and floor_s must be > 0")
        self.alpha = alpha
        self.default_s = default_s
        self.floor_s = floor_s
        self.mean: dict[str, float] = {}
        self.count: dict[str, int] = {}
        self.predictor = predictor

    def estimate(self, signature: str, hint: float | None = None) -> float:
        """The estimate for the next action of ``signature``."""
        m = self.mean.get(signature)
        if m is None:
            m = hint if hint is not None else self.default_s
        return max(self.floor_s, m)

    def observe(self, signature: str, run_s: float, *, cores: int = 1,
                parallel_fraction: float = 0.0) -> None:
        """Learn from one measured run of ``run_s`` seconds on ``cores`` cores."""
        if not run_s >= 0.0:
            return
        # Back to one-core seconds: run on k cores = base x ((1 - p) + p / k).
        base = run_s / amdahl_run_s(1.0, parallel_fraction, max(1, cores))
        m = self.mean.get(signature)
        self.mean[signature] = base if m is None else m + self.alpha * (base - m)
        self.count[signature] = self.count.get(signature, 0) + 1

    def learn(self, a: Action, run_s: float) -> None:
        """Learn from action ``a`` having run ``run_s`` seconds (without a gpu service's
        restore) on its granted cores; both clocks call this."""
        spec = a.spec
        self.observe(signature(spec.kind, a.task, spec.name), run_s, cores=max(1, a.cores),
                     parallel_fraction=spec.parallel_fraction)
        if self.predictor is not None:
            self.predictor.observe_action(a, run_s)

    def save(self, path: str | Path) -> None:
        """Write the learned estimates as JSON (to warm-start the next dispatcher)."""
        Path(path).write_text(json.dumps({"alpha": self.alpha, "mean": self.mean,
                                          "count": self.count}, indent=1))

    def load(self, path: str | Path) -> None:
        """Merge estimates saved by :meth:`save` (a missing file is not an error)."""
        p = Path(path)
        if not p.exists():
            return
        doc = json.loads(p.read_text())
        self.mean.update({str(k): float(v) for k, v in doc.get("mean", {}).items()})
        self.count.update({str(k): int(v) for k, v in doc.get("count", {}).items()})


__all__ = ["ESTIMATES", "CostModel", "cost_model_for", "signature"]

# Where schedulers' estimates come from (``estimates`` settings, both clocks): each
# action's own (``"given"``: a profile's noisy ones, a trace's, or a request's), or the
# online cost model learned from the run's measured durations (``"online"``).
ESTIMATES = ("given", "online")


def cost_model_for(estimates: str) -> CostModel | None:
    """The ``cost_model`` argument of an ``estimates`` setting (``ESTIMATES``): None, or
    a fresh ``CostModel`` with the dispatcher's defaults."""
    one_of(estimates, ESTIMATES, "estimates")
    return CostModel() if estimates == "online" else None
