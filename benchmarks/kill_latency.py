"""How long a dispatcher's commands outlive it: kill -9 of a process running a real
:class:`~metasched.runtime.dispatch.Dispatcher` (with a journal) while it runs
commands, and the time from the SIGKILL to the last of their processes gone.

Each round starts a dispatcher in a child process, has it run two commands (one core
each): ``sleep 600``, and a shell whose background subshells each wait ``--delay``
seconds and then perform a side effect (write a file, then exec a marker ``sleep``), a
command that would complete its side effect if it outlived the dispatcher by that much.
Once every one of their processes runs (the commands' leaders, recorded in the journal,
and all their descendants), each is watched by a pidfd, the dispatcher gets SIGKILL,
and the time until every pidfd says "exited" is taken (a zombie counts as gone: it runs
no more code). The side effect is looked for ``--delay`` + 0.5 s after the kill.
Survivors are then killed, so that rounds do not pile up.

    python benchmarks/kill_latency.py [--kills 20] [--isolation bwrap|none|auto]
        [--cgroups auto|v1|v2|none] [--user UID] [--delay 0.3]

``--user`` runs the dispatcher as that (unprivileged) user: no sandbox server then, the
dispatcher starts the commands itself (isolation ``none``).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil

from metasched.runtime.journal import Journal

_MARKER = "61.5"  # `sleep 61.5`: the side effect's marker process

CHILD = textwrap.dedent("""
    import asyncio, json, sys
    from metasched.runtime.dispatch import Dispatcher, DispatcherConfig
    from metasched.runtime.sandbox.config import SandboxConfig

    async def main(db, workdir, isolation, cgroups, requests):
        cfg = DispatcherConfig(scheduler="elastic_greedy", journal=db, workdir=workdir,
                               sample_interval_s=0.1,
                               sandbox=SandboxConfig(isolation=isolation, cgroups=cgroups))
        async with Dispatcher(cfg) as d:
            for r in json.loads(open(requests).read()):
                d.accept(r)
            d.flush()
            print("accepted", flush=True)
            await asyncio.sleep(3600)

    asyncio.run(main(*sys.argv[1:]))
