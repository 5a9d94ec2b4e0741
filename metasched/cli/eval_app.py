"""``metasched-eval``: compare schedulers on evaluation seeds of a workload profile.

Examples::

    metasched-eval                                    # coding, all baselines
    metasched-eval workload=rm_math n_seeds=16 'schedulers=[static,elastic_greedy]'
    metasched-eval workload=search hydra.run.dir=outputs/search
    metasched-eval workload=rm_math cluster.gpu.devices=1 reference=elastic_greedy
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from metasched.cli.app import make_main
from metasched.cli.output import write_report
from metasched.cli.settings import (
    int_setting,
    max_wait_setting,
    schedulers_setting,
    seeds_setting,
)
from metasched.compose import load_profile
from metasched.core.predictor import DESIGNS
from metasched.errors import ConfigError, one_of
from metasched.sim.simulator import ESTIMATES


def eval_settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """Validated evaluation settings from a composed config."""
    scheds, paths, params = schedulers_setting(cfg)
    reference = cfg.get("reference")
    one_of(reference, scheds, "reference", what="the schedulers", null=True)
    dt = cfg.get("timeline_dt", 10.0)
    if isinstance(dt, bool) or not isinstance(dt, (int, float)) or not dt > 0:
        raise ConfigError("timeline_dt", f"must be a number > 0 (got {dt!r})")
    est = cfg.get("estimates", "given")
    one_of(est, ESTIMATES, "estimates")
    fit_on = (cfg.get("predictor") or {}).get("fit_on", "auto")
    design = (cfg.get("predictor") or {}).get("design", "boost")
    one_of(design, DESIGNS, "predictor.design")
    if not isinstance(fit_on, str) or not fit_on:
        raise ConfigError("predictor.fit_on", f"must be auto, cross or a trace's path (got "
                          f"{fit_on!r})")
    return {"schedulers": scheds, "paths": paths, "params": params, "estimates": est,
            "fit_on": fit_on, "design": design,
            "seeds": seeds_setting(cfg), "workers": int_setting(cfg, "workers", 1),
            "timeline_dt": float(dt), "plots": bool(cfg.get("plots", True)),
            "max_wait_s": max_wait_setting(cfg), "reference": reference}


def run_eval(cfg: dict[str, Any], out_dir, progress: bool = True) -> dict[str, Any]:
    """Evaluate as configured and write results.json, results.md and plots to ``out_dir``."""
    from metasched.evaluation.report import plot_all, results_table
    from metasched.evaluation.runs import evaluate

    workload, cluster = load_profile(cfg)
    s = eval_settings(cfg)
    doc, runs = evaluate(workload, cluster, s["schedulers"], s["seeds"], params=s["params"],
                         workers=s["workers"], timeline_dt=s["timeline_dt"],
                         max_wait_s=s["max_wait_s"], paths=s["paths"],
                         estimates=s["estimates"], reference=s["reference"],
                         fit_on=s["fit_on"], design=s["design"], progress=progress)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if s["plots"]:
        plot_all(doc, runs, out)
    write_report(out, doc, results_table(doc))
    return doc


main = make_main("eval", run_eval)


if __name__ == "__main__":
    main()
