"""The trained slot scorer as a plain NumPy forward pass (no torch at inference).

Used by evaluation and the live dispatcher; picks the same actions as SB3's
``predict(obs, action_masks=mask, deterministic=True)`` (tested on recorded
observations).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from metasched.core.observation import F

# (name in the npz, attribute path in SlotScorer) for every weight and bias.
_LAYERS = {
    "phi0": "phi.0", "phi1": "phi.2", "rho0": "rho.0", "psi0": "psi.0", "psi1": "psi.2",
    "omega": "omega",
}


class NumpyPolicy:
    """Masked-argmax decisions of the slot scorer from its weights."""

    def __init__(self, weights: dict[str, np.ndarray], k_slots: int, levels: int) -> None:
        self.k, self.levels = k_slots, levels
        w = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in weights.items()}
        self.w = w
        hidden = w["phi0.w"].shape[1]
        # psi's first layer acts on [h, ctx]: split it so ctx is projected once.
        self._psi_h = np.ascontiguousarray(w["psi0.w"][:hidden])
        self._psi_c = np.ascontiguousarray(w["psi0.w"][hidden:])

    @classmethod
    def from_sb3(cls, policy) -> NumpyPolicy:
        """Weights of a ``SlotPolicy`` (its ``mlp_extractor``)."""
        net = policy.mlp_extractor
        weights = {}
        for name, path in _LAYERS.items():
            layer = net.get_submodule(path)
            weights[f"{name}.w"] = layer.weight.detach().cpu().numpy().T
            weights[f"{name}.b"] = layer.bias.detach().cpu().numpy()
        return cls(weights, net.k, net.levels)

    def save(self, path: str | Path) -> None:
        np.savez(path, k_slots=self.k, levels=self.levels, **self.w)

    @classmethod
    def load(cls, path: str | Path) -> NumpyPolicy:
        with np.load(path) as z:
            weights = {k: z[k] for k in z.files if k not in ("k_slots", "levels")}
            return cls(weights, int(z["k_slots"]), int(z["levels"]))

    def logits(self, obs: dict[str, np.ndarray]) -> np.ndarray:
        """Unmasked logits, shape (K * L + 1,)."""
        w = self.w
        slots = obs["slots"].reshape(self.k, F)
        h = np.tanh(slots @ w["phi0.w"] + w["phi0.b"])
        h = np.tanh(h @ w["phi1.w"] + w["phi1.b"])
        present = slots[:, F - 1]
        pooled = (present @ h) * (1.0 / max(float(present.sum()), 1.0))
        rest = np.concatenate((pooled, obs["backlog"], obs["pools"]))
        ctx = np.tanh(rest @ w["rho0.w"] + w["rho0.b"])
        z = np.tanh(h @ self._psi_h + (ctx @ self._psi_c + w["psi0.b"]))
        out = np.empty(self.k * self.levels + 1, dtype=np.float32)
        np.dot(z, w["psi1.w"], out=out[:-1].reshape(self.k, self.levels))
        out[:-1].reshape(self.k, self.levels)[:] += w["psi1.b"]
        out[-1] = ctx @ w["omega.w"][:, 0] + w["omega.b"][0]
        return out

    def act(self, obs: dict[str, np.ndarray], mask: np.ndarray | None = None) -> int:
        """The highest-scoring legal action (``mask`` defaults to ``obs["action_mask"]``)."""
        logits = self.logits(obs)
        m = obs["action_mask"] if mask is None else mask
        logits[m == 0] = -np.inf
        return int(logits.argmax())
