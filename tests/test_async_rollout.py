"""Asynchronous rollouts: the staleness bound (AReaL's ``max_head_offpolicyness``) is
never exceeded, throughput and latency are measured as defined, and the default stays
synchronous."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from helpers import shrunk

from metasched.agents import make_scheduler
from metasched.compose import compose, load_profile
from metasched.core.actions import ActionSpec, Turn
from metasched.core.staleness import StalenessGate
from metasched.errors import ConfigError
from metasched.evaluation.runs import evaluate
from metasched.sim.sampling import TrajectorySpec, WorkloadInstance
from metasched.sim.simulator import Simulator


def _trained_at(batch_end: list[float], gap: float) -> list[float]:
    """When the trainer finishes each batch: one at a time, ``gap`` seconds each."""
    out, free = [], 0.0
    for end in batch_end:
        free = max(end, free) + gap
        out.append(free)
    return out


@pytest.mark.parametrize("scheduler", ["fifo", "critical_path"])
@pytest.mark.parametrize("ofp,gap", [(0, 5.0), (1, 0.0), (2, 0.0), (1, 30.0)])
@pytest.mark.parametrize("name", ["retool_grouped", "swe_grouped"])
def test_staleness_bound_never_exceeded(name, ofp, gap, scheduler):
    w, c = shrunk(name, load=0.125, steps=4)
    w = dataclasses.replace(w, max_offpolicyness=ofp, step_gap_s=gap)
    batch = w.trajectories_per_step
    sim = Simulator(w, c, 11, max_wait_s=300)
    r = sim.run(make_scheduler(scheduler))
    ro = r.rollout
    assert ro.end.size == w.steps * batch  # every trajectory ran
    assert sim.rollout.gate.most_ahead <= ofp * batch
    # Independently of the gate: the i-th start came while at most (ofp + v + 1) x batch
    # had started, v the batches the trainer had finished by then.
    trained = _trained_at(sorted(r.step_end), gap)
    for i, t in enumerate(np.sort(ro.start)):
        v = int(np.searchsorted(trained, t, side="right"))
        assert i < (ofp + v + 1) * batch
    assert (ro.latency > 0).all() and (ro.staleness >= 0).all()


@pytest.mark.parametrize("scheduler", ["fifo", "critical_path"])
def test_no_offpolicyness_and_no_gap_is_synchronous(scheduler):
    w, c = shrunk("retool_grouped", load=0.125, steps=3)
    sync = Simulator(w, c, 5, max_wait_s=300).run(make_scheduler(scheduler))
    asyn = Simulator(dataclasses.replace(w, max_offpolicyness=0), c, 5,
                     max_wait_s=300).run(make_scheduler(scheduler))
    assert np.array_equal(sync.act, asyn.act)
    assert np.array_equal(sync.step_s, asyn.step_s)
    assert asyn.rollout.staleness.max() == 0
    assert sync.rollout is None


def _cpu(true_s: float) -> ActionSpec:
    return ActionSpec("cpu", "x", true_s, true_s, 1e9)


# Four trajectories (two batches of two), each 1 s of generation then 10 s on the one
# core, served first come first served: ends, latencies and throughput by hand.
@pytest.mark.parametrize("ofp,ends,starts", [
    (None, [11, 21, 32, 42], [0, 0, 21, 21]),  # synchronous: the barrier at 21
    (0, [11, 21, 32, 42], [0, 0, 21, 21]),  # the next batch starts once one is trained
    (1, [11, 21, 31, 41], [0, 0, 0, 0]),  # all four start at once
])
def test_throughput_and_latency_by_hand(make_cluster, ofp, ends, starts):
    w, _ = shrunk("retool", load=0.1)
    w = dataclasses.replace(w, steps=2, trajectories_per_step=2, max_offpolicyness=ofp)
    t = TrajectorySpec("t", (Turn(1.0, _cpu(10.0)),), None)
    inst = WorkloadInstance(steps=[[t, t], [t, t]])
    sim = Simulator(w, make_cluster(cores=1), 0, instance=inst)
    r = sim.run(make_scheduler("fifo"))
    if ofp is None:
        assert r.rollout is None
        assert sorted(r.end) == ends
        return
    ro = r.rollout
    assert sorted(ro.end) == ends and sorted(ro.start) == starts
    assert ro.latency.mean() == pytest.approx(np.mean(np.subtract(ends, starts)))
    assert ro.per_hour() == pytest.approx(3600.0 * 4 / ends[-1])


def test_eval_reports_throughput_and_latency_paired():
    cfg = compose("eval", ["workload=retool_grouped", "+workload.max_offpolicyness=1",
                           "workload.trajectories_per_step=32", "workload.steps=2"])
    w, c = load_profile(cfg)
    assert w.max_offpolicyness == 1
    doc, runs = evaluate(w, c, ["rate_greedy", "critical_path"], [1000000, 1000001],
                         max_wait_s=300, progress=False)
    from metasched.evaluation.report import results_table

    for name in ("rate_greedy", "critical_path"):
        s = doc["schedulers"][name]
        per = [r["rollout"] for r in runs if r["scheduler"] == name]
        assert s["trajectories_per_hour"] == pytest.approx(
            np.mean([p["trajectories_per_hour"] for p in per]))
        assert s["mean_traj_latency_s"] == pytest.approx(
            np.mean([p["mean_traj_latency_s"] for p in per]))
        assert s["max_offpolicyness"] == 1
        assert "trajectories_per_hour" in s["paired"]
    assert "trajectories/h" in results_table(doc)


def test_synchronous_results_have_no_rollout_keys():
    w, c = shrunk("retool_grouped", load=0.06)
    doc, runs = evaluate(w, c, ["fifo"], [1000000], max_wait_s=300, progress=False)
    assert "rollout" not in runs[0]
    assert "trajectories_per_hour" not in doc["schedulers"]["fifo"]


@pytest.mark.parametrize("bad", ["-1", "1.5", "true"])
def test_bad_offpolicyness_is_one_line_error(bad):
    cfg = compose("eval", ["workload=retool_grouped", f"+workload.max_offpolicyness={bad}"])
    with pytest.raises(ConfigError, match="max_offpolicyness"):
        load_profile(cfg)


@pytest.mark.parametrize("batch,ofp", [(1, 0), (4, 0), (4, 2), (16, 1)])
def test_gate_counts(batch, ofp):
    gate = StalenessGate(batch, ofp)
    assert gate.room() == (ofp + 1) * batch
    for _ in range((ofp + 1) * batch):
        gate.start()
    assert gate.room() == 0
    with pytest.raises(RuntimeError):
        gate.start()
    done = [gate.finish() for _ in range(batch)]
    assert done == [False] * (batch - 1) + [True]
    assert gate.room() == 0  # the batch is complete but not trained on
    gate.trained()
    assert gate.version == 1 and gate.room() == batch
    with pytest.raises(RuntimeError):
        gate.trained()


def _grid():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "grid", Path(__file__).resolve().parents[1] / "benchmarks" / "grid.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_grid_async_ratios_by_hand():
    def sched(tph, lat, act):
        return {"trajectories_per_hour": float(np.mean(tph)),
                "mean_traj_latency_s": float(np.mean(lat)), "mean_act_s": float(np.mean(act)),
                "max_staleness": 2, "per_seed": {"seeds": [0, 1, 2], "trajectories_per_hour": tph,
                                                 "mean_traj_latency_s": lat, "mean_act_s": act}}

    doc = {"schedulers": {"fifo": sched([100.0, 110.0, 90.0], [50.0, 60.0, 55.0], [3.0] * 3),
                          "rate_greedy": sched([90.0, 99.0, 81.0], [40.0, 48.0, 44.0], [1.0] * 3),
                          "learned": sched([110.0, 121.0, 99.0], [36.0, 43.2, 39.6], [1.5] * 3)}}
    a = _grid().async_ratios(doc, ["fifo", "rate_greedy"])
    assert a["best"] == {"trajectories_per_hour": "fifo", "mean_traj_latency_s": "rate_greedy",
                         "mean_act_s": "rate_greedy"}
    r = a["schedulers"]["learned"]
    assert r["trajectories_per_hour_vs_best"]["ratio"] == pytest.approx(1.1)
    assert r["mean_traj_latency_s_vs_best"]["ratio"] == pytest.approx(0.9)
    assert r["mean_act_s_vs_best"]["ratio"] == pytest.approx(1.5)
    grid = {"points": {"p-async": {"results": doc}}}
    assert "p-async (best trajectories/h: fifo" in _grid().async_table(grid)
    assert _grid().step_table(grid) == ""  # no synchronous point


@pytest.mark.parametrize("point", ["retool_grouped-async", "swe_grouped-async"])
def test_grid_async_points_compose(point):
    grid = _grid()
    w, _, s = grid.point_settings(point, ["fifo"], 2, 1000000)
    assert w.max_offpolicyness == 1
    assert grid.step_lower_bounds(point, [1000000]) is None
