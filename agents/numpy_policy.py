"""The trained slot scorer as a plain NumPy forward pass (no torch at inference).

Used by evaluation and the live dispatcher; picks the same actions as SB3's
``predict(obs, action_masks=mask, deterministic=True)`` (tested on recorded
observations). A policy trained on normalised observations (``VecNormalize`` with
``norm_obs``) carries the normalisation statistics and applies them first, as
``VecNormalize.normalize_obs`` does.
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


OBS_KEYS = ("slots", "backlog", "pools")  # the feature keys (the mask is never normalised)


class NumpyPolicy:
    """Masked-argmax decisions of the slot scorer from its weights.

    Args:
        weights: the scorer's layers (``<layer>.w`` / ``<layer>.b``).
        k_slots, levels: the action layout.
        obs_norm: per observation key, ``(mean, var)`` of ``VecNormalize``, or None.
        clip_obs, epsilon: ``VecNormalize``'s clipping and variance floor.
    """

    def __init__(self, weights: dict[str, np.ndarray], k_slots: int, levels: int,
                 obs_norm: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
                 clip_obs: float = 10.0, epsilon: float = 1e-8) -> None:
        self.k, self.levels = k_slots, levels
        w = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in weights.items()}
        self.w = w
        self.obs_norm = obs_norm
        self.clip_obs, self.epsilon = clip_obs, epsilon
        self._norm: list[tuple[str, np.ndarray, np.ndarray]] | None = None
        hidden = w["phi0.w"].shape[1]
        # psi's first layer acts on [h, ctx]: split it so ctx is projected once.
        self._psi_h = np.ascontiguousarray(w["psi0.w"][:hidden])
        self._psi_c = np.ascontiguousarray(w["psi0.w"][hidden:])

    @classmethod
    def from_sb3(cls, policy, vec_normalize=None) -> NumpyPolicy:
        """Weights of a ``SlotPolicy`` (its ``mlp_extractor``), and the observation
        statistics of ``vec_normalize`` (a ``VecNormalize``) if it normalises them."""
        net = policy.mlp_extractor
        weights = {}
        for name, path in _LAYERS.items():
            layer = net.get_submodule(path)
            weights[f"{name}.w"] = layer.weight.detach().cpu().numpy().T
            weights[f"{name}.b"] = layer.bias.detach().cpu().numpy()
        if vec_normalize is None or not vec_normalize.norm_obs:
            return cls(weights, net.k, net.levels)
        norm = {k: (vec_normalize.obs_rms[k].mean.copy(), vec_normalize.obs_rms[k].var.copy())
                for k in vec_normalize.norm_obs_keys}
        return cls(weights, net.k, net.levels, norm, float(vec_normalize.clip_obs),
                   float(vec_normalize.epsilon))

    def save(self, path: str | Path) -> None:
        extra: dict[str, np.ndarray] = {}
        if self.obs_norm is not None:
            extra = {"norm.clip_obs": np.float64(self.clip_obs),
                     "norm.epsilon": np.float64(self.epsilon)}
            for k, (mean, var) in self.obs_norm.items():
                extra[f"norm.{k}.mean"], extra[f"norm.{k}.var"] = mean, var
        np.savez(path, k_slots=self.k, levels=self.levels, **self.w, **extra)

    @classmethod
    def load(cls, path: str | Path) -> NumpyPolicy:
        with np.load(path) as z:
            weights = {k: z[k] for k in z.files
                       if k not in ("k_slots", "levels") and not k.startswith("norm.")}
            norm = {k: (z[f"norm.{k}.mean"], z[f"norm.{k}.var"]) for k in OBS_KEYS
                    if f"norm.{k}.mean" in z.files}
            if not norm:
                return cls(weights, int(z["k_slots"]), int(z["levels"]))
            return cls(weights, int(z["k_slots"]), int(z["levels"]), norm,
                       float(z["norm.clip_obs"]), float(z["norm.epsilon"]))

    def normalize(self, obs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``obs`` as the policy was trained to read it (``VecNormalize.normalize_obs``)."""
        if self.obs_norm is None:
            return obs
        out = dict(obs)
        norm = self._norm
        if norm is None:  # the standard deviations, once (the same values every call)
            norm = self._norm = [(k, mean, np.sqrt(var + self.epsilon))
                                 for k, (mean, var) in self.obs_norm.items()]
        c = self.clip_obs
        for k, mean, std in norm:
            # np.clip's values, without its Python wrapper (a decision's worth of time)
            y = (obs[k] - mean) / std
            out[k] = np.minimum(np.maximum(y, -c, out=y), c, out=y).astype(np.float32)
        return out

    def logits(self, obs: dict[str, np.ndarray]) -> np.ndarray:
        """Unmasked logits, shape (K * L + 1,), of a raw (unnormalised) observation."""
        obs = self.normalize(obs)
        w = self.w
        slots = obs["slots"].reshape(self.k, F)
        # Each layer's sum and tanh in place: the same values, fewer arrays made (a
        # decision's time is mostly NumPy's per-call cost at these sizes).
        h = slots @ w["phi0.w"]
        h += w["phi0.b"]
        np.tanh(h, out=h)
        h = h @ w["phi1.w"]
        h += w["phi1.b"]
        np.tanh(h, out=h)
        present = slots[:, F - 1]
        pooled = (present @ h) * (1.0 / max(float(present.sum()), 1.0))
        rest = np.concatenate((pooled, obs["backlog"], obs["pools"]))
        ctx = rest @ w["rho0.w"]
        ctx += w["rho0.b"]
        np.tanh(ctx, out=ctx)
        c = ctx @ self._psi_c
        c += w["psi0.b"]
        z = h @ self._psi_h
        z += c
        np.tanh(z, out=z)
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
