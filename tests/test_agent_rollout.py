"""The live demonstration (``examples/agent_rollout.py``) runs both modes end to end on a
small workload and reports every figure it promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.subprocess

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "agent_rollout.py"


@pytest.mark.slow
def test_both_modes_run_and_report(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, str(SCRIPT), "--trajectories", "3", "--workers", "2",
                        "--time-scale", "0.05", "--out", str(out)], capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "| mean ACT, all tool calls (s) |" in p.stdout
    results = json.loads(out.read_text())
    assert set(results) == {"today", "metasched"}
    assert results["today"]["scheduler"] == "static"
    for r in results.values():
        assert sum(r["failed"].values()) == 0 and r["calls"]["reward"] == 3
        assert r["step_s"] > 0 and r["mean_act_s"] > 0
        calls = r["timeline"]  # every call, on one clock from the rollout's start
        assert len(calls) == sum(r["calls"].values())
        assert all(0 <= c["issued_s"] <= c["answered_s"] <= r["step_s"] for c in calls)
        last = r["last_trajectory"]
        assert last["end_s"] == max(c["answered_s"] for c in calls)
        mine = [c for c in calls if c["trajectory"] == last["trajectory"]]
        assert sum(last[f"{k}_s"] for k in ("python", "tests", "search", "reward")) == (
            pytest.approx(sum(c["answered_s"] - c["issued_s"] for c in mine)))


def test_bad_arguments_are_one_line(tmp_path):
    p = subprocess.run([sys.executable, str(SCRIPT), "--trajectories", "0"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--trajectories: must be >= 1" in p.stderr
