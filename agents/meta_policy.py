"""A meta-policy over the rules, behind the ``Scheduler`` interface.

At the run's first decision the policy reads the workload features
(:func:`~metasched.agents.meta_options.workload_features`) and picks an option (a rule
with its settings); that rule then makes every decision. A choice sticks for the run:
low regret comes from picking the right rule for the workload, not from switching rules
decision by decision (the per-decision switch that pays, the endgame, is itself an
option). A *gate* watches the objective as steps finish and hands control to the
*fallback* (the rule that is best for the objective over the training workloads, the
policy's starting point) when the chosen option's figure so far is worse than the
fallback's estimate for these features by more than that estimate's error.

A checkpoint of a meta-policy is a directory with ``metadata.json`` (its ``meta_policy``
entry: options, features and their scaling, objective, caps, fallback, the gate's
per-option estimates, how it was trained) and ``meta_policy.npz`` (the network). The
network is a small MLP (features -> hidden tanh -> one logit per option), run in NumPy.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from metasched.agents.meta_options import FEATURES, Option, option, workload_features
from metasched.core.actions import Grant
from metasched.core.scheduler import Scheduler
from metasched.core.state import ClusterState
from metasched.errors import ConfigError

META_WEIGHTS = "meta_policy.npz"
META_VERSION = 1
OBJECTIVES = ("step", "act", "throughput")


class MetaNetwork:
    """Logits over the options from standardised features (NumPy forward pass)."""

    def __init__(self, w1: np.ndarray, b1: np.ndarray, w2: np.ndarray, b2: np.ndarray,
                 mean: np.ndarray, std: np.ndarray) -> None:
        self.w1, self.b1, self.w2, self.b2 = w1, b1, w2, b2
        self.mean, self.std = mean, std

    def logits(self, x: np.ndarray) -> np.ndarray:
        """One logit per option for features ``x`` (one row or a batch)."""
        h = np.tanh(((x - self.mean) / self.std) @ self.w1 + self.b1)
        return h @ self.w2 + self.b2

    def save(self, path: Path) -> None:
        np.savez(path, w1=self.w1, b1=self.b1, w2=self.w2, b2=self.b2, mean=self.mean,
                 std=self.std)

    @classmethod
    def load(cls, path: Path) -> MetaNetwork:
        with np.load(path) as z:
            return cls(z["w1"], z["b1"], z["w2"], z["b2"], z["mean"], z["std"])


class ValueEstimates:
    """Per option, a linear estimate of the log objective figure (lower is better) from
    the standardised features, with its residual spread: what the gate compares with."""

    def __init__(self, coef: np.ndarray, spread: np.ndarray, mean: np.ndarray,
                 std: np.ndarray) -> None:
        self.coef, self.spread, self.mean, self.std = coef, spread, mean, std

    def log_figure(self, x: np.ndarray, k: int) -> float:
        """The estimated log figure of option ``k`` for features ``x``."""
        z = (x - self.mean) / self.std
        return float(self.coef[k, 0] + z @ self.coef[k, 1:])

    @classmethod
    def fit(cls, x: np.ndarray, log_fig: np.ndarray, mean: np.ndarray, std: np.ndarray,
            ridge: float = 1.0) -> ValueEstimates:
        """Ridge regression of each option's ``log_fig`` column on ``x``."""
        z = np.hstack([np.ones((len(x), 1)), (x - mean) / std])
        reg = ridge * np.eye(z.shape[1])
        reg[0, 0] = 0.0
        coef = np.linalg.solve(z.T @ z + reg, z.T @ log_fig).T
        spread = (log_fig - z @ coef.T).std(axis=0)
        return cls(coef, spread, mean, std)


def objective_figure(state: ClusterState, objective: str, since: int) -> float | None:
    """The run's figure so far for ``objective`` (lower is better), from the finished
    steps (step, throughput) or the actions ended after the ``since``-th (act); None
    before there is one."""
    m = state.metrics
    if objective == "act":
        end, sub = m.end, m.submit
        n = len(end)
        if n <= since:
            return None
        return float(np.mean(np.asarray(end[since:n]) - np.asarray(sub[since:n])))
    steps = m.steps
    if not steps:
        return None
    span = [b - a for a, b in steps]
    return float(np.mean(span)) if objective == "step" else float(steps[-1][1] / len(steps))


