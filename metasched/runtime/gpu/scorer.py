"""An example GPU service: a tiny reward-model stand-in (``torch.nn.Linear``)."""

from __future__ import annotations

from typing import Any

from metasched.core.pools import ServiceSpec
from metasched.runtime.gpu.services import LiveService


def linear_scorer(dim: int = 64, seed: int = 0) -> LiveService:
    """A tiny reward-model stand-in: ``torch.nn.Linear(dim, 1)`` with weights drawn from
    ``seed``. Payloads are lists of at most ``dim`` floats (shorter ones zero-padded);
    results are floats. Every ``load`` builds the same weights."""

    def load() -> Any:
        import torch

        g = torch.Generator().manual_seed(seed)
        lin = torch.nn.Linear(dim, 1)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(1, dim, generator=g) / dim ** 0.5)
            lin.bias.copy_(torch.randn(1, generator=g) * 0.1)
        return lin.eval()

    def infer(model: Any, payloads: list[Any]) -> list[float]:
        import torch

        rows = []
        for k, p in enumerate(payloads):
            row = [float(v) for v in p]
            if len(row) > dim:
                raise ValueError(f"payload {k} has {len(row)} values; at most {dim}")
            rows.append(row + [0.0] * (dim - len(row)))
        w = model.weight
        x = torch.tensor(rows, dtype=w.dtype).to(w.device)
        return model(x).squeeze(-1).tolist()

    spec = ServiceSpec(mem_gb=0.001, restore_s=0.05, max_batch=8, batch_marginal=0.05)
    return LiveService(spec=spec, load=load, infer=infer)
