"""The remaining-work predictor (metasched.core.predictor): accuracy against the static
estimate on a held-out seed, ordered quantiles, online updates, no look into the future,
and its feeding by the simulator through the cost model."""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from functools import cache

import numpy as np
import pytest

from metasched.compose import profile
from metasched.core.cost_model import CostModel
from metasched.core.predictor import DESIGNS, GEN, Predictor, TrajRecord, records_of, replay
from metasched.sim.sampling import sample_workload


@cache
def _records(name: str, steps: int, seed: int, per_step: int) -> tuple[TrajRecord, ...]:
    w, _ = profile(name)
    w = replace(w, steps=steps, trajectories_per_step=per_step)
    return tuple(records_of(sample_workload(w, np.random.default_rng(seed)).steps))


@cache
def _fitted(design: str) -> Predictor:
    return Predictor.fit(list(_records("retool_grouped", 3, 0, 576)), design)


@pytest.mark.parametrize("design", DESIGNS)
def test_beats_the_static_estimate_on_a_held_out_seed(design: str) -> None:
    """Trained on seed 0, tested on seed 1: the remaining-time |log error| is below the
    static estimate's by more than four standard errors of the paired difference, and
    so is the queued action's."""
    p = _fitted(design)
    rem, act = [], []
    for d, _ in replay(p, list(_records("retool_grouped", 1, 1, 576))):
        static = abs(math.log(p.static_remaining(d.task, d.turn) / d.remaining_s))
        rem.append(abs(math.log(p.remaining(d.key).p50 / d.remaining_s)) - static)
        if d.action_s > 0:
            act.append(abs(math.log(p.duration(d.key, d.name) / d.action_s))
                       - abs(math.log(p.static_duration(d.name) / d.action_s)))
    for diff in (np.array(rem), np.array(act)):
        assert diff.mean() < -4 * diff.std() / math.sqrt(len(diff))


@pytest.mark.parametrize("design", ["reward_static", "linear", "boost", "gbm"])
def test_quantiles_are_ordered_and_cover_the_truth(design: str) -> None:
    p = _fitted(design)
    inside = []
    for d, _ in replay(p, list(_records("retool_grouped", 1, 1, 576))):
        q = p.remaining(d.key)
        assert 0 < q.p10 <= q.p50 <= q.p90
        inside.append(q.p10 <= d.remaining_s <= q.p90)
    assert 0.7 <= np.mean(inside) <= 0.9


@pytest.mark.parametrize("who", ["own", "sibling"])
def test_online_updates_move_predictions_toward_what_was_measured(who: str) -> None:
    """After the same turns measured short, typical or long (the trajectory's own or a
    sibling's), its predicted action duration and remaining time rise in that order."""
    p = _fitted("linear")
    name = "code_interpreter"
    seen = []
    for scale in (0.05, 1.0, 20.0):
        p.reset()
        p.remaining(0, "retool_math", "g")
        p.remaining(1, "retool_math", "g")
        src = 0 if who == "own" else 1
        for _ in range(3):
            p.observe(src, "retool_math", "g", GEN, math.exp(p.mu[GEN]), new_turn=True)
            p.observe(src, "retool_math", "g", name, p.static_duration(name) * scale)
        seen.append((p.duration(0, name), p.remaining(0).p50))
    for i in range(2):
        assert seen[0][i] < seen[1][i] < seen[2][i]


def test_a_prediction_does_not_see_the_trajectorys_future() -> None:
    """Altering a trajectory's actions after turn k (durations and their number) leaves
    every prediction made for it up to turn k unchanged."""
    p = _fitted("linear")
    recs = list(_records("retool_grouped", 1, 1, 64))
    j = max(range(len(recs)), key=lambda i: len(recs[i].turns))
    k = len(recs[j].turns) // 2
    altered = recs.copy()
    turns = recs[j].turns
    altered[j] = replace(recs[j], turns=turns[:k + 1] + tuple(
        (n, g * 3.0, d * 7.0) for n, g, d in turns[k + 1:]) + turns[-1:])

    def predictions(rs: list[TrajRecord]) -> list[tuple]:
        out = []
        for d, x in replay(p, rs):
            if d.key == j and d.turn <= k:
                q = p.remaining(d.key)
                out.append((d.turn, q.p10, q.p50, q.p90, p.duration(d.key, d.name), *x))
        return out

    a, b = predictions(recs), predictions(altered)
    assert len(a) == k + 1 and a == b


