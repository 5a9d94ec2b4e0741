"""The slot-scorer policy: size, permutation equivariance over slots, and the NumPy
forward pass agreeing with SB3's masked deterministic prediction."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sb3_contrib import MaskablePPO

from metasched.agents.numpy_policy import NumpyPolicy
from metasched.agents.policy import ConcatExtractor, SlotPolicy, n_parameters
from metasched.compose import profile
from metasched.core.observation import SLOT_FEATURES, F, ObsConfig
from metasched.envs.scheduling import ActionSchedulingEnv, scale_workload

PRESENT = SLOT_FEATURES.index("present")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_env(name: str = "mixed", obs_config: ObsConfig | None = None) -> ActionSchedulingEnv:
    w, c = profile(name)
    return ActionSchedulingEnv(scale_workload(w, load=0.1), c, obs_config=obs_config)


def fresh_policy(env: ActionSchedulingEnv, hidden: int = 64) -> SlotPolicy:
    return SlotPolicy(env.observation_space, env.action_space, lambda _: 3e-4, hidden=hidden)


def random_obs(env: ActionSchedulingEnv, rng: np.random.Generator, present: int) -> dict:
    """An observation with ``present`` filled slots, random features and a random mask
    over them (wait legal), as the encoder makes them."""
    cfg = env.obs_config
    slots = rng.uniform(0, 3, (cfg.k_slots, F)).astype(np.float32)
    slots[:, PRESENT] = 0.0
    slots[:present, PRESENT] = 1.0
    slots[present:] = 0.0
    mask = (rng.random(cfg.n_actions) < 0.5).astype(np.int8)
    mask[present * cfg.levels:] = 0
    mask[-1] = 1
    return {"slots": slots.reshape(-1),
            "backlog": rng.uniform(0, 3, 9).astype(np.float32),
            "pools": rng.uniform(0, 1, cfg.pool_size()).astype(np.float32),
            "action_mask": mask}


def torch_logits(policy: SlotPolicy, obs: dict) -> np.ndarray:
    """The policy's slot x level and wait logits via the ConcatExtractor features."""
    extractor = ConcatExtractor(policy.observation_space)
    batch = {k: torch.as_tensor(v, dtype=torch.float32)[None] for k, v in obs.items()}
    with torch.no_grad():
        return policy.mlp_extractor.forward_actor(extractor(batch))[0].numpy()


# ------------------------------------------------------------------ size


def test_parameter_budget_at_defaults():
    env = make_env("mixed")
    assert env.obs_config == ObsConfig()
    policy = fresh_policy(env)
    n = n_parameters(policy)
    assert 1_000 < n < 50_000
    assert n_parameters(fresh_policy(env, hidden=32)) < n  # the width drives it
    # The logits are the scorer's outputs: no action head parameters.
    assert n_parameters(policy.action_net) == 0


# ------------------------------------------------------------------ equivariance


@pytest.mark.parametrize("present", [16, 9, 1])
def test_permuting_slots_permutes_logits(present):
    env = make_env("mixed")
    policy = fresh_policy(env)
    npol = NumpyPolicy.from_sb3(policy)
    k, levels = env.obs_config.k_slots, env.obs_config.levels
    rng = np.random.default_rng(present)
    for _ in range(5):
        obs = random_obs(env, rng, present)
        perm = rng.permutation(k)
        pobs = dict(obs)
        pobs["slots"] = obs["slots"].reshape(k, F)[perm].reshape(-1)
        pobs["action_mask"] = np.concatenate(
            [obs["action_mask"][:-1].reshape(k, levels)[perm].reshape(-1), obs["action_mask"][-1:]])
        lg, plg = torch_logits(policy, obs), torch_logits(policy, pobs)
        slot_l, pslot_l = lg[:-1].reshape(k, levels), plg[:-1].reshape(k, levels)
        np.testing.assert_allclose(pslot_l, slot_l[perm], rtol=1e-5, atol=1e-5)
        assert plg[-1] == pytest.approx(lg[-1], abs=1e-5)  # the wait logit is invariant
        # The same for the NumPy forward pass, and its choice moves with its slot.
        np.testing.assert_allclose(npol.logits(pobs)[:-1].reshape(k, levels),
                                   npol.logits(obs)[:-1].reshape(k, levels)[perm],
                                   rtol=1e-5, atol=1e-5)
        a, pa = npol.act(obs), npol.act(pobs)
        if a == k * levels:
            assert pa == a
        else:
            slot, level = divmod(a, levels)
            assert pa == int(np.flatnonzero(perm == slot)[0]) * levels + level