""")


def commands(effect: str, delay: float) -> list[dict]:
    """The two commands: a sleeper, and one whose subshells do the side effect after
    ``delay`` (one of them in a new session, out of the command's process group)."""
    later = f"sleep {delay}; echo done > {effect}; exec sleep {_MARKER}"
    script = f"({later}) & setsid sh -c '{later}' & sleep 600; wait"
    return [{"id": "sleeper", "kind": "cpu", "timeout_s": 900, "argv": ["sleep", "600"]},
            {"id": "effect", "kind": "cpu", "timeout_s": 900,
             "argv": ["/bin/sh", "-c", script]}]


def _tree(pid: int) -> list[psutil.Process]:
    try:
        p = psutil.Process(pid)
        return [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _wait_running(db: Path, delay: float, timeout_s: float = 60.0) -> list[psutil.Process]:
    """The commands' processes once all run: both leaders (from the journal), the
    sleepers and the two delayed subshells."""
    deadline = time.monotonic() + timeout_s
    with Journal(db, lock=False) as j:
        while time.monotonic() < deadline:
            leaders = [pid for _, pid in j.orphans()]
            procs = [p for pid in leaders for p in _tree(pid)]
            try:
                lines = [" ".join(p.cmdline()) for p in procs]
            except psutil.NoSuchProcess:
                continue
            if (len(leaders) == 2 and lines.count("sleep 600") == 2
                    and lines.count(f"sleep {delay}") == 2):
                return procs
            time.sleep(0.01)
    raise SystemExit("the commands did not start in time")


def one_kill(args: argparse.Namespace, tmp: Path) -> tuple[float, float, bool]:
    """One round: (ms to the last command process gone, ms to every process the
    dispatcher started gone, whether the side effect happened)."""
    db, effect = tmp / "journal.db", Path(args.visible) / f"effect-{os.getpid()}"
    effect.unlink(missing_ok=True)
    (tmp / "requests.json").write_text(json.dumps(commands(str(effect), args.delay)))
    argv = [sys.executable, "-c", CHILD, str(db), str(tmp), args.isolation, args.cgroups,
            str(tmp / "requests.json")]
    if args.user is not None:
        argv = ["setpriv", f"--reuid={args.user}", f"--regid={args.user}", "--clear-groups",
                *argv]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
    try:
        if child.stdout.readline().split() != ["accepted"]:
            raise SystemExit("the dispatcher did not start")
        procs = _wait_running(db, args.delay)
        everything = [p for p in _tree(child.pid) if p.pid != child.pid]
        fds = {p.pid: os.pidfd_open(p.pid) for p in {*procs, *everything}}
        ours = {p.pid for p in procs}
        poll = select.poll()
        for fd in fds.values():
            poll.register(fd, select.POLLIN)
        by_fd = {fd: pid for pid, fd in fds.items()}
        left, t_cmd, t_all = set(fds), None, None
        t0 = time.monotonic()
        os.kill(child.pid, signal.SIGKILL)
        while left and time.monotonic() - t0 < 5:
            for fd, _ in poll.poll(5):
                poll.unregister(fd)
                left.discard(by_fd[fd])
            now = time.monotonic()
            if t_cmd is None and not left & ours:
                t_cmd = now
        t_all = time.monotonic() if not left else None
        time.sleep(args.delay + 0.5)
        happened = effect.exists() or any(
            p.info["cmdline"] == ["sleep", _MARKER] for p in psutil.process_iter(["cmdline"]))
        for pid in left:  # survivors, so that rounds do not pile up
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in psutil.process_iter(["cmdline"]):
            if p.info["cmdline"] == ["sleep", _MARKER]:
                p.kill()
        for fd in fds.values():
            os.close(fd)
        effect.unlink(missing_ok=True)
        inf = float("inf")
        return ((t_cmd - t0) * 1000 if t_cmd else inf,
                (t_all - t0) * 1000 if t_all else inf, happened)
    finally:
        child.kill()
        child.wait()


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * len(xs)) - 1))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--isolation", default="auto")
    ap.add_argument("--cgroups", default="auto")
    ap.add_argument("--user", type=int, default=None, help="run the dispatcher as this uid")
    ap.add_argument("--delay", type=float, default=0.3, help="the side effect's delay (s)")
    ap.add_argument("--visible", default="/var/tmp", help="where the side effect writes")
    args = ap.parse_args()
    cmd_ms, all_ms, effects = [], [], 0
    for i in range(args.kills):
        tmp = Path(tempfile.mkdtemp(prefix="kill-latency-", dir=args.visible))
        tmp.chmod(0o777)
        try:
            c, a, happened = one_kill(args, tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        cmd_ms.append(c)
        all_ms.append(a)
        effects += happened
        print(f"kill {i + 1}: commands gone {c:.1f} ms, everything {a:.1f} ms"
              + (", side effect HAPPENED" if happened else ""), file=sys.stderr)
    who = f"uid {args.user}" if args.user is not None else f"uid {os.geteuid()}"
    print(f"kill -9 of the dispatcher ({args.kills} kills; isolation {args.isolation}, "
          f"cgroups {args.cgroups}, {who}):")
    print(f"  last command process gone: p50 {statistics.median(cmd_ms):.1f} ms, "
          f"p95 {_pct(cmd_ms, 95):.1f} ms, max {max(cmd_ms):.1f} ms")
    print(f"  every process it started gone: p50 {statistics.median(all_ms):.1f} ms, "
          f"p95 {_pct(all_ms, 95):.1f} ms, max {max(all_ms):.1f} ms")
    print(f"  side effect after {args.delay:g} s: {effects} of {args.kills}")
    if float("inf") in cmd_ms:
        print("  (inf: still running 5 s after the kill; they were killed then)")


if __name__ == "__main__":
    main()