def test_the_simulator_feeds_the_cost_models_predictor() -> None:
    """A predictor held by the cost model is the state's ``predictor``; the simulator's
    measurements, gaps and ends reach it, and schedulers can ask it mid-step."""
    from metasched.agents import make_scheduler
    from metasched.sim.simulator import Simulator

    p = _fitted("linear")
    w, c = profile("retool_grouped")
    sim = Simulator(replace(w, steps=1, trajectories_per_step=64), c, 3,
                    cost_model=CostModel(predictor=p))
    assert sim.state.predictor is p
    fifo = make_scheduler("fifo")
    fifo.reset(sim.state, sim.scheduler_rng())
    asked = []
    while sim.next_decision():
        for traj in list(sim.state.trajectories.values())[:2]:
            q = sim.state.predictor.remaining_of(traj)
            asked.append(q.p10 <= q.p50 <= q.p90)
        grants = fifo.decide(sim.state)
        for g in grants:
            sim.apply(g)
        if not grants:
            sim.wait()
    assert asked and all(asked)
    assert len(p.trajs) == 64 and all(t.done for t in p.trajs.values())
    assert sum(t.n for t in p.trajs.values()) > 64 * 2  # gaps and actions observed


def test_fit_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="design must be one of"):
        Predictor.fit(list(_records("retool_grouped", 1, 0, 16)), "forest")
    with pytest.raises(ValueError, match="no training trajectories"):
        Predictor.fit([], "linear")


@pytest.mark.parametrize("design", ["boost", "gbm"])
def test_the_tree_designs_without_lightgbm_say_which_extra_in_one_line(
        design: str, monkeypatch) -> None:
    """Without LightGBM (the ``predict`` extra) a tree design's fit is one line naming the
    extra, before any replay; the numpy designs still fit."""
    from metasched.errors import ConfigError

    monkeypatch.setitem(sys.modules, "lightgbm", None)  # import lightgbm: ImportError
    records = list(_records("retool_grouped", 1, 0, 16))
    with pytest.raises(ConfigError, match=r"metasched\[predict\]") as e:
        Predictor.fit(records, design)
    assert "\n" not in str(e.value)
    assert Predictor.fit(records, "linear").remaining(0, records[0].task).p50 > 0


def test_it_trains_on_a_recorded_trace(tmp_path) -> None:
    """A recorded trace gives back each trajectory's turns (types, gaps) and prompt group,
    and a predictor fitted on it predicts."""
    import importlib.util
    from pathlib import Path

    from metasched.evaluation.recording import record_trace

    bench = Path(__file__).resolve().parent.parent / "benchmarks" / "predictor_accuracy.py"
    spec = importlib.util.spec_from_file_location("predictor_accuracy", bench)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    w, c = profile("retool_grouped")
    w = replace(w, steps=1, trajectories_per_step=64)
    path = tmp_path / "trace.jsonl"
    record_trace(w, c, path, "fifo", seed=5)
    got = mod.trace_records(str(path))
    assert len(got) == 64 and len({r.group for r in got}) == 4
    assert all(r.turns[-1][0] == "reward" and r.turns[0][1] == 0.0 for r in got)
    assert all(g > 0 for r in got for _, g, _ in r.turns[1:])
    p = Predictor.fit(got, "linear")
    q = p.remaining(0, got[0].task, got[0].group)
    assert 0 < q.p10 <= q.p50 <= q.p90 < math.inf


def test_the_boost_design_reaches_the_target_on_retool_grouped() -> None:
    """On a held-out seed of ``retool_grouped`` the boost design's remaining-time mean
    |log error| is at most 0.7x the static estimate's (the acceptance figure), with
    the p10-p90 interval covering 70-90%."""
    p = _fitted("boost")
    pred, static, inside = [], [], []
    for d, _ in replay(p, list(_records("retool_grouped", 1, 1, 576))):
        q = p.remaining(d.key)
        pred.append(abs(math.log(q.p50 / d.remaining_s)))
        static.append(abs(math.log(p.static_remaining(d.task, d.turn) / d.remaining_s)))
        inside.append(q.p10 <= d.remaining_s <= q.p90)
    assert np.mean(pred) <= 0.7 * np.mean(static)
    assert 0.7 <= np.mean(inside) <= 0.9