def test_rows_not_present_do_not_change_the_context():
    """The pooled context averages present rows only: whatever a row flagged not present
    holds, the wait logit and the present slots' logits stay the same."""
    env = make_env("mixed")
    policy = fresh_policy(env)
    k, levels = env.obs_config.k_slots, env.obs_config.levels
    rng = np.random.default_rng(0)
    obs = random_obs(env, rng, 3)
    lg = torch_logits(policy, obs)
    alt = dict(obs)
    alt_slots = obs["slots"].reshape(k, F).copy()
    alt_slots[3:, :PRESENT] = rng.uniform(0, 3, (k - 3, PRESENT))
    alt["slots"] = alt_slots.reshape(-1)
    alg = torch_logits(policy, alt)
    np.testing.assert_allclose(alg[:3 * levels], lg[:3 * levels], rtol=1e-6, atol=1e-6)
    assert alg[-1] == pytest.approx(lg[-1], abs=1e-6)
    # A fourth present row does change them.
    alt_slots[3, PRESENT] = 1.0
    alt["slots"] = alt_slots.reshape(-1)
    assert not np.allclose(torch_logits(policy, alt)[:3 * levels], lg[:3 * levels])


# ------------------------------------------------------------------ NumPy = SB3


@pytest.fixture(scope="module")
def trained():
    torch.set_num_threads(1)
    env = make_env("mixed")
    model = MaskablePPO(SlotPolicy, env, n_steps=128, batch_size=64, n_epochs=2, seed=0,
                        verbose=0)
    before = NumpyPolicy.from_sb3(model.policy)
    model.learn(512)
    return env, model, before


def recorded_observations(env: ActionSchedulingEnv, model, n: int) -> list[dict]:
    """Observations along rollouts that follow the model's sampled actions."""
    out = []
    obs, _ = env.reset(seed=123)
    while len(out) < n:
        out.append(obs)
        a, _ = model.predict(obs, action_masks=env.action_masks(), deterministic=False)
        obs, _, term, trunc, _ = env.step(int(a))
        if term or trunc:
            obs, _ = env.reset()
    return out


def test_numpy_policy_matches_sb3_predict(trained):
    env, model, before = trained
    npol = NumpyPolicy.from_sb3(model.policy)
    # Training moved the weights away from their initial values.
    assert not all(np.array_equal(npol.w[k], before.w[k]) for k in npol.w)
    observations = recorded_observations(env, model, 320)
    assert len({o["slots"].tobytes() for o in observations}) > 100
    differ = 0
    for obs in observations:
        mask = obs["action_mask"].astype(bool)
        a_sb3, _ = model.predict(obs, action_masks=mask, deterministic=True)
        a_np = npol.act(obs)
        np.testing.assert_allclose(npol.logits(obs), torch_logits(model.policy, obs),
                                   rtol=1e-5, atol=1e-5)
        if int(a_sb3) != a_np:
            # Only an exact float tie between the two best legal logits may differ.
            lg = np.where(mask, npol.logits(obs), -np.inf)
            top = np.sort(lg)[-2:]
            assert top[1] - top[0] < 1e-5, (int(a_sb3), a_np)
            differ += 1
    assert differ <= 3
    # And with a mask that is not the observation's own.
    rng = np.random.default_rng(0)
    for obs in observations[:50]:
        mask = obs["action_mask"].astype(bool) & (rng.random(mask.size) < 0.7)
        mask[-1] = True
        a_sb3, _ = model.predict(obs, action_masks=mask, deterministic=True)
        assert int(a_sb3) == npol.act(obs, mask)


def test_numpy_policy_save_load_round_trip(tmp_path, trained):
    env, model, _ = trained
    npol = NumpyPolicy.from_sb3(model.policy)
    path = tmp_path / "policy.npz"
    npol.save(path)
    loaded = NumpyPolicy.load(path)
    assert (loaded.k, loaded.levels) == (npol.k, npol.levels) == (16, 4)
    assert loaded.w.keys() == npol.w.keys()
    rng = np.random.default_rng(1)
    for present in (0, 5, 16):
        obs = random_obs(env, rng, present)
        np.testing.assert_array_equal(loaded.logits(obs), npol.logits(obs))
        assert loaded.act(obs) == npol.act(obs)


def test_numpy_policy_other_sizes():
    cfg = ObsConfig(k_slots=5, levels=3)
    env = make_env("rm_math", cfg)
    policy = fresh_policy(env, hidden=16)
    npol = NumpyPolicy.from_sb3(policy)
    assert (npol.k, npol.levels) == (5, 3)
    obs, _ = env.reset(seed=0)
    lg = npol.logits(obs)
    assert lg.shape == (cfg.n_actions,)
    np.testing.assert_allclose(lg, torch_logits(policy, obs), rtol=1e-5, atol=1e-5)
