"""``metasched-calibrate trace=TRACE``: fit a workload profile to a recorded trace.

Writes ``OUT/workload/NAME.yaml`` and ``OUT/cluster/NAME.yaml`` (a Hydra config
directory: ``metasched-eval --config-dir OUT workload=NAME``, and the same for
``metasched-plan`` and ``metasched-train``), ``OUT/fit_report.md`` (printed too),
``OUT/qq.png`` and ``OUT/calibration.json``. Settings: ``configs/calibrate.yaml``.

Examples::

    metasched-dispatch jobs=jobs.jsonl trace=live.jsonl
    metasched-calibrate trace=live.jsonl                 # -> outputs/calibrate/live/
    metasched-calibrate trace=live.jsonl name=mine out=my_configs base=coding
    metasched-eval --config-dir outputs/calibrate/live workload=live
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from metasched.cli.app import make_main
from metasched.cli.output import json_safe
from metasched.cli.settings import bool_setting
from metasched.errors import ConfigError


def _text(cfg: dict[str, Any], key: str, *, required: bool = False) -> str | None:
    v = cfg.get(key)
    if v is None and required:
        raise ConfigError(key, f"required: the trace to calibrate (metasched-calibrate "
                          f"{key}=live.jsonl)")
    if isinstance(v, int) and not isinstance(v, bool):  # name=2024: Hydra reads a number
        v = str(v)
    if v is not None and (not isinstance(v, str) or not v):
        raise ConfigError(key, f"must be a non-empty string (got {v!r})")
    return v


def calibrate_settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """Validated calibration settings from a composed ``calibrate`` config (one-line
    errors): trace, name, out, base, plot, quiet."""
    return {"trace": _text(cfg, "trace", required=True), "name": _text(cfg, "name"),
            "out": _text(cfg, "out"), "base": _text(cfg, "base"),
            "plot": bool_setting(cfg, "plot", True), "quiet": bool_setting(cfg, "quiet", False)}


def _default_name(trace: str) -> str:
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(trace).stem) or "calibrated"
    return stem if stem[0] not in ".-" else f"_{stem}"


def _count_lines(path: Path) -> int | None:
    try:
        with open(path, "rb") as f:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    except OSError:
        return None  # read_samples reports it


def run_calibrate(cfg: dict[str, Any], out_dir: str | Path | None = None) -> dict[str, Any]:
    """Calibrate as a composed ``calibrate`` config says (``out_dir``, Hydra's run
    directory, is unused: everything goes to ``out``); returns what
    ``calibration.json`` holds."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from metasched.calibration import profile_yaml
    from metasched.calibration.engine_fit import COSTS, engine_table, fit_engine
    from metasched.calibration.profile import calibrate
    from metasched.calibration.report import fit_table, qq_plot, quantile_rows
    from metasched.calibration.samples import read_samples

    s = calibrate_settings(cfg)
    trace = Path(s["trace"])
    name = s["name"] or _default_name(s["trace"])
    out = Path(s["out"]) if s["out"] else Path("outputs/calibrate") / name
    base = None
    if s["base"]:
        from metasched.compose import compose

        try:
            base = compose("eval", [f"workload={s['base']}"])
        except ConfigError as e:
            raise ConfigError("base", e.problem) from None
    total = _count_lines(trace)
    columns = ("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, disable=s["quiet"], transient=True) as bar:
        task = bar.add_task("reading trace lines", total=total)
        samples = read_samples(trace, progress=lambda n: bar.update(task, completed=n))
        bar.update(task, completed=total)
    cal = calibrate(samples, name, base)
    engine = fit_engine(samples.generations)
    workload_yaml, cluster_yaml = profile_yaml.workload_yaml(cal), profile_yaml.cluster_yaml(cal)
    _check(workload_yaml, cluster_yaml, out)
    try:
        (out / "workload").mkdir(parents=True, exist_ok=True)
        (out / "cluster").mkdir(parents=True, exist_ok=True)
        (out / "workload" / f"{name}.yaml").write_text(workload_yaml)
        (out / "cluster" / f"{name}.yaml").write_text(cluster_yaml)
        table = fit_table(cal) + ("" if engine is None else engine_table(engine))
        (out / "fit_report.md").write_text(table)
        if s["plot"]:
            qq_plot(cal, out / "qq.png")
    except OSError as e:
        raise ConfigError("out", f"{out}: cannot write there ({e.strerror or e})") from None
    doc = {"name": name, "trace": str(trace), "actions": samples.n_actions,
           "steps": cal.steps, "trajectories_per_step": cal.trajectories_per_step,
           "estimate_error": cal.estimate_error,
           "types": {f.label: {"n": f.samples.n, "kind": f.samples.kind,
                               "quantiles": {str(k): v for k, v in f.duration.quantiles.items()},
                               "parallel_fraction": f.parallel_fraction,
                               "amdahl_fitted": f.amdahl is not None,
                               "timeout_rate": f.timeout_rate,
                               "fitted_timeout_rate": f.fitted_timeout_rate,
                               "estimate_error": f.est_sigma, "ks": f.duration.ks}
                     for f in cal.types},
           "tasks": {t.name: {"trajectories": t.n_traj, "share": t.share,
                              "turns": {str(k): v for k, v in t.turns.quantiles.items()},
                              "generation_s": None if t.gaps is None else
                              {str(k): v for k, v in t.gaps.quantiles.items()},
                              "generation_zero": None if t.gaps is None else t.gaps.zero}
                     for t in cal.tasks},
           "groups": None if cal.groups is None else {**cal.groups.config(),
                                                      "prompts": cal.groups.prompts,
                                                      "figures": cal.groups.figures},
           "report": quantile_rows(cal), "notes": cal.notes,
           "engine": None if engine is None else {
               "costs": {c: getattr(engine.engine, c) for c in COSTS},
               "fitted": engine.fitted, "generations": engine.n,
               "rel_rmse": engine.rel_rmse}}
    (out / "calibration.json").write_text(json.dumps(json_safe(doc), indent=2) + "\n")
    if not s["quiet"]:
        print(table)
        print(f"profile written to {out}/workload/{name}.yaml (cluster: {out}/cluster/"
              f"{name}.yaml)\nuse it: metasched-eval --config-dir {out} workload={name}")
    return doc


def _check(workload_yaml: str, cluster_yaml: str, out: Path) -> None:
    """The files about to be written parse as the apps will parse them (a calibration
    that writes a profile the apps reject is a bug, reported before anything is written)."""
    import yaml

    from metasched.core.cluster_config import parse_cluster
    from metasched.sim.workload_config import check_compatible, parse_workload

    w = parse_workload(yaml.safe_load(workload_yaml), "calibrated workload")
    c = yaml.safe_load(cluster_yaml)
    if "defaults" not in c:
        check_compatible(w, parse_cluster(c, "calibrated cluster"))


main = make_main("calibrate", run_calibrate)


if __name__ == "__main__":
    main()
