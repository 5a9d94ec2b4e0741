"""The fit report of a calibration: fitted against empirical quantiles per action type
(and for turns and generation gaps), as a Markdown table and a QQ plot."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from metasched.calibration.fits import censored_quantile
from metasched.calibration.groups import groups_report
from metasched.calibration.profile import Calibration

REPORT_QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99)


def _fmt(v: float | None) -> str:
    if v is None or not math.isfinite(v):
        return "—"
    return f"{v:.3g}"


def _series(cal: Calibration) -> list[tuple[str, np.ndarray, np.ndarray, Any]]:
    """(label, samples, censored mask, fitted Dist) for every fitted distribution."""
    out = []
    for f in cal.types:
        out.append((f.label, f.x, f.censored, f.duration.dist))
    for t in cal.tasks:
        if t.gaps is not None:  # per agent turn where the task has turn groups
            g = np.asarray((cal.samples.turn_gaps if t.turn_groups else cal.samples.gaps)
                           [t.name], float)
            out.append((f"{t.name}: generation gap", g, np.zeros(len(g), bool), t.gaps.dist))
    return out


def quantile_rows(cal: Calibration) -> list[dict[str, Any]]:
    """Per fitted distribution: n, and the empirical and fitted value at each of
    ``REPORT_QUANTILES`` (empirical: None where censored runs leave it unknown)."""
    rows = []
    for label, x, cens, dist in _series(cal):
        emp = [censored_quantile(x, cens, q) for q in REPORT_QUANTILES]
        fit = [float(v) for v in dist.quantile(np.array(REPORT_QUANTILES))]
        rows.append({"label": label, "n": len(x), "empirical": emp, "fitted": fit})
    for t in cal.tasks:
        counts = np.array([tr.groups if t.turn_groups else tr.tools
                           for s in cal.samples.steps() for tr in s if tr.task == t.name],
                          float)
        emp = [float(np.quantile(counts, q)) for q in REPORT_QUANTILES]
        fit = [float(v) for v in np.round(t.turns.dist.quantile(np.array(REPORT_QUANTILES)))]
        rows.append({"label": f"{t.name}: turns", "n": len(counts), "empirical": emp,
                     "fitted": fit})
    return rows


def fit_table(cal: Calibration) -> str:
    """The report printed and written as ``fit_report.md``."""
    head = ("| type | n | " + " | ".join(f"p{round(q * 100)} emp / fit" for q in REPORT_QUANTILES)
            + " |")
    lines = [f"Calibrated profile `{cal.name}` from {cal.samples.path}: "
             f"{cal.samples.n_actions:,} measured actions, {cal.steps} steps of "
             f"{cal.trajectories_per_step} trajectories, estimate error sigma "
             f"{cal.estimate_error:.3f}.", "",
             "Fitted against empirical quantiles (seconds; turns in counts; cpu durations on "
             "one core):", "", head, "|" + "---|" * (2 + len(REPORT_QUANTILES))]
    for r in quantile_rows(cal):
        cells = [f"{_fmt(e)} / {_fmt(f)}" for e, f in zip(r["empirical"], r["fitted"],
                                                          strict=True)]
        lines.append(f"| {r['label']} | {r['n']:,} | " + " | ".join(cells) + " |")
    lines += ["", "| type | timeout rate emp / fit | Amdahl p | core counts | estimate "
              "error sigma | KS |", "|---|---|---|---|---|---|"]
    for f in cal.types:
        a = f.amdahl
        counts = (f"{len(a.core_counts)} ({a.core_counts[0]}–{a.core_counts[-1]})"
                  if a is not None else "one")
        p = f"{f.parallel_fraction:.3f}" + ("" if a is not None else " (declared)")
        lines.append(f"| {f.label} | {f.timeout_rate:.2%} / {f.fitted_timeout_rate:.2%} | "
                     f"{p if f.samples.kind == 'cpu' else '—'} | "
                     f"{counts if f.samples.kind == 'cpu' else '—'} | {_fmt(f.est_sigma)} | "
                     f"{_fmt(f.duration.ks)} |")
    if cal.groups is not None:
        lines += groups_report(cal.groups)
    if cal.notes:
        lines += [""] + [f"Note: {n}" for n in cal.notes]
    return "\n".join(lines) + "\n"


def qq_plot(cal: Calibration, path: Path) -> None:
    """Empirical against fitted quantiles (log-log) for every fitted distribution."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

    series = _series(cal)
    cols = min(4, len(series))
    rows = math.ceil(len(series) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.0 * rows), squeeze=False)
    probs = np.linspace(0.005, 0.995, 199)
    for ax, (label, x, cens, dist) in zip(axes.flat, series, strict=False):
        emp = np.array([censored_quantile(x, cens, q) or np.nan for q in probs], float)
        fit = dist.quantile(probs)
        ok = np.isfinite(emp) & (emp > 0) & (fit > 0)
        ax.loglog(fit[ok], emp[ok], ".", ms=3)
        if ok.any():
            lo, hi = min(fit[ok].min(), emp[ok].min()), max(fit[ok].max(), emp[ok].max())
            ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
        ax.set_title(f"{label} (n={len(x):,})", fontsize=8)
        ax.set_xlabel("fitted quantile", fontsize=7)
        ax.set_ylabel("empirical quantile", fontsize=7)
        ax.tick_params(labelsize=6)
        for axis in (ax.xaxis, ax.yaxis):  # plain numbers at 1, 2, 5 x 10^k; no minor labels
            axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            axis.set_major_formatter(FormatStrFormatter("%g"))
            axis.set_minor_formatter(NullFormatter())
    for ax in list(axes.flat)[len(series):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["fit_table", "qq_plot", "quantile_rows"]
