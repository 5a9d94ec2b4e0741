"""Measure a grouped profile's prompt-group figures against the figures it is fitted to
(mini-swe-agent runs on 30 SWE-bench instances; WORKLOADS "Rollout structure").

    python benchmarks/group_fit.py --profile swe_grouped --steps 40
    python benchmarks/group_fit.py --profile retool_grouped workload.groups.duration_s=0.3

Samples ``--steps`` RL steps (seed ``--seed``) and prints each figure with its target.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import numpy as np

from metasched.calibration.groups import group_figures, records_of
from metasched.compose import profile
from metasched.sim.sampling import sample_workload

# The measured figures (mini-swe-agent on SWE-bench; verl's Retool recipe for the size).
TARGETS = {"turns": 0.53, "tool_s": 0.45, "generation_total_s": 0.45,
           "actions.test_run": 0.44, "actions.pip_install": 0.52, "actions.python": 0.19,
           "actions.code_search": 0.23, "history_ratio": 0.249 / 0.278,
           "gap_halves_corr": 0.36, "done_remaining_corr": -0.42}


def measure(name: str, overrides: list[str], steps: int, seed: int) -> dict:
    """The group figures of ``steps`` sampled steps of a profile."""
    w, _ = profile(name, overrides)
    inst = sample_workload(replace(w, steps=steps), np.random.default_rng(seed))
    f = group_figures(records_of(inst))
    if "static_log_error" in f:
        f["history_ratio"] = f["history_log_error"] / f["static_log_error"]
    return f


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="swe_grouped")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print every figure as JSON")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    f = measure(a.profile, a.overrides, a.steps, a.seed)
    print(f"{a.profile}: {f['trajectories']:,} trajectories in {f['prompts']:,} prompts "
          f"(size {f.get('size')})")
    print("| figure | measured | target |\n|---|---|---|")
    for key, target in TARGETS.items():
        v = f
        for part in key.split("."):
            v = v.get(part, {}) if isinstance(v, dict) else {}
        if isinstance(v, dict):
            v = v.get("share") if v else None
        if v is not None:
            print(f"| {key} | {v:.3f} | {target:.3f} |")
    if "static_log_error" in f:
        print(f"| mean abs log error: static / history | {f['static_log_error']:.3f} / "
              f"{f['history_log_error']:.3f} | 0.278 / 0.249 |")
    if a.json:
        print(json.dumps(f, indent=1, default=float))


if __name__ == "__main__":
    main()
