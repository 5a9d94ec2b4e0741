"""The learned scheduler's network: one shared MLP scores every slot x level.

Permutation-equivariant over slots: each slot's row is embedded by the same MLP
(``phi``); a context vector pools the slot embeddings (mean over present slots)
together with the backlog and pool features (``rho``); the same scorer (``psi``) maps
[slot embedding, context] to L logits per slot; a small head (``omega``) gives the
wait logit from the context. The value head reads the context (detached: value
gradients do not move the actor) and the pool features.
The logits *are* the action distribution's parameters (identity action head).
"""

from __future__ import annotations

import torch
from gymnasium import spaces
from sb3_contrib.common.maskable.policies import MaskableActorCriticPolicy
from stable_baselines3.common.torch_layers import BaseFeaturesExtractor
from torch import nn

from metasched.core.observation import F


class ConcatExtractor(BaseFeaturesExtractor):
    """[slots (K*F), backlog (9), pools (P)] as one flat vector (the mask is not a
    feature: it enters through the masked distribution)."""

    def __init__(self, observation_space: spaces.Dict) -> None:
        dims = [int(observation_space[k].shape[0]) for k in ("slots", "backlog", "pools")]
        super().__init__(observation_space, features_dim=sum(dims))

    def forward(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([obs["slots"], obs["backlog"], obs["pools"]], dim=1)


class SlotScorer(nn.Module):
    """Maps the flat features to (K * L + 1 logits, value latent)."""

    def __init__(self, k_slots: int, levels: int, rest_dim: int, pools_dim: int,
                 hidden: int = 64) -> None:
        super().__init__()
        self.k, self.levels, self.rest_dim, self.pools_dim = k_slots, levels, rest_dim, pools_dim
        self.phi = nn.Sequential(nn.Linear(F, hidden), nn.Tanh(), nn.Linear(hidden, hidden),
                                 nn.Tanh())
        self.rho = nn.Sequential(nn.Linear(hidden + rest_dim, hidden), nn.Tanh())
        self.psi = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.Tanh(),
                                 nn.Linear(hidden, levels))
        self.omega = nn.Linear(hidden, 1)
        self.value = nn.Sequential(nn.Linear(hidden + pools_dim, hidden), nn.Tanh(),
                                   nn.Linear(hidden, hidden), nn.Tanh())
        self.latent_dim_pi = k_slots * levels + 1
        self.latent_dim_vf = hidden

    def _context(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b = features.shape[0]
        slots = features[:, : self.k * F].reshape(b, self.k, F)
        rest = features[:, self.k * F:]
        h = self.phi(slots)
        present = slots[:, :, F - 1:F]
        pooled = (h * present).sum(1) / present.sum(1).clamp(min=1.0)
        ctx = self.rho(torch.cat([pooled, rest], dim=1))
        return h, ctx

    def _logits(self, h: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        scores = self.psi(torch.cat([h, ctx.unsqueeze(1).expand(-1, self.k, -1)], dim=2))
        return torch.cat([scores.reshape(h.shape[0], -1), self.omega(ctx)], dim=1)

    def _value(self, features: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        # The critic reads the actor's context without training it: value targets are
        # large and noisy early on and would otherwise wreck the (cloned) actor.
        return self.value(torch.cat([ctx.detach(), features[:, -self.pools_dim:]], dim=1))

    def forward_actor(self, features: torch.Tensor) -> torch.Tensor:
        return self._logits(*self._context(features))

    def forward_critic(self, features: torch.Tensor) -> torch.Tensor:
        return self._value(features, self._context(features)[1])

    def forward(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, ctx = self._context(features)  # shared by both heads
        return self._logits(h, ctx), self._value(features, ctx)


class SlotPolicy(MaskableActorCriticPolicy):
    """MaskablePPO policy with the per-slot scorer (keyword ``hidden``: layer width)."""

    def __init__(self, observation_space: spaces.Dict, action_space: spaces.Discrete,
                 lr_schedule, hidden: int = 64, **kwargs) -> None:
        self._hidden = hidden
        kwargs.setdefault("features_extractor_class", ConcatExtractor)
        kwargs.setdefault("ortho_init", False)
        super().__init__(observation_space, action_space, lr_schedule, **kwargs)

    def _build_mlp_extractor(self) -> None:
        k = self.observation_space["slots"].shape[0] // F
        levels = (self.action_space.n - 1) // k
        pools = self.observation_space["pools"].shape[0]
        rest = self.observation_space["backlog"].shape[0] + pools
        self.mlp_extractor = SlotScorer(k, levels, rest, pools, self._hidden)

    def _build(self, lr_schedule) -> None:
        super()._build(lr_schedule)
        self.action_net = nn.Identity()  # the scorer's outputs are the logits
        self.optimizer = self.optimizer_class(self.parameters(), lr=lr_schedule(1),
                                              **self.optimizer_kwargs)

    def _get_constructor_parameters(self) -> dict:
        data = super()._get_constructor_parameters()
        data["hidden"] = self._hidden
        return data


def n_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
