"""``metasched-dispatch``: run a JSONL job file through the live dispatcher.

Examples::

    metasched-dispatch jobs=jobs.jsonl
    metasched-dispatch jobs=jobs.jsonl scheduler=elastic_greedy 'cores=[0,1]'
    metasched-dispatch jobs=jobs.jsonl journal=outputs/dispatch/<run>/journal.db  # resume

Each line of the job file is one request (see ``metasched.runtime.requests``); a line
without an ``id`` gets ``line-<n>``, so running the same file against the same journal
again resumes it instead of repeating finished work. A malformed line fails alone.
Writes ``results.jsonl`` (one result per request), ``results.json`` and ``results.md``.
"""

from __future__ import annotations

import asyncio
import importlib
import json
from pathlib import Path
from typing import Any

from metasched.cli.app import make_main
from metasched.cli.output import write_report
from metasched.cli.settings import int_setting, max_wait_setting
from metasched.core.cluster_config import parse_endpoints
from metasched.errors import ConfigError
from metasched.runtime.requests import REJECTED, Result, parse_request


def read_jobs(path: str | Path) -> list[tuple[int, Any]]:
    """The job file's requests in order, as ``(line number, request)``: a parsed dict
    (with its ``id``), or a ``rejected`` :class:`Result` for a line that cannot be a
    request."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError("jobs", f"cannot read {path} ({e.strerror or e})") from None
    out: list[Any] = []
    for n, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        loc = f"{p.name}:{n}"
        try:
            d = json.loads(line)
        except (ValueError, RecursionError) as e:
            msg = getattr(e, "msg", type(e).__name__)
            out.append((n, Result(f"line-{n}", REJECTED, f"{loc}: invalid JSON ({msg})")))
            continue
        if isinstance(d, dict) and "id" not in d:
            d["id"] = f"line-{n}"
        try:
            parse_request(d, loc)
        except ConfigError as e:
            rid = d.get("id") if isinstance(d, dict) else None
            out.append((n, Result(str(rid or f"line-{n}"), REJECTED, str(e))))
            continue
        out.append((n, d))
    if not out:
        raise ConfigError("jobs", f"{path} holds no requests")
    return out


def load_services(spec: Any) -> dict[str, Any]:
    """GPU services from ``name: "module:factory"`` (the factory returns a LiveService)."""
    if not spec:
        return {}
    if not isinstance(spec, dict):
        raise ConfigError("services", f"must be a mapping of name to 'module:factory' "
                          f"(got {spec!r})")
    out = {}
    for name, target in spec.items():
        if not isinstance(target, str) or ":" not in target:
            raise ConfigError(f"services.{name}", f"must be 'module:factory' (got {target!r})")
        mod, _, fn = target.partition(":")
        try:
            out[str(name)] = getattr(importlib.import_module(mod), fn)()
        except Exception as e:  # noqa: BLE001 - a user's factory: report it in one line
            raise ConfigError(f"services.{name}",
                              f"{target} failed: {type(e).__name__}: {e}") from None
    return out


def dispatcher_config(cfg: dict[str, Any], run_dir: Path):
    """A validated ``DispatcherConfig`` from the composed config."""
    from metasched.runtime.dispatcher import DispatcherConfig

    cores = cfg.get("cores")
    if cores is not None and (not isinstance(cores, list) or not cores or not all(
            isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in cores)):
        raise ConfigError("cores", f"must be a list of CPU ids or null (got {cores!r})")
    scheduler = str(cfg.get("scheduler") or "checkpoints/default")
    from metasched.agents import BASELINES
    from metasched.agents.checkpoint import resolve_scheduler

    # A name that is neither a heuristic nor an existing path is a typo: say so. (A
    # checkpoint that exists but cannot load makes the dispatcher fall back instead.)
    if scheduler not in BASELINES and not Path(resolve_scheduler(scheduler)).exists():
        raise ConfigError("scheduler", f"unknown scheduler {scheduler!r} (known: "
                          f"{', '.join(BASELINES)}, or a checkpoint directory)")
    return DispatcherConfig(
        scheduler=scheduler,
        scheduler_params=dict(cfg.get("scheduler_params") or {}), cores=cores,
        gpu_standin=int_setting(cfg, "gpu_standin", 0, default=0),
        endpoints=parse_endpoints(cfg.get("endpoints"), "endpoints"),
        journal=cfg.get("journal") or run_dir / "journal.db", fsync=bool(cfg.get("fsync")),
        max_wait_s=max_wait_setting(cfg), workdir=cfg.get("workdir"))


async def dispatch_all(jobs: list[tuple[int, Any]], dcfg, services: dict[str, Any],
                       progress: bool = True, name: str = "jobs"
                       ) -> tuple[list[Result], Any, dict[str, Any]]:
    """Run ``jobs`` (from :func:`read_jobs`) through one dispatcher; returns the results
    in job order, the RunResult and the dispatcher's stats. A request the dispatcher
    rejects gets ``<name>:<line>:`` before its reason."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from metasched.runtime.dispatcher import Dispatcher

    results: list[Result | None] = [j if isinstance(j, Result) else None for _, j in jobs]
    async with Dispatcher(dcfg, services=services) as d:
        futures = {}
        for i, (_, j) in enumerate(jobs):
            if results[i] is None:
                futures[d.accept(j)] = i
        columns = ("[progress.description]{task.description}", BarColumn(),
                   MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, disable=not progress) as bar:
            task = bar.add_task("dispatching", total=len(futures))
            for fut in asyncio.as_completed(list(futures)):
                await fut
                bar.advance(task)
        for fut, i in futures.items():
            r = results[i] = fut.result()
            if r.status == REJECTED:
                r.reason = f"{name}:{jobs[i][0]}: {r.reason}"
    return results, d.run_result(), d.stats()  # after close: its final machine sample


