"""A profile's sampled action durations against the public figures they are fitted to.

Samples ``--trajectories`` trajectories of a profile through the simulator's own sampling
code and prints, per action type and over all tool actions (the reward excluded), the
share, median, p90, p99 and mean of the realised duration (the one-core run time capped
at the action's timeout, as a command cap cuts it) beside the source's figures.

    python benchmarks/profile_fit.py [--profile coding] [--trajectories 5000] [--seed 0]

The source for ``coding`` is the public mini-swe-agent SWE-bench trajectories (16,600 bash
actions; per-type wall times; the types classified by the command's first word). It does
not publish means: that column shows only the profile's.
"""

from __future__ import annotations

import argparse
import math

import numpy as np

from metasched.compose import profile
from metasched.sim.sampling import sample_trajectory

# (share, median, p90, p99) of wall seconds per action type; "all": every action, with
# the share of actions that hit the 60 s command cap in place of a share.
SOURCES: dict[str, dict[str, tuple[float, float, float, float]]] = {
    "coding": {
        "code_search": (0.293, 0.241, 0.366, 1.96),
        "python": (0.256, 0.339, 0.579, 1.71),
        "read": (0.202, 0.234, 0.296, 0.52),
        "edit": (0.114, 0.232, 0.289, 0.44),
        "test_run": (0.043, 0.397, 1.02, 61.4),
        "other": (0.028, 0.243, 0.380, 0.59),
        "pip_install": (0.027, 3.38, 15.6, 60.1),
        "git": (0.025, 0.240, 0.347, 2.01),
        "list": (0.013, 0.243, 0.313, 0.45),
        "all": (0.0019, 0.26, 0.51, 5.6),
    },
}


def sample_durations(name: str, trajectories: int, seed: int) -> dict[str, np.ndarray]:
    """Realised durations (true one-core time capped at the timeout) per action type of
    ``trajectories`` sampled trajectories of profile ``name``, rewards left out."""
    w, _ = profile(name)
    rng = np.random.default_rng(seed)
    shares = np.array([t.share for t in w.tasks], dtype=float)
    picks = rng.choice(len(w.tasks), size=trajectories, p=shares / shares.sum())
    out: dict[str, list[float]] = {}
    for i in picks:
        for turn in sample_trajectory(w.tasks[i], rng, w.estimate_error).turns[:-1]:
            a = turn.action
            out.setdefault(a.name, []).append(min(a.true_s, a.timeout_s))
    return {k: np.asarray(v) for k, v in out.items()}


def _cell(profile_v: float, source_v: float | None, fmt: str) -> str:
    if source_v is None or not math.isfinite(source_v):
        return f"{profile_v:{fmt}} / —"
    return f"{profile_v:{fmt}} / {source_v:{fmt}}"


def fit_table(name: str, durations: dict[str, np.ndarray]) -> str:
    """Markdown: per type and overall, profile / source for each figure."""
    source = SOURCES.get(name, {})
    n = sum(len(v) for v in durations.values())
    lines = [f"Profile `{name}`: {n:,} sampled tool actions; each cell is profile / source.",
             "", "| action type | share | median s | p90 s | p99 s | mean s |",
             "|---|---|---|---|---|---|"]
    order = [k for k in source if k in durations] + sorted(set(durations) - set(source))
    for k in order:
        x = durations[k]
        src = source.get(k, (None,) * 4)
        q = np.percentile(x, [50, 90, 99])
        lines.append(f"| {k} | {_cell(len(x) / n, src[0], '.1%')} | {_cell(q[0], src[1], '.3g')} "
                     f"| {_cell(q[1], src[2], '.3g')} | {_cell(q[2], src[3], '.3g')} "
                     f"| {_cell(float(x.mean()), None, '.3g')} |")
    x = np.concatenate(list(durations.values()))
    q = np.percentile(x, [50, 90, 99])
    src = source.get("all", (None,) * 4)
    cap = max(float(np.mean(x >= 60.0 - 1e-9)), 0.0)
    lines.append(f"| **all** (share: at the 60 s cap) | {_cell(cap, src[0], '.2%')} "
                 f"| {_cell(q[0], src[1], '.3g')} | {_cell(q[1], src[2], '.3g')} "
                 f"| {_cell(q[2], src[3], '.3g')} | {_cell(float(x.mean()), None, '.3g')} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="coding")
    ap.add_argument("--trajectories", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(fit_table(args.profile, sample_durations(args.profile, args.trajectories, args.seed)))


if __name__ == "__main__":
    main()
