"""A learned priority over the remaining-work predictor's features: learning to rank
(pairwise, as in learning-to-rank schedulers for LLM serving) which of two trajectories
has the more remaining work.

Each decision point of a training replay (:func:`metasched.core.predictor.replay`) is a
row: the predictor's features and the logs of its p10/p50/p90 remaining time. Pairs are
decision points of one RL step close in time on the replay's clock (the ``window``
nearest in time), labelled by which has the more true remaining time; a linear score
on the standardised rows is fitted by pairwise logistic regression (scikit-learn's, an L2
penalty; the ``predict`` extra). A scheduler orders by the score, highest first
(``learned_priority``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from metasched.core.predictor import Predictor, TrajRecord, replay
from metasched.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Ranker:
    """A fitted linear score: ``((x - mean) / sd) @ w``."""

    mean: np.ndarray
    sd: np.ndarray
    w: np.ndarray

    def score(self, x: np.ndarray) -> float:
        """The priority of one row (higher: more remaining work)."""
        return float(((x - self.mean) / self.sd) @ self.w)


def row(p: Predictor, key: object) -> np.ndarray:
    """The ranker's row of trajectory ``key`` now: ``p``'s features and log quantiles
    (``p.remaining`` must know the action it queues)."""
    q = p.remaining(key)
    return np.concatenate([p.features(key), [math.log(q.p10), math.log(q.p50),
                                             math.log(q.p90)]])


def rows(p: Predictor, records: list[TrajRecord]) -> tuple[np.ndarray, ...]:
    """Per decision point of a replay of ``records``: its row, log true remaining time,
    RL step (the group key's first element; 0 without groups) and replay clock time."""
    starts: list[list[float]] = []
    for r in records:
        t, ts = 0.0, []
        for _, g, d in r.turns:
            ts.append(t + g)
            t += g + d
        starts.append(ts)
    x, y, step, t = [], [], [], []
    for d, _ in replay(p, records):
        x.append(row(p, d.key))
        y.append(math.log(max(d.remaining_s, 1e-3)))
        g = records[d.key].group
        step.append(g[0] if isinstance(g, tuple) else 0)
        t.append(starts[d.key][d.turn])
    return np.array(x), np.array(y), np.array(step), np.array(t)


def fit_ranker(p: Predictor, records: list[TrajRecord], window: int = 8,
               penalty: float = 1e-3) -> Ranker:
    """Fit on ``records`` replayed through ``p`` (see the module docstring)."""
    return fit_ranker_rows(*rows(p, records), window=window, penalty=penalty)


def fit_ranker_rows(x: np.ndarray, y: np.ndarray, step: np.ndarray, t: np.ndarray,
                    window: int = 8, penalty: float = 1e-3) -> Ranker:
    """Fit on :func:`rows`' arrays (see the module docstring): scikit-learn's logistic
    regression on the pairs' row differences, without intercept (the order of a pair
    is arbitrary), its L2 penalty ``penalty`` on the mean loss.

    Raises:
        ConfigError: scikit-learn (the ``predict`` extra) is not installed.
    """
    try:
        from sklearn.linear_model import LogisticRegression
    except ImportError:
        raise ConfigError("learned_priority", "its ranker needs scikit-learn: pip install "
                          "'metasched[predict]'") from None
    mean, sd = x.mean(0), x.std(0)
    sd[sd < 1e-9] = 1.0
    z = (x - mean) / sd
    order = np.lexsort((t, step))
    i_all, j_all = [], []
    for off in range(1, window + 1):
        i, j = order[:-off], order[off:]
        keep = (step[i] == step[j]) & (y[i] != y[j])
        i_all.append(i[keep]), j_all.append(j[keep])
    i, j = np.concatenate(i_all), np.concatenate(j_all)
    # Both orders of every pair: the two labels balanced, as the score is antisymmetric.
    dz = np.concatenate([z[i] - z[j], z[j] - z[i]])
    lab = np.concatenate([y[i] > y[j], y[j] > y[i]])
    if len(lab) == 0:
        return Ranker(mean, sd, np.zeros(z.shape[1]))
    # scikit-learn's loss is C x the summed log loss + |w|^2 / 2: C = 1 / (penalty x pairs).
    model = LogisticRegression(C=1.0 / (penalty * len(lab)), fit_intercept=False,
                               solver="newton-cholesky")
    return Ranker(mean, sd, model.fit(dz, lab).coef_[0])


def pair_accuracy(score: np.ndarray, y: np.ndarray, step: np.ndarray, t: np.ndarray,
                  window: int = 8) -> float:
    """The share of close-in-time pairs of one step (as :func:`fit_ranker` forms them)
    that ``score`` orders as the true remaining times ``y`` are ordered."""
    order = np.lexsort((t, step))
    hit = n = 0
    for off in range(1, window + 1):
        i, j = order[:-off], order[off:]
        keep = (step[i] == step[j]) & (y[i] != y[j])
        hit += int(((score[i] > score[j]) == (y[i] > y[j]))[keep].sum())
        n += int(keep.sum())
    return hit / max(n, 1)


__all__ = ["Ranker", "fit_ranker", "fit_ranker_rows", "pair_accuracy", "row", "rows"]
