"""``metasched-dispatch``: run a JSONL job file through the live dispatcher.

Examples::

    metasched-dispatch jobs=jobs.jsonl
    metasched-dispatch jobs=jobs.jsonl scheduler=elastic_greedy 'cores=[0,1]'
    metasched-dispatch jobs=jobs.jsonl journal=outputs/dispatch/<run>/journal.db  # resume
    metasched-dispatch jobs=jobs.jsonl backend=ray        # the dispatcher actor on Ray

Each line of the job file is one request (see ``metasched.runtime.requests``); a line
without an ``id`` gets ``line-<n>``, so running the same file against the same journal
again resumes it instead of repeating finished work. A malformed line fails alone. The
file is read as a stream, at most ``read_ahead`` requests ahead of the results, and
each result is written to ``results.jsonl`` as it comes; then ``results.json`` and
``results.md``. SIGTERM and SIGHUP stop it as Ctrl-C does.

With ``backend=ray`` the dispatcher is the named actor on the Ray cluster at
``ray.address``: attached to if it runs (its settings apply), else started with these
(and stopped at the end, unless ``ray.keep``); the job file is read, and the results
written, here, as on one machine.
"""

from __future__ import annotations

import asyncio
import importlib
import math
import signal
import sys
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TextIO

from metasched.cli.app import STOP_SIGNALS, install_stop_handlers, make_main, stop_signal
from metasched.cli.backend_settings import open_on_ray, ray_overrides, ray_settings
from metasched.cli.job_file import count_requests, read_jobs
from metasched.cli.output import write_report
from metasched.cli.settings import bool_setting, int_setting, max_wait_setting
from metasched.core.cluster_config import parse_endpoints
from metasched.core.schema import Number, parse, valid
from metasched.errors import ConfigError
from metasched.runtime.requests import REJECTED, Result


def load_services(spec: Any) -> dict[str, Any]:
    """GPU services from ``name: "module:factory"`` (the factory returns a LiveService)."""
    if not spec:
        return {}
    out = {}
    for name, target in parse(dict[str, str], spec, "services").items():
        if ":" not in target:
            raise ConfigError(f"services.{name}", f"must be 'module:factory' (got {target!r})")
        mod, _, fn = target.partition(":")
        try:
            out[str(name)] = getattr(importlib.import_module(mod), fn)()
        except Exception as e:  # noqa: BLE001 - a user's factory: report it in one line
            raise ConfigError(f"services.{name}",
                              f"{target} failed: {type(e).__name__}: {e}") from None
    return out


def dispatcher_config(cfg: dict[str, Any], run_dir: Path, endpoints: dict | None = None):
    """A validated ``DispatcherConfig`` from the composed config (``endpoints``: the
    parsed endpoint quotas, where the app reads more than quotas from its settings)."""
    from metasched.runtime.dispatch import DispatcherConfig
    from metasched.runtime.dispatch.deadline_config import DeadlineConfig
    from metasched.runtime.limits import RequestLimits
    from metasched.runtime.sandbox.config import SandboxConfig

    scheduler = str(cfg.get("scheduler") or "checkpoints/default")
    from metasched.agents import BASELINES, make_scheduler
    from metasched.agents.checkpoint import resolve_scheduler

    # A name that is neither a heuristic nor an existing path is a typo: say so. (A
    # checkpoint that exists but cannot load makes the dispatcher fall back instead.)
    if scheduler not in BASELINES and not Path(resolve_scheduler(scheduler)).exists():
        raise ConfigError("scheduler", f"unknown scheduler {scheduler!r} (known: "
                          f"{', '.join(BASELINES)}, or a checkpoint directory)")
    config = DispatcherConfig(
        trace=cfg.get("trace"), predictor=cfg.get("predictor"), scheduler=scheduler,
        scheduler_params=cfg.get("scheduler_params") or {}, cores=cfg.get("cores"),
        gpu_standin=int_setting(cfg, "gpu_standin", 0, default=0, hi=64),
        endpoints=(parse_endpoints(cfg.get("endpoints"), "endpoints") if endpoints is None
                   else endpoints),
        tail_bytes=int_setting(cfg, "tail_bytes", 0, default=4096, hi=64 * 2**20),
        journal=cfg.get("journal") or run_dir / "journal.db",
        fsync=bool_setting(cfg, "fsync", False),
        journal_env=bool_setting(cfg, "journal_env", False),
        max_wait_s=max_wait_setting(cfg), workdir=cfg.get("workdir"),
        sandbox=SandboxConfig.from_dict(cfg.get("sandbox")),
        limits=RequestLimits.from_dict(cfg.get("limits")),
        deadlines=DeadlineConfig.from_dict(cfg.get("deadlines")))
    params = config.scheduler_params
    if scheduler in BASELINES:  # a heuristic's parameters can be checked now
        try:
            make_scheduler(scheduler, **params)
        except (TypeError, ValueError) as e:
            raise ConfigError("scheduler_params", f"{scheduler}: {e}") from None
    return config


