"""PPO for the meta-policy's choice of option, on a table of the options' figures.

A choice is one action per run (a contextual bandit): the state is the workload
features, the action an option, the return minus the log of the option's figure over the
instance's best option's (0 for the best; caps on other figures subtract a penalty where
the option exceeds ``cap`` × the instance's best by that figure). The baseline is
input-dependent as in Decima: the current policy's expected return *on the same
instance* (every option was run on the same arrival sequence), so the advantage
measures a choice against the policy's own alternatives for this workload, not against
the average workload, and the gradient does not vanish where every option is close.

The policy starts as the fallback rule (the option with the best mean return on the
training instances: its logit starts ``init_logit`` above the others, the last layer's
weights at zero) and PPO's clipped surrogate moves it from there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from metasched.agents.meta_policy import MetaNetwork


@dataclass(frozen=True)
class PPOSettings:
    """PPO's settings for the choice (see ``configs/train-meta.yaml``)."""

    iterations: int = 300
    samples: int = 4          # actions sampled per instance per iteration
    epochs: int = 4
    minibatch: int = 256
    lr: float = 3e-3
    clip: float = 0.2
    entropy: float = 0.003
    hidden: int = 32
    init_logit: float = 3.0
    cap_penalty: float = 20.0


def returns(figure: np.ndarray, capped: dict[str, tuple[np.ndarray, float]],
            penalty: float) -> np.ndarray:
    """Per instance and option: -log(figure ÷ the instance's best), less ``penalty`` ×
    the log excess over ``cap`` × the instance's best for every capped figure."""
    r = -np.log(figure / figure.min(axis=1, keepdims=True))
    for other, cap in capped.values():
        excess = np.log(other / (cap * other.min(axis=1, keepdims=True)))
        r -= penalty * np.maximum(excess, 0.0)
    return r


def fallback_option(ret: np.ndarray) -> int:
    """The option with the best mean return over the instances."""
    return int(np.argmax(ret.mean(axis=0)))


def train_choice(x: np.ndarray, ret: np.ndarray, settings: PPOSettings, seed: int,
                 progress: bool = True) -> tuple[MetaNetwork, dict[str, Any]]:
    """Fit the choice network by PPO on instances ``x`` (features) with returns ``ret``
    (instances × options); returns the network and the training curve."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    mean, std = x.mean(axis=0), x.std(axis=0)
    std = np.where(std > 1e-9, std, 1.0)
    z = torch.as_tensor((x - mean) / std, dtype=torch.float32)
    r = torch.as_tensor(ret, dtype=torch.float32)
    n, k = ret.shape
    a0 = fallback_option(ret)
    net = nn.Sequential(nn.Linear(x.shape[1], settings.hidden), nn.Tanh(),
                        nn.Linear(settings.hidden, k))
    with torch.no_grad():
        net[2].weight.zero_()
        net[2].bias.zero_()
        net[2].bias[a0] = settings.init_logit
    opt = torch.optim.Adam(net.parameters(), lr=settings.lr)
    curve = []
    it_range = range(settings.iterations)
    if progress:
        from tqdm import tqdm

        it_range = tqdm(it_range, desc="ppo", leave=False)
    rows = torch.arange(n).repeat(settings.samples)
    for it in it_range:
        with torch.no_grad():
            probs = torch.softmax(net(z), dim=1)
            base = (probs * r).sum(dim=1)  # the policy's value on this very instance
            acts = torch.multinomial(probs, settings.samples, replacement=True).T.reshape(-1)
            logp_old = torch.log(probs[rows, acts])
            adv = r[rows, acts] - base[rows]
            adv = adv / (adv.std() + 1e-8)
        greedy = r[torch.arange(n), net(z).argmax(dim=1)].mean().item()
        curve.append({"iteration": it, "expected_return": base.mean().item(),
                      "greedy_return": greedy})
        for _ in range(settings.epochs):
            perm = torch.as_tensor(rng.permutation(len(rows)))
            for s in range(0, len(perm), settings.minibatch):
                idx = perm[s:s + settings.minibatch]
                logits = net(z[rows[idx]])
                logp_all = torch.log_softmax(logits, dim=1)
                logp = logp_all[torch.arange(len(idx)), acts[idx]]
                ratio = torch.exp(logp - logp_old[idx])
                a = adv[idx]
                surr = torch.min(ratio * a, ratio.clamp(1 - settings.clip, 1 + settings.clip) * a)
                entropy = -(logp_all.exp() * logp_all).sum(dim=1)
                loss = -(surr.mean() + settings.entropy * entropy.mean())
                opt.zero_grad()
                loss.backward()
                opt.step()
    w = [p.detach().numpy().astype(np.float64) for p in net.parameters()]
    network = MetaNetwork(w[0].T, w[1], w[2].T, w[3], mean, std)
    return network, {"fallback": a0, "curve": curve}


__all__ = ["PPOSettings", "fallback_option", "returns", "train_choice"]