class MetaScheduler(Scheduler):
    """Chooses a rule at the run's first decision; the gate may hand control to the
    fallback rule later in the run.

    Attributes (after the first decision): ``choice`` (the option chosen), ``active``
    (the option deciding now), ``gated`` (whether the gate handed over).
    """

    def __init__(self, network: MetaNetwork, options: list[Option], fallback: str,
                 objective: str = "step", values: ValueEstimates | None = None,
                 name: str = "meta", gate: bool = True) -> None:
        self.network, self.options, self.objective = network, options, objective
        self.values, self.name, self.use_gate = values, name, gate
        names = [o.name for o in options]
        if fallback not in names:
            raise ConfigError("checkpoint", f"{name}: fallback {fallback!r} is not an option")
        self.fallback = names.index(fallback)
        self.choice: Option | None = None
        self.active: Option | None = None

    def reset(self, state: ClusterState, rng: np.random.Generator) -> None:
        self._rng = rng
        self._rule: Scheduler | None = None
        self.choice = self.active = None
        self.gated = False
        self._features: np.ndarray | None = None
        self._limit: float | None = None
        self._steps_seen = 0

    def choose(self, x: np.ndarray) -> int:
        """The option index the network picks for features ``x`` (its argmax)."""
        return int(np.argmax(self.network.logits(x)))

    def _hand_to(self, state: ClusterState, k: int) -> None:
        self.active = self.options[k]
        state.generation_order = self.active.generation
        self._rule = self.active.build()
        self._rule.reset(state, self._rng)

    def gate_limit(self, x: np.ndarray, k: int) -> float | None:
        """The log of the run's figure above which the gate hands over, for features ``x``
        and chosen option ``k`` (None where the gate never acts: it is off, there are no
        estimates, or ``k`` is the fallback itself)."""
        if not self.use_gate or self.values is None or k == self.fallback:
            return None
        return (self.values.log_figure(x, self.fallback)
                + 2.0 * float(self.values.spread[self.fallback]))

    def _gate(self, state: ClusterState) -> None:
        """Hand over to the fallback once the chosen option is worse than the fallback's
        estimate by more than twice its spread (checked as steps finish)."""
        n = len(state.metrics.steps)
        if n == self._steps_seen:
            return
        self._steps_seen = n
        fig = objective_figure(state, self.objective, 0)
        if fig is None or fig <= 0:
            return
        if math.log(fig) > self._limit:
            self.gated = True
            self._hand_to(state, self.fallback)

    def decide(self, state: ClusterState) -> list[Grant]:
        if self._rule is None:
            self._features = workload_features(state)
            k = self.choose(self._features)
            self.choice = self.options[k]
            self._limit = self.gate_limit(self._features, k)
            self._hand_to(state, k)
        elif self._limit is not None and not self.gated:
            self._gate(state)
        return self._rule.decide(state)


def is_meta_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a meta-policy checkpoint directory."""
    p = Path(path)
    try:
        return (p / META_WEIGHTS).is_file() and "meta_policy" in json.loads(
            (p / "metadata.json").read_text())
    except (OSError, ValueError):
        return False


def save_meta_checkpoint(path: str | Path, network: MetaNetwork, options: list[Option],
                         fallback: str, objective: str, caps: dict[str, float],
                         values: ValueEstimates, extra: dict[str, Any]) -> Path:
    """Write a meta-policy checkpoint directory (see the module's docstring)."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    network.save(out / META_WEIGHTS)
    meta = {"meta_policy": {
        "version": META_VERSION, "objective": objective, "caps": caps, "fallback": fallback,
        "options": [{"name": o.name, "rule": o.rule, "params": o.params,
                     **({"generation": o.generation} if o.generation else {})}
                    for o in options],
        "features": list(FEATURES),
        "values": {"coef": values.coef.tolist(), "spread": values.spread.tolist()}},
        **extra}
    (out / "metadata.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    return out


def load_meta_checkpoint(path: str | Path, gate: bool = True) -> MetaScheduler:
    """The meta-policy of a checkpoint directory, checked against this code's options
    and features."""
    p = Path(path)
    try:
        meta = json.loads((p / "metadata.json").read_text())["meta_policy"]
        net = MetaNetwork.load(p / META_WEIGHTS)
        version, feats = meta["version"], meta["features"]
        opts = [Option(o["name"], o["rule"], o["params"], o.get("generation"))
                for o in meta["options"]]
        coef, spread = np.asarray(meta["values"]["coef"]), np.asarray(meta["values"]["spread"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError("checkpoint", f"{p} is an unreadable meta-policy ({e!r})") from None
    if version != META_VERSION or feats != list(FEATURES):
        raise ConfigError("checkpoint", f"{p} was trained on meta-policy v{version} with "
                          "other features; retrain with metasched-train-meta")
    for o in opts:
        try:
            option(o.name)
        except ValueError as e:
            raise ConfigError("checkpoint", f"{p}: {e}") from None
    values = ValueEstimates(coef, spread, net.mean, net.std)
    return MetaScheduler(net, opts, meta["fallback"], meta["objective"], values,
                         name=str(path), gate=gate)


__all__ = ["META_WEIGHTS", "OBJECTIVES", "MetaNetwork", "MetaScheduler", "ValueEstimates",
           "is_meta_checkpoint", "load_meta_checkpoint", "objective_figure",
           "save_meta_checkpoint"]
