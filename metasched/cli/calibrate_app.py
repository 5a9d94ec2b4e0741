"""``metasched-calibrate TRACE``: fit a workload profile to a recorded trace.

Writes ``OUT/workload/NAME.yaml`` and ``OUT/cluster/NAME.yaml`` (a Hydra config
directory: ``metasched-eval --config-dir OUT workload=NAME``, and the same for
``metasched-plan`` and ``metasched-train``), ``OUT/fit_report.md`` (printed too),
``OUT/qq.png`` and ``OUT/calibration.json``.

Examples::

    metasched-dispatch jobs=jobs.jsonl trace=live.jsonl
    metasched-calibrate live.jsonl                       # -> outputs/calibrate/live/
    metasched-calibrate live.jsonl --name mine --out my_configs --base coding
    metasched-eval --config-dir outputs/calibrate/live workload=live
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
from pathlib import Path
from typing import Any

from metasched.cli.app import install_stop_handlers, stop_signal, user_errors
from metasched.cli.output import json_safe
from metasched.errors import ConfigError


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors in the apps' one-line form."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"error: arguments: {message} (see metasched-calibrate --help)", file=sys.stderr)
        sys.exit(2)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="metasched-calibrate",
        description="Fit a workload profile (configs/workload and configs/cluster YAML) to a "
                    "trace recorded by metasched-dispatch trace=... or the simulator.")
    p.add_argument("trace", help="the JSONL trace")
    p.add_argument("--name", help="the profile's name (default: the trace file's stem)")
    p.add_argument("--out", help="the config directory to write (default: "
                   "outputs/calibrate/NAME)")
    p.add_argument("--base", help="a profile whose sandboxes and service sizes fill what the "
                   "trace cannot say, and whose cluster is used when the trace has no cluster "
                   "line (e.g. coding)")
    p.add_argument("--no-plot", action="store_true", help="do not draw qq.png")
    p.add_argument("--quiet", action="store_true", help="no progress bar, no report on stdout")
    return p


def _default_name(trace: str) -> str:
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(trace).stem) or "calibrated"
    return stem if stem[0] not in ".-" else f"_{stem}"


def _count_lines(path: Path) -> int | None:
    try:
        with open(path, "rb") as f:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    except OSError:
        return None  # read_samples reports it


def run_calibrate(args: argparse.Namespace) -> dict[str, Any]:
    """Calibrate as the command line says; returns what ``calibration.json`` holds."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from metasched.calibration.profile import calibrate
    from metasched.calibration.report import fit_table, qq_plot, quantile_rows
    from metasched.calibration.samples import read_samples

    trace = Path(args.trace)
    name = args.name or _default_name(args.trace)
    out = Path(args.out) if args.out else Path("outputs/calibrate") / name
    base = None
    if args.base:
        from metasched.compose import compose

        base = compose("eval", [f"workload={args.base}"])
    total = _count_lines(trace)
    columns = ("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, disable=args.quiet, transient=True) as bar:
        task = bar.add_task("reading trace lines", total=total)
        samples = read_samples(trace, progress=lambda n: bar.update(task, completed=n))
        bar.update(task, completed=total)
    cal = calibrate(samples, name, base)
    workload_yaml, cluster_yaml = cal.workload_yaml(), cal.cluster_yaml()
    _check(workload_yaml, cluster_yaml, out)
    try:
        (out / "workload").mkdir(parents=True, exist_ok=True)
        (out / "cluster").mkdir(parents=True, exist_ok=True)
        (out / "workload" / f"{name}.yaml").write_text(workload_yaml)
        (out / "cluster" / f"{name}.yaml").write_text(cluster_yaml)
        table = fit_table(cal)
        (out / "fit_report.md").write_text(table)
        if not args.no_plot:
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
           "report": quantile_rows(cal), "notes": cal.notes}
    (out / "calibration.json").write_text(json.dumps(json_safe(doc), indent=2) + "\n")
    if not args.quiet:
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


@user_errors
def _main(argv: list[str] | None) -> None:
    run_calibrate(_parser().parse_args(argv))


def main(argv: list[str] | None = None) -> None:
    """The console entry point."""
    install_stop_handlers()
    try:
        _main(argv)
    except KeyboardInterrupt as e:
        sig = stop_signal(e)
        print(f"\ninterrupted ({signal.Signals(sig).name})", file=sys.stderr)
        sys.exit(128 + sig)


if __name__ == "__main__":
    main()
