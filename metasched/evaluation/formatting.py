"""Numbers as the results tables write them (:mod:`.report`, :mod:`.step_story`)."""

from __future__ import annotations

__all__ = ["fmt", "fmt_ci"]


def fmt(x: float) -> str:
    """A number for a results table: three significant digits, thousands separated above
    100, a dash for NaN."""
    return "—" if x != x else (f"{x:.3g}" if abs(x) < 100 else f"{x:,.0f}")



def fmt_ci(v: float, ci: list[float], digits: int = 3) -> str:
    """``v (lo–hi)`` with ``digits`` decimals."""
    return f"{v:.{digits}f} ({ci[0]:.{digits}f}–{ci[1]:.{digits}f})"