def compact_setting(cfg: dict[str, Any]) -> float | None:
    """``compact``: compact journal rows finished this many seconds ago or more (null:
    leave the journal as it is)."""
    v = cfg.get("compact")
    if not valid(Number(ge=0.0) | None, v):
        raise ConfigError("compact", f"must be a number of seconds >= 0 or null (got {v!r})")
    return None if v is None else float(v)


@dataclass
class Tally:
    """What the results written so far add up to, kept as counts and running sums (a
    result is not kept once written): statuses, the first rejection, and the mean and
    variance of the ACT of every request that was accepted (Welford's update)."""

    status: dict[str, int] = field(default_factory=dict)
    first_rejected: str = ""
    n_act: int = 0
    mean_act: float = 0.0
    _m2: float = 0.0

    def add(self, r: Result) -> None:
        self.status[r.status] = self.status.get(r.status, 0) + 1
        if r.status == REJECTED:
            self.first_rejected = self.first_rejected or r.reason
            return
        x = r.act_s
        if x == x:  # not NaN
            self.n_act += 1
            delta = x - self.mean_act
            self.mean_act += delta / self.n_act
            self._m2 += delta * (x - self.mean_act)

    def act_ci95(self) -> list[float]:
        """Student-t 95% interval of the mean ACT (over actions)."""
        if not self.n_act:
            return [math.nan, math.nan]
        sd = math.sqrt(self._m2 / (self.n_act - 1)) if self.n_act > 1 else 0.0
        # Imported here: scipy.stats is a second of start-up that metasched-serve,
        # which imports this module, would otherwise pay before it listens.
        from metasched.evaluation.statistics import ci95_of

        return ci95_of(self.n_act, self.mean_act, sd)

    def count(self, status: str) -> int:
        return self.status.get(status, 0)


class Stopped(Exception):
    """The run was stopped by a signal (after the dispatcher closed cleanly)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


async def dispatch_all(path: str | Path, dcfg, services: dict[str, Any], out: TextIO, *,
                       total: int | None = None, progress: bool = True,
                       read_ahead: int = 4096, compact_s: float | None = None,
                       dispatcher: Any = None) -> tuple[Tally, Any, dict[str, Any]]:
    """Stream the job file at ``path`` through one dispatcher (``dispatcher``, e.g. a
    :class:`~metasched.runtime.ray_backend.remote.RemoteDispatcher`; None: a local one of
    ``dcfg`` and ``services``), at most ``read_ahead``
    requests accepted and unfinished at a time, writing each result to ``out`` (one JSON
    line) as it comes. Returns the tally, the RunResult and the dispatcher's stats. A
    request the dispatcher rejects gets ``<file>:<line>:`` before its reason.

    Raises:
        ConfigError: a setting the dispatcher cannot work with (before any job runs).
        Stopped: SIGTERM or SIGHUP arrived; running commands were killed and what did
            not finish stays in the journal.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from metasched.runtime.dispatch import Dispatcher

    name = Path(path).name
    tally = Tally()
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    stopped: list[int] = []

    def stop(sig: int) -> None:  # once: a second signal must not cancel the clean-up
        if not stopped:
            stopped.append(sig)
            main.cancel()

    # The loop's handlers first: a stop signal from here on cancels this task at its
    # next await, which a dispatcher being made or started cleans up after (the journal's
    # lock is released before interrupted() reads the journal).
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop, sig)
    try:
        # A bad setting fails here: nothing ran yet.
        d = dispatcher if dispatcher is not None else Dispatcher(dcfg, services=services)
    except BaseException:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
        install_stop_handlers()
        raise
    columns = ("[progress.description]{task.description}", BarColumn(),
               MofNCompleteColumn(), TimeElapsedColumn())
    in_flight = 0
    room = asyncio.Event()  # set when in_flight drops to the low-water mark
    low = read_ahead * 3 // 4  # refill in batches: one journal commit for many

    try:
        with Progress(*columns, disable=not progress) as bar:
            task = bar.add_task("dispatching", total=total)

            def record(r: Result) -> None:
                out.write(r.to_json() + "\n")
                tally.add(r)
                bar.advance(task)

            def finished(line: int, fut: asyncio.Future[Result]) -> None:
                nonlocal in_flight
                in_flight -= 1
                if in_flight <= low:
                    room.set()
                if fut.cancelled():  # stopping: it stays in the journal
                    return
                r = fut.result()
                if r.status == REJECTED:
                    r.reason = f"{name}:{line}: {r.reason}"
                record(r)

            async with d:
                if compact_s is not None:
                    d.compact_journal(compact_s)
                read = 0
                for line, job in read_jobs(path):
                    read += 1
                    if isinstance(job, Result):
                        record(job)
                    else:
                        fut = d.accept(job)
                        in_flight += 1
                        fut.add_done_callback(partial(finished, line))
                    if in_flight >= read_ahead:
                        room.clear()
                        await room.wait()
                    elif read % 1024 == 0:
                        await asyncio.sleep(0)  # let what was accepted run meanwhile
                while in_flight:
                    room.clear()
                    low = 0
                    await room.wait()
    except asyncio.CancelledError:
        if stopped:
            raise Stopped(stopped[0]) from None
        raise
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
        install_stop_handlers()  # removing them reset the signals to their defaults
    return tally, d.run_result(), d.stats()  # after close: its final machine sample


