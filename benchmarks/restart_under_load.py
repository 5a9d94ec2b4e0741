"""kill -9 of ``metasched-serve`` under load, and its restart on the same journal.

``--scenario run_code`` (each round): ``metasched-serve`` starts with a fresh journal;
once ``/v1/health`` says ok, ``--requests`` (60) ``/run_code`` calls are sent at once,
each a Python program that sleeps 3 s; ``--kill-after-s`` (2 s) later the service gets
SIGKILL, and a new one starts on the same journal. A round passes when the new one
answers ``GET /v1/ping`` within 10 s of its start, runs a new ``/run_code`` request, and
leaves no journal row queued or running 30 s after its start.

``--scenario e2b``: the ``e2b`` SDK creates 3 sandboxes and starts in each a background
command (``sleep 120`` with a marker, ``timeout=0``); SIGKILL once all three run (seen
in this host's process table), a restart on the journal, 20 s of waiting: the round
passes when none of the commands runs again (no process with the marker, no journal
row of theirs with a second attempt) and ``GET /e2b/sandboxes`` lists none.

    python benchmarks/restart_under_load.py [--isolation bwrap|gvisor] [--rounds 20]
        [--scenario run_code|e2b] [--requests 60] [--kill-after-s 2] [--json]
        [-- extra settings ...]

Printed: each round's figures (time to the first ping and the CPU time the restarted
service had used by then, to the new request's answer, to the last unfinished row
finished; the rows left), and how many rounds passed, with the load average at the
start and the end: on a loaded machine the start-up's wall time is its CPU time over
the share of a core it gets, so the 10 s target needs a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

SERVE = str(Path(sys.executable).with_name("metasched-serve"))
PING_S, SETTLE_S = 10.0, 30.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _unfinished(db: Path) -> int:
    with sqlite3.connect(db) as con:
        return con.execute("SELECT count(*) FROM requests WHERE state != 'finished'"
                           ).fetchone()[0]


class Service:
    """One ``metasched-serve`` process on ``port`` with ``journal``, logging to ``log``
    (its command line after ``wrap``, e.g. ``prlimit ... --``)."""

    def __init__(self, port: int, db: Path, isolation: str, extra: list[str], log: Path,
                 wrap: tuple[str, ...] = ()) -> None:
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [*wrap, SERVE, f"port={port}", f"journal={db}", f"sandbox.isolation={isolation}",
             f"hydra.run.dir={db.parent / 'hydra'}", *extra],
            stdout=log.open("a"), stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{port}"

    async def wait(self, c: httpx.AsyncClient, path: str, limit_s: float) -> float | None:
        """Seconds from the start until ``path`` answers 200 (None: not within limit)."""
        while time.monotonic() - self.t0 < limit_s and self.proc.poll() is None:
            try:
                if (await c.get(self.url + path, timeout=1)).status_code == 200:
                    return time.monotonic() - self.t0
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
        return None

    def cpu_s(self) -> float:
        """CPU seconds the service (and the children it has waited for) used so far:
        what its start costs whatever the machine's load (the wall time is that over
        the share of a core it gets)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.kill()


async def run_code_round(args: argparse.Namespace, work: Path) -> dict:
    db, port, log = work / "journal.db", _free_port(), work / "serve.log"
    body = {"code": "import time; time.sleep(3); print('ok')", "language": "python"}
    out: dict = {}
    first = Service(port, db, args.isolation, args.extra, log)
    try:
        async with httpx.AsyncClient(timeout=120) as c:
            if await first.wait(c, "/v1/health", 180) is None:
                raise RuntimeError(f"the first service did not start: see {log}")
            calls = [asyncio.ensure_future(c.post(first.url + "/run_code", json=body))
                     for _ in range(args.requests)]
            await asyncio.sleep(args.kill_after_s)
            first.kill()
            await asyncio.gather(*calls, return_exceptions=True)
            out["left_by_kill"] = _unfinished(db)
            second = Service(port, db, args.isolation, args.extra, log)
            try:
                out["ping_s"] = await second.wait(c, "/v1/ping", 60)
                out["ping_cpu_s"] = second.cpu_s()
                r = await c.post(second.url + "/run_code",
                                 json={"code": "print('new')", "language": "python"})
                out["new_ok"] = r.status_code == 200 and r.json().get("status") == "Success"
                out["new_s"] = time.monotonic() - second.t0
                while _unfinished(db) and time.monotonic() - second.t0 < SETTLE_S:
                    await asyncio.sleep(0.2)
                out["unfinished_at_30s"] = _unfinished(db)
                out["settled_s"] = time.monotonic() - second.t0
            finally:
                second.stop()
    finally:
        first.kill()
    out["passed"] = bool(out.get("ping_s") is not None and out["ping_s"] <= PING_S
                         and out.get("new_ok") and out.get("unfinished_at_30s") == 0)
    return out


