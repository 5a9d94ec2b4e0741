"""Quantile-boosted trees (metasched.core.boost): they learn a conditional quantile that
a constant cannot, their quantiles cover as asked on held-out rows, and bad input is a
one-line error."""

from __future__ import annotations

import numpy as np
import pytest

from metasched.core.boost import QuantileBoost


def _data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4))
    # A step, an interaction and heavy-tailed noise; x[:, 3] is irrelevant.
    y = np.where(x[:, 0] > 0.5, 2.0, 0.0) + x[:, 1] * (x[:, 2] > 0) \
        + 0.3 * rng.standard_t(3, size=n)
    return x, y


def test_the_median_beats_a_constant_and_nears_the_noise() -> None:
    x, y = _data(6000, 0)
    xt, yt = _data(3000, 1)
    m = QuantileBoost.fit(x, y, 0.5, trees=100)
    err = np.abs(m.predict(xt) - yt).mean()
    const = np.abs(np.median(y) - yt).mean()
    # The noise alone: E|0.3 t_3| = 0.33.
    assert err < 0.5 * const and err < 0.45


@pytest.mark.parametrize("alpha", [0.1, 0.9])
def test_quantiles_cover_as_asked_on_held_out_rows(alpha: float) -> None:
    x, y = _data(6000, 2)
    xt, yt = _data(3000, 3)
    below = np.mean(yt <= QuantileBoost.fit(x, y, alpha, trees=100).predict(xt))
    assert abs(below - alpha) < 0.04


def test_one_row_predicts_as_many() -> None:
    x, y = _data(2000, 4)
    m = QuantileBoost.fit(x, y, 0.5, trees=20)
    many = m.predict(x[:5])
    assert [float(m.predict(row)[0]) for row in x[:5]] == pytest.approx(list(many))


@pytest.mark.parametrize(("alpha", "x", "y", "match"), [
    (1.0, np.zeros((3, 1)), np.zeros(3), "alpha must be in"),
    (0.5, np.zeros(3), np.zeros(3), "rows × features"),
    (0.5, np.zeros((3, 1)), np.zeros(2), "rows × features"),
])
def test_bad_input_is_one_line(alpha, x, y, match) -> None:
    with pytest.raises(ValueError, match=match):
        QuantileBoost.fit(x, y, alpha)
