"""``metasched/ActionScheduling-v0``: API checkers, masks, illegal actions, determinism,
the progress reward's telescoping to total ACT, termination and truncation."""

from __future__ import annotations

import copy
import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env as gym_check_env
from helpers import needs_train, shrunk

import metasched.envs  # noqa: F401  (registers the env id)
from metasched.agents import make_advisor
from metasched.compose import PROFILES
from metasched.core.observation import ObservationEncoder
from metasched.envs import ENV_ID
from metasched.envs.scheduling import (
    ActionSchedulingEnv,
    Randomization,
    RewardConfig,
    scale_workload,
)
from metasched.sim.simulator import Simulator

pytestmark = pytest.mark.usefixtures("one_torch_thread")




def make_env(name: str = "mixed", **kw) -> ActionSchedulingEnv:
    w, c = shrunk(name)
    return ActionSchedulingEnv(w, c, **kw)


def legal_choice(rng: np.random.Generator, obs: dict) -> int:
    return int(rng.choice(np.flatnonzero(obs["action_mask"])))


def obs_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------ API checkers


@pytest.mark.parametrize("render_mode", [None, "ansi"])
@pytest.mark.parametrize("name", PROFILES)
def test_gymnasium_check_env_no_warnings(name, render_mode):
    w, c = shrunk(name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # With a spec: the render and close checks run too.
        env = gym.make(ENV_ID, workload=w, cluster=c, render_mode=render_mode)
        gym_check_env(env.unwrapped)
    assert [str(x.message) for x in caught] == []


@needs_train
@pytest.mark.parametrize("name", PROFILES)
def test_sb3_check_env_no_warnings(name):
    from stable_baselines3.common.env_checker import check_env as sb3_check_env

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sb3_check_env(make_env(name))
    assert [str(x.message) for x in caught] == []


def test_gym_make_by_profile_name():
    env = gym.make(ENV_ID, workload="rm_math")
    obs, info = env.reset(seed=0)
    assert isinstance(env.unwrapped, ActionSchedulingEnv)
    assert env.unwrapped.sim.workload.name == "rm_math"
    assert env.observation_space.contains(obs)
    assert env.action_space.n == env.unwrapped.obs_config.n_actions
    obs, reward, term, trunc, info = env.step(env.action_space.n - 1)
    assert env.observation_space.contains(obs)
    assert np.isfinite(reward) and reward <= 0.0
    assert not info["invalid"]
    env.close()


def test_render_ansi_shows_the_queue_and_the_pools():
    w, c = shrunk("mixed")
    env = gym.make(ENV_ID, workload=w, cluster=c, render_mode="ansi")
    obs, _ = env.reset(seed=0)
    text = env.render()
    lines = text.splitlines()
    state, enc = env.unwrapped.sim.state, env.unwrapped.encoder
    assert lines[0].startswith(f"t {state.t:.3f} s | step 0: 0/{state.step_total}")
    assert f"pending {state.n_pending} " in lines[0]
    assert sum(ln.startswith("gpu") for ln in lines) == c.gpu_devices
    for e in c.endpoints:
        assert any(ln.startswith(f"api  {e}: ") for ln in lines), e
    slots = enc.slots(state)
    rows = [ln for ln in lines if ln[:4].strip().isdigit()]
    assert len(rows) == len(slots) == int(obs["slots"].reshape(enc.cfg.k_slots, -1)[:, -1].sum())
    for row, a in zip(rows, slots, strict=True):
        assert f"{a.task}/{a.spec.name}"[:24] in row
    legal = obs["action_mask"][:-1].reshape(enc.cfg.k_slots, enc.cfg.levels)
    assert [r.count("*") for r in rows] == legal.sum(1)[:len(rows)].tolist()
    for _ in range(5):  # the view follows the state
        obs, *_ = env.step(int(np.flatnonzero(obs["action_mask"])[0]))
    assert env.render().splitlines()[0].startswith(f"t {env.unwrapped.sim.state.t:.3f} s")


def test_online_estimates_are_the_cost_models():
    from metasched.core.cost_model import signature

    env = make_env("coding", estimates="online")
    obs, _ = env.reset(seed=0)
    for _ in range(300):
        obs, _, term, trunc, _ = env.step(int(np.flatnonzero(obs["action_mask"])[0]))
        assert not (term or trunc)
    model = env.sim.cost_model
    assert model is not None and sum(model.count.values()) > 0
    learned = [a for a in env.sim.state.pending["cpu"].values()
               if signature("cpu", a.task, a.spec.name) in model.mean]
    assert learned  # what the policy sees now comes from measured runs
    for a in learned:  # the estimate it was queued with; the model has learned since
        assert a.spec.est_s != next(
            t.action.est_s for t in a.traj.turns if t.action.true_s == a.spec.true_s)
    with pytest.raises(ValueError, match="estimates"):
        make_env("coding", estimates="exact")


def test_no_render_mode_renders_nothing_and_bad_modes_are_refused():
    w, c = shrunk("coding")
    env = ActionSchedulingEnv(w, c)
    env.reset(seed=0)
    assert env.render_mode is None and env.render() is None
    with pytest.raises(ValueError, match="render_mode"):
        ActionSchedulingEnv(w, c, render_mode="human")


# ------------------------------------------------------------------ masks


@pytest.mark.parametrize("name", PROFILES)
def test_wait_always_legal_and_masks_consistent(name):
    env = make_env(name)
    assert env.action_masks()[-1]  # before reset too
    rng = np.random.default_rng(0)
    obs, _ = env.reset(seed=0)
    n, done = 0, False
    while not done:
        m = env.action_masks()
        assert m.dtype == bool and m.shape == (env.action_space.n,)
        assert m[-1], "wait must always be legal"
        assert np.array_equal(m, obs["action_mask"].astype(bool))
        # The env asks only when a decision is possible: some slot action can start.
        assert m[:-1].any()
        obs, _, term, trunc, _ = env.step(legal_choice(rng, obs))
        done, n = term or trunc, n + 1
    assert env.action_masks()[-1]
    assert n > 10


def _rollout_obs(name: str, n: int, seed: int = 0):
    """(env, observations with their masks) from a random legal rollout."""
    env = make_env(name)
    rng = np.random.default_rng(seed)
    obs, _ = env.reset(seed=seed)
    out = []
    while len(out) < n:
        out.append(obs)
        obs, _, term, trunc, _ = env.step(legal_choice(rng, obs))
        if term or trunc:
            obs, _ = env.reset()
    return env, out


@needs_train
def test_masked_actions_never_chosen():
    from sb3_contrib import MaskablePPO

    from metasched.agents.numpy_policy import NumpyPolicy
    from metasched.agents.policy import SlotPolicy

    env, observations = _rollout_obs("mixed", 150)
    model = MaskablePPO(SlotPolicy, env, n_steps=64, batch_size=64, seed=0, verbose=0)
    npol = NumpyPolicy.from_sb3(model.policy)
    for obs in observations:
        mask = obs["action_mask"].astype(bool)
        for deterministic in (True, False):
            a, _ = model.predict(obs, action_masks=mask, deterministic=deterministic)
            assert mask[int(a)]
        assert mask[npol.act(obs)]
        # Forbid the policy's unmasked favourite too: masking must still hold.
        fav = int(npol.logits(obs).argmax())
        mask2 = mask.copy()
        mask2[fav] = False
        if not mask2.any():
            continue
        a, _ = model.predict(obs, action_masks=mask2, deterministic=True)
        assert mask2[int(a)]
        assert mask2[npol.act(obs, mask2)]
        a, _ = model.predict(obs, action_masks=mask2, deterministic=False)
        assert mask2[int(a)]


# ------------------------------------------------------------------ any action index


@pytest.mark.parametrize("name", ["mixed", "rm_math", "search"])
def test_any_action_index_is_safe_and_illegal_means_wait(name):
    env = make_env(name, reward=RewardConfig(invalid_penalty=0.5))
    rng = np.random.default_rng(1)
    obs, _ = env.reset(seed=1)
    n = env.action_space.n
    seen_illegal = 0
    for _ in range(3):
        mask = obs["action_mask"].astype(bool)
        waited = copy.deepcopy(env)
        w_obs, w_r, w_term, w_trunc, w_info = waited.step(n - 1)
        assert not w_info["invalid"]
        for i in [*range(n), -1, n, n + 7]:
            e = copy.deepcopy(env)
            o, r, term, trunc, info = e.step(np.int64(i))
            legal = 0 <= i < n and mask[i]
            assert info["invalid"] == (not legal), i
            if not legal:
                seen_illegal += 1
                assert obs_equal(o, w_obs), i
                assert (term, trunc) == (w_term, w_trunc)
                assert r == pytest.approx(w_r - 0.5, rel=0, abs=1e-12)
                assert e.sim.state.n_grants == waited.sim.state.n_grants
            elif i != n - 1:
                assert e.sim.state.n_grants > env.sim.state.n_grants
        obs, *_ = env.step(legal_choice(rng, obs))
    assert seen_illegal > 0


# ------------------------------------------------------------------ determinism


def _run(env: ActionSchedulingEnv, seed: int, actions: list[int] | None, n: int = 200):
    """Observations, rewards and flags of up to ``n`` steps after ``reset(seed)``: random
    actions (recorded into a new list) or ``actions`` replayed."""
    obs, info = env.reset(seed=seed)
    rng = np.random.default_rng(seed)
    record = actions is None
    actions = [] if record else actions
    trace = [(obs, info["sim_seed"], info["t"])]
    for i in range(n if record else len(actions)):
        if record:
            # Mostly legal actions, some arbitrary ones (illegal ones wait).
            a = legal_choice(rng, obs) if rng.random() < 0.8 else int(rng.integers(0, len(
                obs["action_mask"])))
            actions.append(a)
        obs, r, term, trunc, info = env.step(actions[i])
        trace.append((obs, r, term, trunc, info["t"], info["invalid"]))
        if term or trunc:
            break
    return actions, trace


def _same_trace(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert obs_equal(x[0], y[0])
        assert x[1:] == y[1:]


@pytest.mark.parametrize("name", ["mixed", "search"])
def test_same_seed_same_actions_identical(name):
    kw = {"randomization": Randomization(load=(0.5, 1.5), estimate_error=(0.2, 1.0),
                                         generation_scale=(0.7, 1.3), cluster_scale=(0.1, 1.0)),
          "horizon_mean_s": 400.0}
    env1, env2 = make_env(name, **kw), make_env(name, **kw)
    actions, t1 = _run(env1, 7, None)
    _, t2 = _run(env2, 7, actions)
    _same_trace(t1, t2)
    _, t3 = _run(env1, 7, actions)  # re-seeding the same env reproduces it too
    _same_trace(t1, t3)
    _, t4 = _run(env2, 8, actions[:1])
    assert t4[0][1] != t1[0][1]  # another seed draws another simulation


def test_cluster_scale_randomisation_draws_contended_and_roomy_clusters():
    w, c = shrunk("mixed")
    env = ActionSchedulingEnv(w, c, randomization=Randomization(cluster_scale=(0.1, 1.0)))
    cores = []
    for seed in range(30):
        env.reset(seed=seed)
        got = env.sim.state.cluster
        assert env.sim.state.cpu.cores[0] == got.cores_per_node  # the simulation's cluster
        assert round(0.1 * c.cores_per_node) <= got.cores_per_node <= c.cores_per_node
        assert 1 <= got.gpu_devices <= c.gpu_devices
        f = got.cores_per_node / c.cores_per_node
        for name, e in got.endpoints.items():  # every pool by the same factor
            assert e.rpm / c.endpoints[name].rpm == pytest.approx(f, abs=1 / c.cores_per_node)
        cores.append(got.cores_per_node)
    assert min(cores) <= 0.3 * c.cores_per_node and max(cores) >= 0.7 * c.cores_per_node
    assert env.cluster == c  # the env's own cluster is kept for the next draw


def test_sim_seed_option_fixes_the_simulation():
    w, c = shrunk("rm_math")
    env1, env2 = ActionSchedulingEnv(w, c), ActionSchedulingEnv(w, c)
    o1, i1 = env1.reset(seed=1, options={"sim_seed": 4242})
    o2, i2 = env2.reset(seed=2, options={"sim_seed": 4242})
    assert i1["sim_seed"] == i2["sim_seed"] == env1.sim.seed == 4242
    assert obs_equal(o1, o2)
    # Exactly a Simulator with that seed on the episode's workload.
    sim = Simulator(scale_workload(w, steps=env1.episode_steps), c, 4242)
    assert sim.next_decision()
    assert obs_equal(o1, ObservationEncoder(sim.state, env1.obs_config,
                                                     make_advisor(env1.obs_config)).observe(sim.state))
    for _ in range(30):  # and it stays the same under the same actions
        a = int(np.flatnonzero(o1["action_mask"])[0])
        o1, r1, *_ = env1.step(a)
        o2, r2, *_ = env2.step(a)
        assert obs_equal(o1, o2) and r1 == r2
    _, i3 = env1.reset(seed=1)  # without the option: drawn from the seed range again
    assert env1.sim.seed == i3["sim_seed"] and 0 <= i3["sim_seed"] < env1.seed_range[1]


# ------------------------------------------------------------------ reward, episode end


@pytest.mark.parametrize("name", PROFILES)
@pytest.mark.parametrize("episode_steps", [1, 2])
def test_progress_reward_sums_to_minus_scale_total_act(name, episode_steps):
    scale = 0.01
    env = make_env(name, reward=RewardConfig(progress=1.0, efficiency=0.0, scale=scale),
                   episode_steps=episode_steps)
    rng = np.random.default_rng(2)
    obs, _ = env.reset(seed=2)
    total, term, trunc, n = 0.0, False, False, 0
    while not (term or trunc):
        a = legal_choice(rng, obs) if rng.random() < 0.7 else env.action_space.n - 1
        obs, r, term, trunc, info = env.step(a)
        total += r
        n += 1
    assert term and not trunc  # the episode ends by running to completion
    r = env.sim.result()
    assert r.counters["pending"] == 0 and r.act.size == r.counters["submitted"] > 0
    assert len(r.step_s) == episode_steps
    assert total == pytest.approx(-scale * float(r.act.sum()), rel=1e-9, abs=1e-9)
    assert "episode_metrics" in info
    assert info["episode_metrics"]["mean_act_s"] == pytest.approx(float(r.act.mean()))
    # Stepping past the end changes nothing.
    before = env.sim.state.t
    obs2, r2, term2, trunc2, _ = env.step(0)
    assert (r2, term2, trunc2) == (0.0, True, False)
    assert obs_equal(obs2, obs) and env.sim.state.t == before


@pytest.mark.parametrize("seed", range(4))
def test_small_horizon_truncates(seed):
    env = make_env("rm_math", horizon_mean_s=2.0)
    rng = np.random.default_rng(seed)
    obs, _ = env.reset(seed=seed)
    term = trunc = False
    while not (term or trunc):
        obs, _, term, trunc, info = env.step(legal_choice(rng, obs))
    assert trunc and not term
    assert not env.sim.done  # work was left: a cut, not an end
    assert "episode_metrics" not in info


def test_waiting_never_crashes_with_the_guard_off():
    env = make_env("rm_math", max_wait_s=None)
    env.reset(seed=0)
    term = trunc = False
    for _ in range(10_000):
        _, _, term, trunc, _ = env.step(env.action_space.n - 1)
        if term or trunc:
            break
    assert term or trunc