def live_table(name: str, jobs_file: str, summary: dict[str, Any], stats: dict[str, Any],
               tally: Tally, where: str = "on this machine", note: str = "") -> str:
    """The results table of a live run (markdown)."""
    from metasched.evaluation.formatting import fmt

    s = summary
    n_rej = tally.count(REJECTED)
    lat = stats["decision_latency_us"]
    ca = s["ci95"]["mean_act_s"]
    u = s["utilisation"]
    # The machine monitor samples this machine's cores: on Ray it has none to sample.
    measured = stats["measured_utilisation"].get("cpu")
    measured_text = f"{measured:.1%}" if measured is not None else "n/a"
    n = sum(tally.status.values())
    lines = [
        f"Jobs `{jobs_file}`: {n} requests, live {where}; scheduler "
        f"`{name}`{' (fell back: ' + stats['fallback'] + ')' if stats['fallback'] else ''}.",
        "",
        "| scheduler | done | failed | rejected | mean ACT s (95% CI, actions) | p50 | p95 | p99 "
        "| util cpu/gpu/api (granted) | cpu util (measured) | decisions | decision p50 µs "
        "| guard |",
        "|" + "---|" * 13,
        f"| {name} | {tally.count('done')} | {tally.count('failed')} | {n_rej} "
        f"| {fmt(s['mean_act_s'])} ({fmt(ca[0])}–{fmt(ca[1])}) | {fmt(s['p50_act_s'])} "
        f"| {fmt(s['p95_act_s'])} | {fmt(s['p99_act_s'])} "
        f"| {u['cpu']:.1%} / {u['gpu']:.1%} / {u['api']:.1%} | {measured_text} "
        f"| {stats['decisions']} | {fmt(lat.get('p50', float('nan')))} | {s['guard_fired']} |",
    ]
    reasons = s.get("failure_reasons") or {}
    if reasons:
        top = sorted(reasons.items(), key=lambda kv: -kv[1])[:5]
        lines += ["", "Failures: " + "; ".join(f"{k} ×{v}" for k, v in top)]
    if n_rej:
        lines += ["", f"Rejected: {n_rej} (first: {tally.first_rejected})"]
    waiting = stats.get("awaiting_resubmission", 0)
    if waiting:
        lines += ["", f"Waiting: {waiting} requests recovered from the journal were not "
                  f"resubmitted (their env was not stored); they stay unfinished in it"]
    if note:
        lines += ["", note]
    return "\n".join(lines) + "\n"


