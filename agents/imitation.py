"""Behaviour-cloning warm start: record a heuristic's decisions in the env, then fit
the policy's masked action distribution to them (cross-entropy); DAgger rounds add the
states the clone itself reaches, labelled by the heuristic."""

from __future__ import annotations

import numpy as np
import torch

from metasched.agents import make_scheduler
from metasched.envs.scheduling import ActionSchedulingEnv


def expert_action(env: ActionSchedulingEnv, expert) -> int:
    """The env action closest to the expert's first grant that is in a slot. When the
    expert grants only actions outside the K slots, the first legal slot action at its
    lowest legal level (the expert would not have waited); wait only when the expert
    grants nothing."""
    state = env.sim.state
    slots = env.encoder.slots(state)
    grants = expert.decide(state)
    for g in grants:
        a = env.encoder.action_for(state, g, slots)
        if a is not None:
            return a
    wait = env.obs_config.n_actions - 1
    if grants:
        legal = env.encoder.mask(state, slots).nonzero()[0]
        return int(legal[0]) if legal[0] != wait else wait
    return wait


def collect_expert(env: ActionSchedulingEnv, n_decisions: int, seed: int,
                   expert_name: str = "rate_greedy", progress=None, learner=None,
                   beta: float = 0.0) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Record ``n_decisions`` env steps labelled with the expert's actions; returns
    (observations, actions).

    Without ``learner`` the expert drives the env. With ``learner`` (anything with
    ``act(obs) -> int``, e.g. a ``NumpyPolicy``), the env takes the learner's action,
    or the expert's with probability ``beta``: DAgger, the states the learner reaches
    labelled with what the expert would do there (a clone's small errors otherwise lead
    it to states the expert never showed it)."""
    expert = make_scheduler(expert_name)
    rng = np.random.default_rng(seed)
    obs, _ = env.reset(seed=seed)
    expert.reset(env.sim.state, np.random.default_rng(seed))
    keys = list(obs)
    buf: dict[str, list[np.ndarray]] = {k: [] for k in keys}
    actions = np.empty(n_decisions, dtype=np.int64)
    for i in range(n_decisions):
        a = expert_action(env, expert)
        for k in keys:
            buf[k].append(obs[k])
        actions[i] = a
        if learner is not None and rng.random() >= beta:
            a = learner.act(obs)
        obs, _, term, trunc, _ = env.step(a)
        if term or trunc:
            obs, _ = env.reset()
            expert.reset(env.sim.state, np.random.default_rng(seed + i))
        if progress is not None:
            progress(1)
    return {k: np.stack(v) for k, v in buf.items()}, actions


def behaviour_clone(policy, obs: dict[str, np.ndarray], actions: np.ndarray, *,
                    epochs: int = 10, batch_size: int = 256, lr: float = 1e-3,
                    seed: int = 0) -> list[float]:
    """Fit ``policy`` (a MaskableActorCriticPolicy) to (obs, actions); returns the mean
    loss of each epoch."""
    rng = np.random.default_rng(seed)
    opt = torch.optim.Adam(policy.parameters(), lr=lr)
    n = len(actions)
    losses = []
    policy.set_training_mode(True)
    for _ in range(epochs):
        order = rng.permutation(n)
        total = 0.0
        for start in range(0, n, batch_size):
            idx = order[start:start + batch_size]
            batch = {k: torch.as_tensor(v[idx], device=policy.device) for k, v in obs.items()}
            dist = policy.get_distribution(batch, action_masks=obs["action_mask"][idx])
            loss = -dist.log_prob(torch.as_tensor(actions[idx], device=policy.device)).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
        losses.append(total / n)
    policy.set_training_mode(False)
    return losses
