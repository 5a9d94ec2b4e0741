"""The look-ahead teacher over rate_greedy: forks that leave the original untouched, the
estimates-only redraw, and the teacher reducing to rate_greedy without alternatives."""

from __future__ import annotations

import copy
import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import shrunk

from metasched.agents import make_scheduler
from metasched.agents.lookahead import LookaheadTeacher, fork
from metasched.core.actions import ActionSpec, SandboxSpec, Turn
from metasched.sim.simulator import Simulator

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "lookahead_headroom.py"


def _contended(seed: int = 3) -> Simulator:
    """rm_math on one GPU (three reward models that do not fit together), two steps."""
    w, c = shrunk("rm_math", load=0.25, steps=2)
    return Simulator(w, replace(c, gpu_devices=1), seed, max_wait_s=300.0)


def _drive(sim: Simulator, decisions: int) -> None:
    """Run ``decisions`` decisions of rate_greedy on ``sim``."""
    sched = make_scheduler("rate_greedy")
    sched.reset(sim.state, sim.scheduler_rng())
    for _ in range(decisions):
        assert sim.next_decision()
        grants = sched.decide(sim.state)
        for g in grants:
            sim.apply(g)
        if not grants:
            sim.wait()


@pytest.mark.parametrize("spec", [
    ActionSpec("cpu", "x", 1.0, 1.0, 10.0), SandboxSpec(1.0, 0.5),
    Turn(0.1, ActionSpec("api", "c", 1.0, 1.0, 10.0, endpoint="e"))])
def test_immutable_specs_are_shared_by_copies(spec):
    assert copy.deepcopy(spec) is spec
    assert copy.copy(spec) is spec


@pytest.mark.parametrize("seed", [3, 4])
def test_a_fork_runs_on_without_touching_the_original(seed):
    ref = _contended(seed).run(make_scheduler("rate_greedy"))
    sim = _contended(seed)
    _drive(sim, 40)
    child, memo = fork(sim)
    assert child.state is not sim.state and memo[id(sim.state)] is child.state
    in_system = sim.state.in_system_s
    child.run(make_scheduler("rate_greedy"))  # the fork to the end
    assert child.done and child.state.in_system_s > in_system
    assert sim.state.in_system_s == in_system and not sim.done
    # the original continues exactly as if it had never been forked
    sched = make_scheduler("rate_greedy")
    sched.reset(sim.state, sim.scheduler_rng())
    while sim.next_decision():
        grants = sched.decide(sim.state)
        for g in grants:
            sim.apply(g)
        if not grants:
            sim.wait()
    assert sim.result().act.tolist() == ref.act.tolist()
    # and the fork, on the same instance, made the same decisions from the fork on
    assert child.state.in_system_s == pytest.approx(sim.state.in_system_s)


def test_without_alternatives_the_teacher_is_rate_greedy():
    ref = _contended().run(make_scheduler("rate_greedy"))
    teacher = LookaheadTeacher(kinds=())
    r = teacher.run(_contended())
    assert r.act.tolist() == ref.act.tolist()
    assert teacher.stats.looked == teacher.stats.rollouts == 0
    assert teacher.stats.decisions > 0


@pytest.mark.parametrize("privileged", [True, False])
def test_the_teacher_looks_at_gpu_alternatives_and_finishes_the_run(privileged):
    teacher = LookaheadTeacher(horizon_s=20.0, privileged=privileged, n_futures=1,
                               holds_s=(4.0,))
    sim = _contended()
    r = teacher.run(sim)
    st = teacher.stats
    assert sim.done and r.counters["completed"] == r.counters["submitted"]
    assert st.looked > 0 and st.rollouts >= 2 * st.looked
    assert sum(st.by_label.values()) == st.decisions
    assert st.changed == st.decisions - st.by_label["rate_greedy"]


def test_estimates_only_forks_redraw_what_is_unknown():
    sim = _contended()
    _drive(sim, 40)
    teacher = LookaheadTeacher(privileged=False, n_futures=1)
    teacher._futures = [copy.deepcopy(sim.instance)]
    before = {a.id: a.spec.true_s for a in sim.state.pending["gpu"].values()}
    est = {a.id: a.spec.est_s for a in sim.state.pending["gpu"].values()}
    assert before, "the fork point must have queued requests"
    child, memo = fork(sim)
    teacher._redraw(child, 0)
    after = {a.id: a.spec.true_s for a in child.state.pending["gpu"].values()}
    assert after.keys() == before.keys() and after != before
    assert {a.id: a.spec.true_s for a in sim.state.pending["gpu"].values()} == before
    assert {a.id: a.spec.est_s for a in child.state.pending["gpu"].values()} == est
    # another candidate's fork of the same future draws the same (common random numbers)
    other, _ = fork(sim)
    teacher._redraw(other, 0)
    assert {a.id: a.spec.true_s for a in other.state.pending["gpu"].values()} == after
    assert [e[0] for e in other._heap] == [e[0] for e in child._heap]


@pytest.mark.parametrize("kw, match", [
    ({"horizon_s": 0.0}, "horizon_s"), ({"n_futures": 0}, "n_futures"),
    ({"kinds": ("disk",)}, "kinds"), ({"holds_s": (0.0,)}, "holds_s"),
    ({"look_every": 0}, "look_every")])
def test_bad_parameters(kw, match):
    with pytest.raises(ValueError, match=match):
        LookaheadTeacher(**kw)


@pytest.mark.parametrize("args, field", [
    (["--points", "nowhere"], "points"), (["--seed-offset", "999999"], "seed-offset"),
    (["--variants", "oracle"], "variants"), (["--holds-s", "x"], "holds-s"),
    (["--look-every", "0"], "look-every")])
def test_headroom_benchmark_argument_errors_are_one_line(args, field, capsys):
    spec = importlib.util.spec_from_file_location("lookahead_headroom", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {field}:") and err.count("\n") == 1


@pytest.mark.parametrize("profile, kinds, pool", [("retool", ("cpu",), "cpu"),
                                                  ("search", ("api",), "api")])
def test_cpu_and_api_alternatives_are_legal_grants(profile, kinds, pool):
    w, c = shrunk(profile, load=0.05, steps=1)
    sim = Simulator(w, c.scaled(0.05 if pool == "cpu" else 0.25, (pool,)), 5, max_wait_s=300.0)
    teacher = LookaheadTeacher(horizon_s=10.0, kinds=kinds)
    r = teacher.run(sim)  # an illegal grant raises InvalidGrant
    assert sim.done and r.counters["completed"] + r.counters["failed"] == r.counters["submitted"]
    assert teacher.stats.looked > 0
    assert all(label == "rate_greedy" or label.split(":")[0] in kinds
               for label in teacher.stats.by_label)


def test_look_every_looks_at_a_share_of_the_decisions_with_alternatives():
    every = LookaheadTeacher(horizon_s=20.0)
    every.run(_contended())
    third = LookaheadTeacher(horizon_s=20.0, look_every=3)
    third.run(_contended())
    assert 0 < third.stats.looked < every.stats.looked
    assert third.stats.looked == -(-third._offered // 3)