def interrupted(jobs: str, journal, sig: int = signal.SIGINT, again: str = "") -> None:
    """Ctrl-C, SIGTERM or SIGHUP: the running commands have been killed; say what is
    left and how to resume, then exit with status 128 + the signal (130, 143, 129)."""
    from metasched.runtime.journal import Journal

    with Journal(journal) as j:
        counts = j.counts()
    left = counts["queued"] + counts["running"]
    print(f"\ninterrupted ({signal.Signals(sig).name}): {counts['finished']} requests "
          f"finished, {left} unfinished; they are kept in {journal}. Resume with:\n  "
          f"metasched-dispatch jobs={jobs} journal={journal}{again}", file=sys.stderr)
    sys.exit(128 + sig)


def interrupted_on_ray(jobs: str, remote, settings, sig: int) -> None:
    """As :func:`interrupted`, for a dispatcher on Ray: one started here was stopped
    (its journal says what is left); an attached one goes on with what it accepted."""
    journal = remote.info["settings"]["journal"]
    again = f" backend=ray{ray_overrides(settings)}"
    if remote.started and not remote.keep:
        interrupted(jobs, journal, sig, again)
    print(f"\ninterrupted ({signal.Signals(sig).name}): dispatcher {remote.name!r} on Ray "
          f"goes on with what it accepted (journal {journal}). Resume (finished ids are "
          f"answered from its journal) with:\n  metasched-dispatch jobs={jobs}{again}",
          file=sys.stderr)
    sys.exit(128 + sig)


def run_dispatch(cfg: dict[str, Any], out_dir, progress: bool = True) -> dict[str, Any]:
    """Run the job file as configured; write results.jsonl, results.json, results.md."""
    from metasched.evaluation.runs import aggregate, summarise_run

    if not cfg.get("jobs"):
        raise ConfigError("jobs", "give the JSONL job file: metasched-dispatch jobs=<file>")
    out = Path(out_dir)
    on_ray = ray_settings(cfg)
    total = count_requests(cfg["jobs"])
    dcfg = dispatcher_config(cfg, out)
    read_ahead = int_setting(cfg, "read_ahead", 1, default=4096, hi=1_000_000)
    compact_s = compact_setting(cfg)
    services = load_services(cfg.get("services"))
    show = progress and bool_setting(cfg, "progress", True)
    out.mkdir(parents=True, exist_ok=True)
    remote, where = None, "on this machine"
    if on_ray is not None:
        remote = open_on_ray(on_ray, dcfg, services, cfg)
        print(remote.describe(), file=sys.stderr)
        where = f"on Ray (dispatcher `{remote.name}`, {remote.info['nodes']} nodes)"
    try:
        with open(out / "results.jsonl", "w") as f:
            tally, run, stats = asyncio.run(dispatch_all(
                cfg["jobs"], dcfg, services, f, total=total, progress=show,
                read_ahead=read_ahead, compact_s=compact_s, dispatcher=remote))
    except (Stopped, KeyboardInterrupt) as e:
        sig = e.signum if isinstance(e, Stopped) else stop_signal(e)
        if remote is not None:
            interrupted_on_ray(cfg["jobs"], remote, on_ray, sig)
        interrupted(cfg["jobs"], dcfg.journal, sig)
    finally:
        if remote is not None:
            remote.discard()  # started here, and left unclosed by a failure
    name = dcfg.scheduler
    doc = aggregate(Path(cfg["jobs"]).name, [0], [summarise_run(run, name, 0)])
    summary = doc["schedulers"][name]
    summary["rejected"] = tally.count(REJECTED)
    # One live run: the interval is over actions (evaluation's is over seeds).
    summary["ci95"]["mean_act_s"] = tally.act_ci95()
    doc["live"] = stats
    note = ""
    if remote is not None and not remote.started:
        # What the dispatcher measured covers its other clients too; the file's own
        # mean ACT is the tally's.
        summary["mean_act_s"] = tally.mean_act
        note = (f"Attached to a running dispatcher: counts and the mean ACT are this file's; "
                f"the ACT percentiles, utilisation, decisions and failures are over all it "
                f"ran since it started ({len(run.end)} actions).")
    write_report(out, doc, live_table(name, str(cfg["jobs"]), summary, stats, tally, where,
                                      note))
    return doc


main = make_main("dispatch", run_dispatch)


if __name__ == "__main__":
    main()
