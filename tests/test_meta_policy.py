"""The meta-policy over the rules: its choice, its gate, its checkpoint, its training."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import needs_train, shrunk

from metasched.agents import make_scheduler
from metasched.agents.meta_options import FEATURES, OPTIONS, option, workload_features
from metasched.agents.meta_policy import (
    MetaNetwork,
    MetaScheduler,
    ValueEstimates,
    is_meta_checkpoint,
    save_meta_checkpoint,
)
from metasched.agents.meta_ppo import PPOSettings, fallback_option, returns, train_choice
from metasched.errors import ConfigError
from metasched.sim.simulator import Simulator

F, K = len(FEATURES), len(OPTIONS)


def picking(k: int, mean: np.ndarray | None = None) -> MetaNetwork:
    """A network whose argmax is option ``k`` for every input."""
    b2 = np.zeros(K)
    b2[k] = 1.0
    return MetaNetwork(np.zeros((F, 4)), np.zeros(4), np.zeros((4, K)), b2,
                       np.zeros(F) if mean is None else mean, np.ones(F))


def values(fallback_log: float, spread: float = 0.01) -> ValueEstimates:
    coef = np.zeros((K, F + 1))
    coef[:, 0] = fallback_log
    return ValueEstimates(coef, np.full(K, spread), np.zeros(F), np.ones(F))


def run(sched, name: str = "retool_grouped", seed: int = 3):
    w, c = shrunk(name, load=0.1, steps=2)
    return Simulator(w, c, seed, max_wait_s=300.0).run(sched)


@pytest.mark.parametrize("name", ["critical_path", "rate_greedy@endgame=0.5", "fifo"])
def test_meta_decides_as_the_option_it_chose(name):
    k = [o.name for o in OPTIONS].index(name)
    meta = MetaScheduler(picking(k), list(OPTIONS), "rate_greedy", gate=False)
    got = run(meta)
    want = run(option(name).build())
    assert meta.choice.name == name
    assert got.step_s.tolist() == want.step_s.tolist()
    assert np.array_equal(got.act, want.act)


def test_gate_hands_over_to_the_fallback_when_the_choice_falls_below_its_estimate():
    k = [o.name for o in OPTIONS].index("fifo")
    # The fallback is estimated at 1 s a step: any real step is worse, so the gate fires
    # at the first finished step.
    meta = MetaScheduler(picking(k), list(OPTIONS), "rate_greedy", values=values(0.0))
    run(meta)
    assert meta.choice.name == "fifo" and meta.gated and meta.active.name == "rate_greedy"
    # Estimated at 10^6 s, the fallback is never better: the choice keeps control.
    calm = MetaScheduler(picking(k), list(OPTIONS), "rate_greedy", values=values(np.log(1e6)))
    run(calm)
    assert not calm.gated and calm.active.name == "fifo"


def test_features_tell_grouped_from_independent_trajectories():
    got = {}
    for name in ("retool", "retool_grouped"):
        w, c = shrunk(name, load=0.1, steps=1)
        sim = Simulator(w, c, 0, max_wait_s=300.0)
        assert sim.next_decision()
        got[name] = dict(zip(FEATURES, workload_features(sim.state), strict=True))
    assert got["retool"]["grouped"] == 0.0 and got["retool_grouped"]["grouped"] == 1.0
    # 16 responses a prompt (the shrunk step's last group may be cut short)
    assert np.log(8) < got["retool_grouped"]["log_group_size"] <= np.log(16)
    assert got["retool"]["log_trajectories"] > 0


def test_checkpoint_round_trip_through_make_scheduler(tmp_path):
    k = [o.name for o in OPTIONS].index("least_slack")
    save_meta_checkpoint(tmp_path / "m", picking(k), list(OPTIONS), "rate_greedy", "step", {},
                         values(5.0), {"training": {}})
    assert is_meta_checkpoint(tmp_path / "m")
    sched = make_scheduler(str(tmp_path / "m"))
    run(sched)
    assert sched.choice.name == "least_slack" and sched.objective == "step"


def test_a_checkpoint_with_other_features_is_a_one_line_error(tmp_path):
    save_meta_checkpoint(tmp_path / "m", picking(0), list(OPTIONS), "rate_greedy", "step", {},
                         values(5.0), {})
    meta = (tmp_path / "m" / "metadata.json")
    meta.write_text(meta.read_text().replace('"log_cores"', '"log_cpus"'))
    with pytest.raises(ConfigError, match="other features"):
        make_scheduler(str(tmp_path / "m"))


def test_returns_are_log_regret_less_the_cap_penalty():
    step = np.array([[100.0, 110.0, 90.0]])
    act = np.array([[10.0, 10.0, 20.0]])
    free = returns(step, {}, 20.0)
    assert free[0].tolist() == pytest.approx([-np.log(100 / 90), -np.log(110 / 90), 0.0])
    capped = returns(step, {"act": (act, 1.10)}, 20.0)
    assert capped[0, :2].tolist() == pytest.approx(free[0, :2].tolist())
    assert capped[0, 2] == pytest.approx(-20.0 * np.log(20 / 11))
    assert fallback_option(capped) == 0


@needs_train
def test_ppo_starts_as_the_fallback_and_moves_toward_the_better_choice():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, F))
    fig = np.full((64, K), 1.10)
    fig[:, 2] = 1.02  # option 2: close to the best everywhere (the fallback)
    fig[x[:, 0] > 0, 6] = 1.0  # option 6 wins where feature 0 is positive
    fig[x[:, 0] <= 0, 7] = 1.0  # option 7 where it is not
    ret = returns(fig, {}, 20.0)
    start, _ = train_choice(x, ret, PPOSettings(iterations=0), seed=0, progress=False)
    assert (start.logits(x).argmax(axis=1) == 2).all()
    net, info = train_choice(x, ret, PPOSettings(iterations=40), seed=0, progress=False)
    assert info["fallback"] == 2
    curve = info["curve"]
    assert curve[-1]["expected_return"] > curve[0]["expected_return"]
    pick = net.logits(x).argmax(axis=1)
    # Wherever it left the fallback, it chose the instance's best option.
    moved = pick != 2
    assert moved.any()
    assert (pick[moved] == np.where(x[moved, 0] > 0, 6, 7)).all()


@needs_train
def test_meta_train_app_trains_a_checkpoint_that_runs(tmp_path):
    from metasched.cli.meta_train_app import run_meta_train
    from metasched.compose import compose

    cfg = compose("train-meta", [
        "per_point=1", "workers=1", "ppo.iterations=3", "options=[rate_greedy,critical_path]",
        f"out={tmp_path / 'ckpt'}"])
    cfg["points"] = {"retool_grouped": ["retool_grouped", [
        "workload.steps=1", "workload.trajectories_per_step=32"]]}
    summary = run_meta_train(cfg, tmp_path / "run", progress=False)
    assert summary["instances"] == 1 and summary["fallback"] in ("rate_greedy", "critical_path")
    sched = make_scheduler(str(tmp_path / "ckpt"))
    run(sched)
    assert sched.choice.name in ("rate_greedy", "critical_path")
    again = run_meta_train({**cfg, "table": str(tmp_path / "run" / "table.json"),
                            "objective": "act"}, tmp_path / "run2", progress=False)
    assert again["objective"] == "act" and again["instances"] == 1


@pytest.mark.parametrize("override,field", [
    ("objective=speed", "objective"), ("+caps.step=1.1", "caps"),
    ("+caps.act=0.9", "caps.act"), ("options=[rate_greedy,nonesuch]", "options"),
    ("per_point=0", "per_point"),
])
def test_bad_training_settings_are_one_line_errors(override, field):
    from metasched.cli.meta_train_app import meta_settings
    from metasched.compose import compose

    with pytest.raises(ConfigError) as e:
        meta_settings(compose("train-meta", [override]))
    assert e.value.field == field