def test_heuristics_fed_the_predictor_run_in_an_evaluation(monkeypatch) -> None:
    """An evaluation fits a predictor for a scheduler that asks for one (and for no
    other): the predictor-fed orders finish every trajectory and decide otherwise than
    the same rules on static estimates; the rule without one cannot start."""
    from metasched.agents import PREDICTED, make_scheduler
    from metasched.core.state import ClusterState
    from metasched.evaluation import predictors
    from metasched.evaluation.runs import eval_jobs, run_job

    monkeypatch.setattr(predictors, "TRAIN_TRAJECTORIES", 640)  # a smaller fit, same code
    w, c = profile("retool_grouped_c10")  # 10 cores: queues form
    w = replace(w, steps=1, trajectories_per_step=64)
    names = ["critical_path", "least_slack", *PREDICTED, "learned_priority"]
    runs = {j.scheduler: run_job(j) for j in eval_jobs(w, c, names, [3])}
    for r in runs.values():  # every trajectory ended (timeouts fail some actions)
        assert len(r["step_s"]) == 1 and r["act"].size == runs["critical_path"]["act"].size
    assert runs["critical_path_predicted"]["act"].tolist() != runs["critical_path"]["act"].tolist()
    assert runs["least_slack_predicted"]["act"].tolist() != runs["least_slack"]["act"].tolist()
    assert runs["learned_priority"]["act"].tolist() != runs["critical_path"]["act"].tolist()
    with pytest.raises(ValueError, match="needs a fitted ranker"):
        make_scheduler("learned_priority").reset(ClusterState(c, w.services),
                                                 np.random.default_rng(0))
    with pytest.raises(ValueError, match="needs a remaining-work predictor"):
        make_scheduler("critical_path", estimates="predictor").reset(
            ClusterState(c, w.services), np.random.default_rng(0))
    with pytest.raises(Exception, match="estimates must be one of"):
        make_scheduler("least_slack", estimates="oracle")


def test_an_evaluation_feeds_the_reward_aware_static_baseline_when_asked(monkeypatch) -> None:
    """``predictor.design: reward_static`` feeds the same rule the static estimate told
    which queued action is the reward, so the predicted rules have their baseline beside
    them; another design name is one line."""
    from metasched.cli.eval_app import eval_settings
    from metasched.errors import ConfigError
    from metasched.evaluation import predictors
    from metasched.evaluation.runs import eval_jobs, run_job

    monkeypatch.setattr(predictors, "TRAIN_TRAJECTORIES", 640)  # a smaller fit, same code
    w, c = profile("retool_grouped_c10")
    w = replace(w, steps=1, trajectories_per_step=64)
    runs = {d: run_job(eval_jobs(w, c, ["critical_path_predicted"], [3], design=d)[0])
            for d in ("boost", "reward_static")}
    assert runs["boost"]["act"].size == runs["reward_static"]["act"].size
    assert runs["boost"]["act"].tolist() != runs["reward_static"]["act"].tolist()
    assert predictors.fitted_predictor(w, design="reward_static").design == "reward_static"
    with pytest.raises(ConfigError, match="predictor.design") as e:
        eval_settings({"schedulers": ["critical_path_predicted"], "n_seeds": 1,
                       "predictor": {"design": "forest"}})
    assert "\n" not in str(e.value)


async def test_the_dispatcher_builds_and_feeds_a_predictor(tmp_path) -> None:
    """``predictor: <trace>``: the dispatcher fits one on a recorded trace, shows it to
    its scheduler, and learns each measured run, gap and trajectory end; a missing
    trace is a one-line ConfigError."""
    from helpers import cpu
    from helpers import dispatcher_config as cfg

    from metasched.errors import ConfigError
    from metasched.evaluation.recording import record_trace
    from metasched.runtime.dispatch import Dispatcher

    w, c = profile("retool_grouped")
    path = tmp_path / "trace.jsonl"
    record_trace(replace(w, steps=1, trajectories_per_step=64), c, path, "fifo", seed=5)
    with pytest.raises(ConfigError, match="predictor.*no such trace file"):
        Dispatcher(cfg(predictor=str(tmp_path / "absent.jsonl")))
    with pytest.raises(ConfigError, match="predictor.*another trace than the one this run"):
        Dispatcher(cfg(predictor=str(path), trace=str(path)))
    seen = []
    async with Dispatcher(cfg(scheduler="critical_path_predicted", predictor=str(path))) as d:
        p = d.state.predictor
        assert p is not None and p.design == "boost"
        assert d.scheduler.name == "critical_path_predicted"
        for turn in range(3):
            r = await d.submit(cpu("/bin/true", trajectory="t", turn=turn, task="retool_math",
                                   name="code_interpreter"))
            assert r.ok
            seen.append((p.trajs[0].turn, p.trajs[0].n))
        await d.submit(cpu("/bin/true", trajectory="t", turn=3, task="retool_math",
                           name="reward", reward=True))
    # Per turn: its gap (from the second turn) and its run are learned; the end forgets it.
    assert seen == [(0, 1), (1, 3), (2, 5)]
    assert p.trajs == {}


