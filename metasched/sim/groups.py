"""Prompt groups: the structure GRPO gives a rollout.

Each prompt is sampled ``size`` times, and the prompt carries much of the outcome: a
latent per-prompt difficulty ``D ~ N(0, 1)`` scales every sibling's turn count, action
durations and generation gaps; a per-trajectory latent (persistence) scales its own
actions and gaps beyond that. A draw of a profile distribution is ``dist`` at the normal
score

    z = a * D + p * U + s * E,    a^2 + p^2 + s^2 = 1,

(``U``: the trajectory's latent, ``E``: the draw's own noise, all standard normal and
independent; for turn counts ``D`` is ``c D + sqrt(1 - c^2) D'``, ``c`` the
``turns_coupling`` and ``D'`` a second per-prompt normal), so every marginal is the
profile's distribution, unchanged.

The profile gives shares of variance, as a one-way random-effects ANOVA measures them on
real runs: ``share`` is the fraction of the variance of the log of a draw that the
prompt explains (``Var E[log x | D] / Var log x``), ``persistence`` the further fraction
the trajectory explains. The loadings ``a`` and ``p`` that give them are solved
numerically through the distribution's shape (its two-slope tail, its clipping, the
rounding of turn counts), where a plain log-normal would have ``a^2 = share``.

``size: 1`` with no share is the default: independent trajectories, drawn exactly as
before (the same random stream). Turn counts have no persistence (one per trajectory);
their share is that of log(turns + 1), the agent's turns counting its final answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
from pydantic import ValidationInfo, model_validator

from metasched.core.schema import Count, Fraction, Number, Strict, parse
from metasched.errors import ConfigError

MAX_SHARE = 0.99  # share + persistence: some noise of its own is left to every draw


@dataclass(frozen=True, slots=True)
class GroupConfig:
    """A profile's prompt-group structure (``groups:``); see the module docstring.

    Attributes:
        size: responses per prompt (GRPO's n); 1 with no share: independent trajectories.
        turns: the prompt's share of the variance of log(turns + 1).
        generation_s: the prompt's share of a generation gap's log variance.
        duration_s: the prompt's share of an action's log-duration variance, for action
            types ``actions`` does not name.
        actions: per action name (``reward``: the reward action), its own share.
        persistence: the trajectory's further share of an action's log duration.
        generation_persistence: the trajectory's further share of a gap's log.
        turns_coupling: the correlation of the prompt's latent for turns with its latent
            for durations and gaps (1: one latent; below 1, a second per-prompt normal
            ``D'`` enters turns: ``c D + sqrt(1 - c^2) D'``).
    """

    size: int = 1
    turns: float = 0.0
    generation_s: float = 0.0
    duration_s: float = 0.0
    actions: tuple[tuple[str, float], ...] = ()
    persistence: float = 0.0
    generation_persistence: float = 0.0
    turns_coupling: float = 1.0

    @property
    def on(self) -> bool:
        """Whether trajectories are drawn in prompt groups (else as independent ones)."""
        return self.size > 1 or any((self.turns, self.generation_s, self.duration_s,
                                     self.persistence, self.generation_persistence,
                                     *(s for _, s in self.actions)))

    def action_share(self, name: str) -> float:
        """The prompt's share of the log duration of actions named ``name``."""
        return dict(self.actions).get(name, self.duration_s)


Share = Number(ge=0.0, le=MAX_SHARE)
"""A share of variance a latent explains (some noise is always left to the draw)."""


class _Groups(Strict):
    """``groups:`` as a profile gives it (:class:`GroupConfig`); a null share is 0, a
    null ``turns_coupling`` 1. The action names ``actions`` may use come in the
    validation context (``{"actions": names}``; absent: any)."""

    size: Count(1) = 1
    turns: Share | None = None
    generation_s: Share | None = None
    duration_s: Share | None = None
    actions: dict[Any, Share] | None = None
    persistence: Share | None = None
    generation_persistence: Share | None = None
    turns_coupling: Fraction | None = None

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> _Groups:
        names = (info.context or {}).get("actions")
        acts = self.actions or {}
        if names is not None:
            for name in sorted(acts, key=str):
                if name != "reward" and name not in names:
                    raise ConfigError(f"actions.{name}", f"unknown action (the profile's: "
                                      f"{', '.join(sorted(names | {'reward'}))})")
        duration = max([self.duration_s or 0.0, *acts.values()])
        for key, total in (("persistence", duration + (self.persistence or 0.0)),
                           ("generation_persistence", (self.generation_s or 0.0)
                            + (self.generation_persistence or 0.0))):
            if total > MAX_SHARE:
                raise ConfigError(key, f"share + persistence must be <= {MAX_SHARE} "
                                  f"(got {total:g})")
        return self

    def config(self) -> GroupConfig:
        acts = self.actions or {}
        return GroupConfig(
            size=self.size, turns=self.turns or 0.0, generation_s=self.generation_s or 0.0,
            duration_s=self.duration_s or 0.0,
            actions=tuple((str(n), acts[n]) for n in sorted(acts, key=str)),
            persistence=self.persistence or 0.0,
            generation_persistence=self.generation_persistence or 0.0,
            turns_coupling=1.0 if self.turns_coupling is None else self.turns_coupling)


def parse_groups(d: Any, path: str, action_names: set[str] | None = None) -> GroupConfig:
    """``{size, turns, generation_s, duration_s, actions: {name: share}, persistence,
    generation_persistence, turns_coupling}`` (absent or null: off); ``action_names``,
    when given, the names ``actions`` may use (``reward`` always)."""
    if d is None:
        return GroupConfig()
    return parse(_Groups, d, path, context={"actions": action_names}).config()


# ---------------------------------------------------------------- loadings

_GRID = np.linspace(-8.0, 8.0, 2001)  # normal scores, for the integrals below
_PHI = np.exp(-0.5 * _GRID ** 2)
_PHI /= _PHI.sum()
_GH_X, _GH_W = np.polynomial.hermite_e.hermegauss(40)  # E over D: smooth in D
_GH_W = _GH_W / _GH_W.sum()


def _log_value(dist, z: np.ndarray, counts: bool) -> np.ndarray:
    """log of ``dist`` at normal score ``z`` as it is drawn (clipped; a count rounded,
    plus one)."""
    x = np.clip(dist._unclipped(z), dist.lo, dist.hi)
    if counts:
        return np.log(np.round(x) + 1.0)
    return np.log(np.maximum(x, 1e-300))


def _explained(f: np.ndarray, loading: float) -> float:
    """The share of the variance of ``f`` (on ``_GRID``) that ``D`` explains at normal
    score ``loading * D + sqrt(1 - loading^2) * E``: Var E[f | D] / Var f."""
    mean = float(f @ _PHI)
    total = float(((f - mean) ** 2) @ _PHI)
    if total <= 0.0 or loading <= 0.0:
        return 0.0
    a = min(loading, 0.9999)
    s = math.sqrt(1.0 - a * a)
    # E[f | D = d] at the Gauss-Hermite nodes: f weighted by the normal density of E.
    e = -0.5 * ((_GRID[None, :] - a * _GH_X[:, None]) / s) ** 2
    k = np.exp(e - e.max(axis=1, keepdims=True))
    cond = (k @ f) / k.sum(axis=1)
    return float(((cond - mean) ** 2) @ _GH_W) / total


def explained(dist, loading: float, counts: bool = False) -> float:
    """The share of the variance of the log of a draw of ``dist`` explained by a latent
    of ``loading`` (the score ``loading * D + sqrt(1 - loading^2) * E``); ``counts``:
    the log of the rounded draw plus one (turns)."""
    return _explained(_log_value(dist, _GRID, counts), loading)


@lru_cache(maxsize=4096)
def loading_for(dist, share: float, counts: bool = False) -> float:
    """The loading whose latent explains ``share`` of the log's variance (bisection:
    the share grows with the loading); 0 for a constant."""
    if share <= 0.0 or (dist.sigma == 0.0 and dist.tail_sigma is None):
        return 0.0
    f = _log_value(dist, _GRID, counts)
    lo, hi = 0.0, 0.9999
    if _explained(f, hi) <= share:
        return hi
    for _ in range(30):
        mid = 0.5 * (lo + hi)
        if _explained(f, mid) < share:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


@dataclass(frozen=True, slots=True)
class Loadings:
    """Loadings (prompt ``a``, trajectory ``p``; the draw's own ``s``) of one kind of
    draw."""

    a: float = 0.0
    p: float = 0.0

    @property
    def s(self) -> float:
        return math.sqrt(max(0.0, 1.0 - self.a * self.a - self.p * self.p))

    @staticmethod
    def of(dist, share: float, persistence: float = 0.0, counts: bool = False) -> Loadings:
        """The loadings giving the prompt ``share`` and the trajectory ``persistence``
        more: the trajectory's whole share is that of the combined latent ``a D + p U``,
        a normal of variance ``a^2 + p^2``."""
        a = loading_for(dist, share, counts)
        if persistence <= 0.0:
            return Loadings(a, 0.0)
        both = loading_for(dist, min(MAX_SHARE, share + persistence), counts)
        return Loadings(a, math.sqrt(max(0.0, both * both - a * a)))


@dataclass(frozen=True)
class TaskLoadings:
    """Every loading of one task under a group structure."""

    turns: Loadings
    generation: Loadings
    actions: dict[str, Loadings] = field(default_factory=dict)  # name -> (reward: "reward")

    @staticmethod
    def of(task, g: GroupConfig) -> TaskLoadings:
        acts = {a.name: Loadings.of(a.duration_s, g.action_share(a.name), g.persistence)
                for a in task.actions}
        acts["reward"] = Loadings.of(task.reward.duration_s, g.action_share("reward"),
                                     g.persistence)
        return TaskLoadings(Loadings.of(task.turns, g.turns, counts=True),
                            Loadings.of(task.generation_s, g.generation_s,
                                        g.generation_persistence), acts)


# ---------------------------------------------------------------- measuring


def anova_share(values: np.ndarray, groups: np.ndarray) -> float:
    """The share of the variance of ``values`` between ``groups`` (labels): the one-way
    random-effects ANOVA estimate sigma_b^2 / (sigma_b^2 + sigma_w^2), unbalanced groups
    by the usual n0; 0 when the groups differ less than chance would make them; nan with
    fewer than two groups or no replicates."""
    values = np.asarray(values, float)
    _, idx, n = np.unique(np.asarray(groups), return_inverse=True, return_counts=True)
    k, total = len(n), len(values)
    if k < 2 or total <= k:
        return math.nan
    means = np.bincount(idx, weights=values) / n
    grand = values.mean()
    msb = float(n @ (means - grand) ** 2) / (k - 1)
    msw = float(((values - means[idx]) ** 2).sum()) / (total - k)
    n0 = (total - float((n * n).sum()) / total) / (k - 1)
    between = max(0.0, (msb - msw) / n0)
    return between / (between + msw) if between + msw > 0 else math.nan


def nested_shares(values: np.ndarray, prompts: np.ndarray, trajs: np.ndarray
                  ) -> tuple[float, float]:
    """Draws nested in trajectories nested in prompts (a trajectory's actions): the
    prompt's share of the variance of ``values`` and the trajectory's (the prompt's
    included), as moment estimates: the mean product of deviations over pairs of draws
    from different trajectories of one prompt, and over pairs of distinct draws of one
    trajectory, each over the variance. A one-way ANOVA by prompt would count the
    trajectory's persistence in the prompt's share where trajectories make several draws.
    nan where no such pair exists."""
    v = np.asarray(values, float)
    dev = v - v.mean()
    var = float(dev @ dev) / len(v) if len(v) else 0.0
    _, pi = np.unique(np.asarray(prompts), return_inverse=True)
    _, ti = np.unique(np.asarray(trajs), return_inverse=True)
    s_p = np.bincount(pi, weights=dev)
    n_p = np.bincount(pi).astype(float)
    s_t = np.bincount(ti, weights=dev)
    n_t = np.bincount(ti).astype(float)
    t_prompt = np.zeros(len(s_t), dtype=np.intp)
    t_prompt[ti] = pi
    sq_t = np.bincount(t_prompt, weights=s_t * s_t, minlength=len(s_p))
    nn_t = np.bincount(t_prompt, weights=n_t * n_t, minlength=len(s_p))
    pairs_p = float((n_p * n_p - nn_t).sum())
    pairs_t = float((n_t * n_t - n_t).sum())
    if var <= 0.0:
        return math.nan, math.nan
    between = float((s_p * s_p - sq_t).sum()) / pairs_p / var if pairs_p else math.nan
    within = (float((s_t * s_t).sum()) - float(dev @ dev)) / pairs_t / var if pairs_t \
        else math.nan
    return between, within


__all__ = ["GroupConfig", "Loadings", "TaskLoadings", "anova_share", "explained",
           "loading_for", "nested_shares", "parse_groups"]