def live_table(name: str, jobs_file: str, summary: dict[str, Any], stats: dict[str, Any],
               results: list[Result]) -> str:
    """The results table of a live run (markdown)."""
    from metasched.evaluation.report import fmt

    s = summary
    n_rej = sum(r.status == REJECTED for r in results)
    lat = stats["decision_latency_us"]
    ca = s["ci95"]["mean_act_s"]
    u = s["utilisation"]
    measured = stats["measured_utilisation"]
    lines = [
        f"Jobs `{jobs_file}`: {len(results)} requests, live on this machine; scheduler "
        f"`{name}`{' (fell back: ' + stats['fallback'] + ')' if stats['fallback'] else ''}.",
        "",
        "| scheduler | done | failed | rejected | mean ACT s (95% CI, actions) | p50 | p95 | p99 "
        "| util cpu/gpu/api (granted) | cpu util (measured) | decisions | decision p50 µs "
        "| guard |",
        "|" + "---|" * 13,
        f"| {name} | {sum(r.status == 'done' for r in results)} | {s['failed']} | {n_rej} "
        f"| {fmt(s['mean_act_s'])} ({fmt(ca[0])}–{fmt(ca[1])}) | {fmt(s['p50_act_s'])} "
        f"| {fmt(s['p95_act_s'])} | {fmt(s['p99_act_s'])} "
        f"| {u['cpu']:.1%} / {u['gpu']:.1%} / {u['api']:.1%} | {measured.get('cpu', 0.0):.1%} "
        f"| {stats['decisions']} | {fmt(lat.get('p50', float('nan')))} | {s['guard_fired']} |",
    ]
    reasons = s.get("failure_reasons") or {}
    if reasons:
        top = sorted(reasons.items(), key=lambda kv: -kv[1])[:5]
        lines += ["", "Failures: " + "; ".join(f"{k} ×{v}" for k, v in top)]
    if n_rej:
        first = next(r for r in results if r.status == REJECTED)
        lines += ["", f"Rejected: {n_rej} (first: {first.reason})"]
    return "\n".join(lines) + "\n"


def interrupted(jobs: str, journal) -> None:
    """Ctrl-C: the running commands have been killed; say what is left and how to
    resume, then exit with status 130."""
    import sys

    from metasched.runtime.journal import Journal

    with Journal(journal) as j:
        counts = j.counts()
    left = counts["queued"] + counts["running"]
    print(f"\ninterrupted: {counts['finished']} requests finished, {left} unfinished; they "
          f"are kept in {journal}. Resume with:\n  metasched-dispatch jobs={jobs} "
          f"journal={journal}", file=sys.stderr)
    sys.exit(130)


def run_dispatch(cfg: dict[str, Any], out_dir, progress: bool = True) -> dict[str, Any]:
    """Run the job file as configured; write results.jsonl, results.json, results.md."""
    from metasched.evaluation.runs import aggregate, summarise_run
    from metasched.evaluation.statistics import ci95

    if not cfg.get("jobs"):
        raise ConfigError("jobs", "give the JSONL job file: metasched-dispatch jobs=<file>")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jobs = read_jobs(cfg["jobs"])
    dcfg = dispatcher_config(cfg, out)
    services = load_services(cfg.get("services"))
    try:
        results, run, stats = asyncio.run(dispatch_all(
            jobs, dcfg, services, progress=progress and bool(cfg.get("progress", True)),
            name=Path(cfg["jobs"]).name))
    except KeyboardInterrupt:
        interrupted(cfg["jobs"], dcfg.journal)
    name = dcfg.scheduler
    doc = aggregate(Path(cfg["jobs"]).name, [0], [summarise_run(run, name, 0)])
    summary = doc["schedulers"][name]
    summary["rejected"] = sum(r.status == REJECTED for r in results)
    # One live run: the interval is over actions (evaluation's is over seeds).
    act = [r.act_s for r in results if r.status != REJECTED]
    summary["ci95"]["mean_act_s"] = ci95(act) if act else [float("nan")] * 2
    doc["live"] = stats
    with open(out / "results.jsonl", "w") as f:
        for r in results:
            f.write(r.to_json() + "\n")
    write_report(out, doc, live_table(name, str(cfg["jobs"]), summary, stats, results))
    return doc


main = make_main("dispatch", run_dispatch)


if __name__ == "__main__":
    main()
