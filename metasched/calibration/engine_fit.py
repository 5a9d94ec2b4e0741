"""The engine model fitted to a trace's generation lines.

A generation line that carries its batch's sums (``steps``, ``sum_batch``,
``sum_context``, ``prefills``, ``prefill_tokens``, ``swap_tokens``: what the simulator's
generation pool records) has a run time linear in the engine model's costs
(:class:`~metasched.core.engine.GenerationLine`), so least squares over the lines
recovers them. A cost whose column is zero in every line (no swap in a trace of
``recompute`` preemption, no prefill at all) cannot be told from the trace and is left
at the base engine's value, said in ``fitted`` as False.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from metasched.core.engine import EngineModel, GenerationLine

__all__ = ["COSTS", "EngineFit", "engine_table", "fit_engine"]

# The costs fitted, in the order of the design matrix's columns.
COSTS = ("decode_base_s", "decode_per_seq_s", "decode_per_ctx_s", "prefill_base_s",
         "prefill_per_token_s", "swap_per_token_s")


@dataclass(frozen=True, slots=True)
class EngineFit:
    """A fitted engine model.

    Attributes:
        engine: the base engine with the fitted costs in place.
        fitted: per cost, whether the trace told it (False: the base's value kept).
        n: generation lines fitted.
        rel_rmse: root mean square of the fit's residuals over the mean run time.
    """

    engine: EngineModel
    fitted: dict[str, bool]
    n: int
    rel_rmse: float


def _row(g: GenerationLine) -> list[float] | None:
    cols = (g.steps, g.sum_batch, g.sum_context, g.prefills, g.prefill_tokens, g.swap_tokens)
    if any(c is None for c in cols):
        return None
    return [float(g.steps), float(g.sum_batch), float(g.sum_context), float(g.prefills),
            float(g.prefill_tokens), 2.0 * float(g.swap_tokens)]


def fit_engine(lines: list[GenerationLine], base: EngineModel | None = None) -> EngineFit | None:
    """Fit the engine model's costs to ``lines`` (None: no line carries batch sums)."""
    rows, y = [], []
    for g in lines:
        r = _row(g)
        if r is not None:
            rows.append(r)
            y.append(g.run_s)
    if not rows:
        return None
    x, yv = np.asarray(rows), np.asarray(y)
    # Scale columns to comparable magnitudes (tokens against steps) before solving.
    scale = np.abs(x).max(axis=0)
    told = scale > 0
    coef = np.zeros(len(COSTS))
    sol, *_ = np.linalg.lstsq(x[:, told] / scale[told], yv, rcond=None)
    coef[told] = np.maximum(sol, 0.0) / scale[told]
    base = base or EngineModel()
    values = {c: (float(coef[i]) if told[i] else getattr(base, c)) for i, c in enumerate(COSTS)}
    values["decode_base_s"] = max(values["decode_base_s"], 1e-12)  # must stay > 0
    resid = yv - x @ coef
    rel = float(np.sqrt(np.mean(resid ** 2)) / max(np.mean(yv), 1e-12))
    return EngineFit(base.model_copy(update=values),
                     {c: bool(told[i]) for i, c in enumerate(COSTS)}, len(rows), rel)


def engine_table(fit: EngineFit) -> str:
    """The fit as a section of ``fit_report.md``."""
    lines = ["", f"## Engine model ({fit.n} generations; residual {fit.rel_rmse:.2%} of the "
             "mean run time)", "", "| cost | value | from |", "|---|---|---|"]
    for c in COSTS:
        lines.append(f"| {c} | {getattr(fit.engine, c):.4g} | "
                     f"{'the trace' if fit.fitted[c] else 'not in the trace: default kept'} |")
    return "\n".join(lines) + "\n"
