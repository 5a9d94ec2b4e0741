"""The real-trace accuracy benchmark's progress design (benchmarks/predictor_real.py):
what it reads of a run is the run's past and the action it queues, never its future."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from metasched.core.predictor import TrajRecord

_BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _module():
    sys.path.insert(0, str(_BENCH))
    spec = importlib.util.spec_from_file_location("predictor_real", _BENCH / "predictor_real.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _model(told: bool):
    m = object.__new__(_module().ProgressModel)
    m.vocab, m.told, m.split = {"Bash": 0, "Edit": 1, "Read": 2}, told, False
    return m


RUN = TrajRecord("t", (0, "p"), (("Read", 0.0, 1.0), ("Bash", 2.0, 8.0), ("Edit", 3.0, 0.5),
                                  ("Bash", 1.0, 20.0), ("reward", 0.5, 0.01)))


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_progress_features_do_not_see_the_future(k: int) -> None:
    """Rewriting every turn after ``k`` (names and times) leaves turn ``k``'s row as it
    was; the bound told the remaining turns is the one row that reads them."""
    other = TrajRecord(RUN.task, RUN.group, RUN.turns[:k + 1]
                       + tuple(("Read", 9.0, 99.0) for _ in range(7)))
    m = _model(told=False)
    np.testing.assert_array_equal(m.row(RUN, k), m.row(other, k))
    told = _model(told=True)
    assert told.row(RUN, k)[-1] == pytest.approx(math.log(len(RUN.turns) - k))
    assert told.row(other, k)[-1] != told.row(RUN, k)[-1]


def test_progress_features_read_the_past() -> None:
    """At turn 3: shares of the tools so far, turns since each, the queued and last tool,
    the mean action time and gap so far, the last action's, the gap just ended."""
    row = _model(told=False).row(RUN, 3)
    np.testing.assert_allclose(row[:3], [1 / 3, 1 / 3, 1 / 3])  # Bash, Edit, Read
    np.testing.assert_allclose(row[3:6], np.log1p([1, 0, 2]))
    assert row[6:8].tolist() == [0, 1]  # queued Bash, last Edit
    np.testing.assert_allclose(row[8:], np.log([np.mean([1.0, 8.0, 0.5]),
                                                np.mean([2.0, 3.0, 1.0]), 0.5, 1.0]))