def _processes_with(marker: str) -> int:
    """How many of this machine's processes have ``marker`` in their command line."""
    n = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            n += marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            pass
    return n


def _attempts(db: Path, marker: str) -> list[tuple[str, int, str | None]]:
    """``(state, attempts, result status)`` of the journal rows whose request holds
    ``marker``."""
    with sqlite3.connect(db) as con:
        rows = con.execute("SELECT state, attempts, result FROM requests WHERE request "
                           "LIKE ?", (f"%{marker}%",)).fetchall()
    return [(st, n, json.loads(res)["status"] if res else None) for st, n, res in rows]


async def e2b_round(args: argparse.Namespace, work: Path) -> dict:
    import e2b

    db, port, log = work / "journal.db", _free_port(), work / "serve.log"
    marker = f"m{os.getpid()}x{time.monotonic_ns()}"
    first = Service(port, db, args.isolation, args.extra, log)
    out: dict = {}
    try:
        async with httpx.AsyncClient(timeout=60) as c:
            if await first.wait(c, "/v1/health", 180) is None:
                raise RuntimeError(f"the first service did not start: see {log}")
            opts = {"api_url": first.url + "/e2b", "sandbox_url": first.url + "/e2b",
                    "api_key": "unused"}
            for _ in range(3):
                sb = await e2b.AsyncSandbox.create(**opts)
                await sb.commands.run(f"sleep 120 # {marker}", background=True, timeout=0)
            t = time.monotonic()
            while _processes_with(marker) < 3 and time.monotonic() - t < 60:
                await asyncio.sleep(0.1)
            out["running_before"] = _processes_with(marker)
            first.kill()
            second = Service(port, db, args.isolation, args.extra, log)
            try:
                out["ping_s"] = await second.wait(c, "/v1/ping", 60)
                await second.wait(c, "/v1/health", 120)
                await asyncio.sleep(20)
                out["running_after"] = _processes_with(marker)
                rows = _attempts(db, marker)
                out["rows"] = sorted({f"{st}/{n}/{res}" for st, n, res in rows})
                out["rerun"] = sum(n > 1 for _, n, _ in rows)
                r = await c.get(second.url + "/e2b/sandboxes")
                out["listed"] = len(r.json()) if r.status_code == 200 else r.status_code
            finally:
                second.stop()
    finally:
        first.kill()
    out["passed"] = (out.get("running_before", 0) >= 3 and out.get("running_after") == 0
                     and out.get("rerun") == 0 and out.get("listed") == 0)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--isolation", default="bwrap", choices=["bwrap", "gvisor"])
    p.add_argument("--scenario", default="run_code", choices=["run_code", "e2b"])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--kill-after-s", type=float, default=2.0)
    p.add_argument("--json", action="store_true")
    p.add_argument("extra", nargs="*", help="settings passed to metasched-serve")
    args = p.parse_args()
    # An installed package has its bytecode; an editable checkout run with
    # PYTHONDONTWRITEBYTECODE would compile every module at each start, in the time measured.
    import compileall

    import metasched
    compileall.compile_dir(Path(metasched.__file__).parent, quiet=1)
    load0 = os.getloadavg()[0]
    rounds = []
    for i in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="restart-") as tmp:
            one = e2b_round if args.scenario == "e2b" else run_code_round
            r = asyncio.run(one(args, Path(tmp)))
        r["load"] = round(os.getloadavg()[0], 1)
        rounds.append(r)
        print(f"round {i + 1}: " + ", ".join(
            f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()),
            flush=True)
    passed = sum(r["passed"] for r in rounds)
    summary = {"scenario": args.scenario, "isolation": args.isolation, "rounds": len(rounds),
               "passed": passed, "load_start": round(load0, 1),
               "load_end": round(os.getloadavg()[0], 1)}
    if args.scenario == "run_code":
        pings = sorted(r["ping_s"] for r in rounds if r.get("ping_s") is not None)
        summary["ping_s_max"] = round(pings[-1], 2) if pings else None
        summary["ping_cpu_s_max"] = round(max(r.get("ping_cpu_s", 0) for r in rounds), 2)
        summary["settled_s_max"] = round(max(r.get("settled_s", 0) for r in rounds), 2)
    print(json.dumps(summary) if args.json else
          f"{passed}/{len(rounds)} rounds passed ({summary})")
    sys.exit(0 if passed == len(rounds) else 1)


if __name__ == "__main__":
    main()
