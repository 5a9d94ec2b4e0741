"""Process lifetime: a dispatcher's commands die with it, at once, whatever kills it
(kill -9 included), so a command cannot finish a side effect after its dispatcher is
gone (and then have it done again when the journal replays the command); and a stop
signal during start-up ends the app with the clean "interrupted" exit, never with a
lock the app itself still holds."""

from __future__ import annotations

import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from sandbox_helpers import isolation_missing

from metasched.runtime.journal import Journal
from metasched.runtime.sandbox import cgroups

pytestmark = pytest.mark.subprocess

PY = sys.executable
ROOT = str(Path(__file__).resolve().parents[1])
GONE_WITHIN_S = 1.0  # generous: the measured p95 is a few ms (benchmarks/kill_latency.py)
DELAY_S = 0.4  # what the attacking command waits before its side effect

# A process running a real Dispatcher with a journal: it accepts the requests, says so,
# and runs them until it is killed (the benchmark's, so both kill the same dispatcher).
_BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "kill_latency.py"
_spec = importlib.util.spec_from_file_location("kill_latency", _BENCH)
_kill_latency = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_kill_latency)
CHILD = _kill_latency.CHILD


def _modes() -> list:
    """(isolation, cgroups, user) for every mode this machine has: bwrap, and commands
    on the host started by the sandbox server (root, with cgroups) or by the dispatcher
    itself (cgroups none; an unprivileged dispatcher, whose commands are only process
    groups)."""
    h = cgroups.discover("auto")
    have = {"v1": bool(h.v1), "v2": h.v2 is not None}
    out = []
    for isolation in ("bwrap", "none"):
        for mode in ("v1", "v2", "none"):
            why = None
            if mode != "none" and not have[mode]:
                why = f"no writable cgroup {mode} here"
            elif isolation == "bwrap" and isolation_missing():
                why = isolation_missing()
            marks = [pytest.mark.skipif(why is not None, reason=str(why))]
            if isolation == "bwrap":
                marks.append(pytest.mark.isolation)
            out.append(pytest.param(isolation, mode, None, id=f"{isolation}-cgroups-{mode}",
                                    marks=marks))
    out.append(pytest.param("none", "none", 65534, id="unprivileged-process-groups",
                            marks=[pytest.mark.skipif(os.geteuid() != 0,
                                                      reason="needs root to switch users")]))
    return out


def _requests(effect: str) -> list[dict]:
    """A sleeper, and a command whose background subshells (one of them in a session of
    its own) write ``effect`` after DELAY_S, then exec a marker sleep."""
    later = f"sleep {DELAY_S}; echo done > {effect}; exec sleep 61.25"
    script = f"({later}) & setsid sh -c '{later}' & sleep 600; wait"
    return [{"id": "sleeper", "kind": "cpu", "timeout_s": 900, "argv": ["sleep", "600"]},
            {"id": "attack", "kind": "cpu", "timeout_s": 900, "argv": ["/bin/sh", "-c", script]}]


def _commands(db: Path, timeout_s: float = 60.0) -> list[psutil.Process]:
    """Every process of the two commands, once all run (the leaders the journal records,
    and their descendants)."""
    deadline = time.monotonic() + timeout_s
    with Journal(db, lock=False) as j:
        while time.monotonic() < deadline:
            procs = []
            for _, pid in j.orphans():
                try:
                    p = psutil.Process(pid)
                    procs += [p, *p.children(recursive=True)]
                except psutil.NoSuchProcess:
                    pass
            try:
                lines = [" ".join(p.cmdline()) for p in procs]
            except psutil.Error:
                continue
            if lines.count("sleep 600") == 2 and lines.count(f"sleep {DELAY_S}") == 2:
                return procs
            time.sleep(0.01)
    raise AssertionError("the commands did not start")


def _markers() -> list[int]:
    return [p.pid for p in psutil.process_iter(["cmdline"])
            if p.info["cmdline"] == ["sleep", "61.25"]]


@pytest.mark.parametrize("isolation, mode, user", _modes())
def test_kill_9_of_the_dispatcher_takes_every_command_at_once(tmp_path, visible_dir,
                                                             isolation, mode, user):
    """kill -9 of a process running a real Dispatcher: every process of its commands is
    gone well within GONE_WITHIN_S, and the attacking command's delayed side effect
    (a file written, a process started) never happens."""
    work = visible_dir / "work"
    work.mkdir()
    work.chmod(0o777)
    db, effect = work / "journal.db", visible_dir / "effect"
    (work / "requests.json").write_text(json.dumps(_requests(str(effect))))
    argv = [PY, "-c", CHILD, str(db), str(work), isolation, mode, str(work / "requests.json")]
    if user is not None:
        argv = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *argv]
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": ROOT})
    left: list[int] = []
    try:
        assert child.stdout.readline().split() == ["accepted"]
        procs = _commands(db)
        fds = {os.pidfd_open(p.pid): p.pid for p in procs}
        poll = select.poll()
        for fd in fds:
            poll.register(fd, select.POLLIN)
        waiting = set(fds)
        t0 = time.monotonic()
        child.send_signal(signal.SIGKILL)
        while waiting and time.monotonic() - t0 < GONE_WITHIN_S:
            for fd, _ in poll.poll(10):
                poll.unregister(fd)
                waiting.discard(fd)
        took = time.monotonic() - t0
        left = [fds[fd] for fd in waiting]
        for fd in fds:
            os.close(fd)
        time.sleep(DELAY_S + 0.5)  # when the side effect would have happened
        markers = _markers()
        assert not left, f"{len(left)} command processes outlived the dispatcher by {took:.2f} s"
        assert not effect.exists(), "the command's side effect happened after the kill"
        assert not markers, "the command started a process after the kill"
    finally:
        child.kill()
        child.wait()
        for pid in left + _markers():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _stop_during_start_up(tmp_path: Path, delay_s: float) -> subprocess.CompletedProcess:
    """``metasched-dispatch`` sent SIGTERM ``delay_s`` after it took its journal's lock
    (its dispatcher is then being made or started)."""
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text(json.dumps({"kind": "cpu", "argv": ["sleep", "30"], "timeout_s": 60}) + "\n")
    out = tmp_path / f"out-{delay_s}"
    lock = out / "journal.db.lock"
    p = subprocess.Popen([PY, "-m", "metasched.cli.dispatch_app", f"jobs={jobs}",
                          "scheduler=fifo", "progress=false", f"hydra.run.dir={out}"],
                         cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env={**os.environ, "PYTHONPATH": ROOT,
                                         "METASCHED_CONFIG_DIR": f"{ROOT}/configs"})
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and p.poll() is None:
            try:
                if lock.read_text().strip() == str(p.pid):
                    break
            except FileNotFoundError:
                pass
            time.sleep(0.001)
        time.sleep(delay_s)
        p.send_signal(signal.SIGTERM)
        stdout, stderr = p.communicate(timeout=60)
    finally:
        p.kill()
        p.wait()
    return subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)


@pytest.mark.parametrize("delay_s", [0.0, 0.005, 0.02, 0.05, 0.1, 0.2])
def test_sigterm_during_start_up_is_a_clean_interruption(tmp_path, delay_s):
    """SIGTERM while the dispatcher is being made or started: exit 143 with the
    "interrupted" line, never the journal-in-use error naming the app's own pid."""
    ran = _stop_during_start_up(tmp_path, delay_s)
    assert "in use by another dispatcher" not in ran.stderr, ran.stderr
    assert ran.returncode == 143, ran.stderr
    assert "interrupted (SIGTERM)" in ran.stderr and "Traceback" not in ran.stderr