async def test_the_dispatcher_takes_a_fitted_predictor(monkeypatch, tmp_path) -> None:
    """``Dispatcher(..., predictor=p)``: a fitted predictor instead of a trace's, shown
    to the scheduler and fed online; with a trace as well, a one-line ConfigError."""
    from helpers import cpu
    from helpers import dispatcher_config as cfg

    from metasched.errors import ConfigError
    from metasched.evaluation import predictors
    from metasched.runtime.dispatch import Dispatcher

    monkeypatch.setattr(predictors, "TRAIN_TRAJECTORIES", 320)  # a smaller fit, same code
    p = predictors.fitted_predictor(profile("retool_grouped")[0])
    with pytest.raises(ConfigError, match="predictor.*not both"):
        Dispatcher(cfg(predictor=str(tmp_path / "trace.jsonl")), predictor=p)
    async with Dispatcher(cfg(scheduler="critical_path_predicted"), predictor=p) as d:
        assert d.state.predictor is p and not d.fallback_reason
        assert d.scheduler.name == "critical_path_predicted"
        for turn in range(2):
            assert (await d.submit(cpu("/bin/true", trajectory="t", prompt="q", turn=turn,
                                       task="retool_math", name="code_interpreter"))).ok
        tid = d.trajectories.get("t").id
        assert p.groups == {(0, "q"): [tid]} and p.trajs[tid].n == 3  # 2 runs, 1 gap


def test_the_learned_priority_orders_pairs_better_than_the_static_estimate() -> None:
    """Fitted on seed 0, the pairwise ranker orders close-in-time pairs of seed 1 by
    remaining time far better than the static estimate, and no worse than the median."""
    from metasched.core.ranker import fit_ranker, pair_accuracy, rows

    p = _fitted("boost")
    ranker = fit_ranker(p, list(_records("retool_grouped", 1, 0, 576)))
    x, y, step, t = rows(p, list(_records("retool_grouped", 1, 1, 576)))
    learned = pair_accuracy((x - ranker.mean) / ranker.sd @ ranker.w, y, step, t)
    static, median = pair_accuracy(x[:, 0], y, step, t), pair_accuracy(x[:, -2], y, step, t)
    assert learned > static + 0.1 and learned >= median - 0.01


async def test_live_trajectories_of_one_prompt_are_siblings_and_their_trace_says_so(
        tmp_path) -> None:
    """Requests naming a prompt: the dispatcher's trajectories carry it (a later request
    naming another does not change it), the predictor groups the siblings under one key
    and forgets the group with its last trajectory, and the live trace records each
    action's prompt, which a predictor fitted on it groups by again."""
    import asyncio
    import json

    from helpers import cpu
    from helpers import dispatcher_config as cfg

    from metasched.core.predictor import records_of_trace
    from metasched.evaluation.recording import record_trace
    from metasched.runtime.dispatch import Dispatcher
    from metasched.sim.trace import scan_trace

    w, c = profile("retool_grouped")
    fitted, live = tmp_path / "fitted.jsonl", tmp_path / "live.jsonl"
    record_trace(replace(w, steps=1, trajectories_per_step=64), c, fitted, "fifo", seed=5)
    prompts = {"a": "p-1", "b": "p-1", "c": "p-2"}

    def act(traj: str, turn: int, prompt: str, action: str = "code_interpreter",
            **kw) -> dict:
        return cpu("/bin/true", trajectory=traj, prompt=prompt, turn=turn,
                   task="retool_math", name=action, **kw)

    async with Dispatcher(cfg(scheduler="critical_path_predicted", predictor=str(fitted),
                              trace=str(live))) as d:
        p = d.state.predictor
        first = await asyncio.gather(*(d.submit(act(n, 0, pr)) for n, pr in prompts.items()))
        assert all(r.ok for r in first)
        assert (await d.submit(act("a", 1, "p-9"))).ok  # the first request's prompt stands
        ids = {n: d.trajectories.get(n).id for n in prompts}
        assert {t.id: t.prompt for t in d.state.trajectories.values()} == {
            ids[n]: pr for n, pr in prompts.items()}
        assert p.groups == {(0, "p-1"): [ids["a"], ids["b"]], (0, "p-2"): [ids["c"]]}
        left = []
        for n in prompts:
            assert (await d.submit(act(n, 2, prompts[n], "reward", reward=True))).ok
            left.append(sorted(g[1] for g in p.groups))
        assert left == [["p-1", "p-2"], ["p-2"], []] and p.trajs == {}
    lines = [json.loads(line) for line in live.read_text().splitlines()]
    seen = [(x["measured"]["trajectory"], x["measured"]["prompt"])
            for x in lines if x["type"] == "action"]
    assert sorted(seen) == sorted([*prompts.items(), ("a", "p-1"), *prompts.items()])
    groups = sorted(r.group[1] for r in records_of_trace(scan_trace(live)))
    assert groups == ["p-1", "p-1", "p-2"]
