"""Gradient-boosted regression trees for a quantile, in numpy alone.

A small histogram booster (the design LightGBM's quantile objective uses): features are
cut into at most ``bins`` quantile bins once; each round fits a depth-``depth`` tree to
the pinball loss's gradient (``alpha`` where the residual is positive, ``alpha - 1``
where it is negative) by the variance-gain of the splits, then sets each leaf to the
``alpha``-quantile of the residuals that reach it, shrunk by ``rate``. Trees are full and
of one depth, stored as arrays, so a prediction walks every tree at once.

    model = QuantileBoost.fit(x, y, alpha=0.5)
    model.predict(x_new)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class QuantileBoost:
    """A fitted ensemble (see the module docstring): ``edges[j]`` the bin edges of
    feature ``j``; per tree, per inner node (heap order), its feature and bin threshold
    (right when the bin is above it); per tree, per leaf, its value."""

    alpha: float
    base: float
    edges: tuple[np.ndarray, ...]
    feature: np.ndarray  # (trees, 2**depth - 1) int
    threshold: np.ndarray  # (trees, 2**depth - 1) int
    leaf: np.ndarray  # (trees, 2**depth) float, the rate already applied

    @property
    def depth(self) -> int:
        """Every tree's depth."""
        return int(np.log2(self.leaf.shape[1]))

    def binned(self, x: np.ndarray) -> np.ndarray:
        """``x`` (rows × features) as bin indices."""
        x = np.atleast_2d(np.asarray(x, dtype=float))
        return np.column_stack([np.searchsorted(e, x[:, j], side="right")
                                for j, e in enumerate(self.edges)]).astype(np.int16)

    def predict(self, x: np.ndarray) -> np.ndarray:
        """The ``alpha``-quantile predicted for each row of ``x``."""
        xb = self.binned(x)
        n, t = len(xb), len(self.leaf)
        node = np.zeros((n, t), dtype=np.int64)
        trees = np.arange(t)
        for _ in range(self.depth):
            f = self.feature[trees, node]
            right = xb[np.arange(n)[:, None], f] > self.threshold[trees, node]
            node = 2 * node + 1 + right
        leaves = node - (self.leaf.shape[1] - 1)
        return self.base + self.leaf[trees, leaves].sum(axis=1)

    @classmethod
    def fit(cls, x: np.ndarray, y: np.ndarray, alpha: float = 0.5, *, trees: int = 150,
            depth: int = 4, rate: float = 0.1, min_leaf: int = 50, bins: int = 32,
            seed: int = 0, subsample: float = 0.7) -> QuantileBoost:
        """Fit to rows ``x`` and targets ``y`` (see the module docstring); ``subsample``:
        the share of rows each tree sees (drawn with ``seed``)."""
        if not 0.0 < alpha < 1.0:
            raise ValueError(f"alpha must be in (0, 1) (got {alpha})")
        x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
        if x.ndim != 2 or len(x) != len(y) or not len(y):
            raise ValueError("x must be rows × features with one target per row")
        qs = np.linspace(0.0, 1.0, bins + 1)[1:-1]
        edges = tuple(np.unique(np.quantile(x[:, j], qs)) for j in range(x.shape[1]))
        probe = cls(alpha, 0.0, edges, np.zeros((0, 1), int), np.zeros((0, 1), int),
                    np.zeros((0, 2)))
        xb = probe.binned(x).astype(np.int64)
        nb = bins + 1
        base = float(np.quantile(y, alpha))
        f = np.full(len(y), base)
        rng = np.random.default_rng(seed)
        n_inner, n_leaf = 2 ** depth - 1, 2 ** depth
        feats = np.zeros((trees, n_inner), dtype=np.int64)
        thrs = np.full((trees, n_inner), nb, dtype=np.int64)  # nb: everything goes left
        leaves = np.zeros((trees, n_leaf))
        for t in range(trees):
            resid = y - f
            rows = np.flatnonzero(rng.random(len(y)) < subsample)
            g = np.where(resid[rows] > 0, alpha, alpha - 1.0)
            node = np.zeros(len(rows), dtype=np.int64)
            xr = xb[rows]
            for level in range(depth):
                first = 2 ** level - 1
                width = 2 ** level
                local = node - first
                best_gain = np.full(width, 0.0)
                for j in range(x.shape[1]):
                    idx = local * nb + xr[:, j]
                    cnt = np.bincount(idx, minlength=width * nb).reshape(width, nb)
                    sg = np.bincount(idx, weights=g, minlength=width * nb).reshape(width, nb)
                    c_left, s_left = cnt.cumsum(1), sg.cumsum(1)
                    c_all, s_all = c_left[:, -1:], s_left[:, -1:]
                    c_right, s_right = c_all - c_left, s_all - s_left
                    ok = (c_left >= min_leaf) & (c_right >= min_leaf)
                    with np.errstate(divide="ignore", invalid="ignore"):
                        gain = np.where(ok, s_left ** 2 / c_left + s_right ** 2 / c_right
                                        - s_all ** 2 / np.maximum(c_all, 1), 0.0)
                    b = gain.argmax(1)
                    gb = gain[np.arange(width), b]
                    better = gb > best_gain + 1e-12
                    best_gain[better] = gb[better]
                    feats[t, first:first + width][better] = j
                    thrs[t, first:first + width][better] = b[better]
                nf, nt = feats[t, node], thrs[t, node]
                node = 2 * node + 1 + (xr[np.arange(len(rows)), nf] > nt)
            # Leaf values from every row (not only the subsample): the residuals' quantile.
            all_node = np.zeros(len(y), dtype=np.int64)
            for _ in range(depth):
                nf, nt = feats[t, all_node], thrs[t, all_node]
                all_node = 2 * all_node + 1 + (xb[np.arange(len(y)), nf] > nt)
            leaf_of = all_node - n_inner
            order = np.lexsort((resid, leaf_of))
            counts = np.bincount(leaf_of, minlength=n_leaf)
            starts = np.concatenate([[0], counts.cumsum()[:-1]])
            for k in np.flatnonzero(counts):
                r = resid[order[starts[k]:starts[k] + counts[k]]]
                leaves[t, k] = rate * float(np.quantile(r, alpha))
            f += leaves[t, leaf_of]
        return cls(alpha, base, edges, feats, thrs, leaves)


__all__ = ["QuantileBoost"]
