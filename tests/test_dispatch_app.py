"""``metasched-dispatch``: a JSONL job file through the live dispatcher, end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import COMMAND_PY

from metasched.cli.dispatch_app import run_dispatch
from metasched.cli.job_file import count_requests, read_jobs

PY = sys.executable  # runs the app
CMD_PY = COMMAND_PY  # what commands run: a sandbox's user can (see helpers)


def write_jobs(path, lines) -> str:
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return str(path)


def job(*argv, **kw) -> dict:
    return {"kind": "cpu", "argv": list(argv), "timeout_s": kw.pop("timeout_s", 30), **kw}


def test_job_file_runs_with_one_result_per_line_and_bad_lines_fail_alone(tmp_path, capsys):
    jobs = write_jobs(tmp_path / "jobs.jsonl", [
        job(CMD_PY, "-c", "print('a')", trajectory="t", turn=0),
        "# comment",
        "",
        job(CMD_PY, "-c", "import sys; sys.exit(2)"),
        "{not json",
        job("true", timeout_s=-1),
        job("sleep", "5", timeout_s=0.3),
        job(CMD_PY, "-c", "print('b')", trajectory="t", turn=1, reward=True, id="last"),
        job("true", min_cores=999, max_cores=999),
    ])
    doc = run_dispatch({"jobs": jobs, "scheduler": "elastic_greedy", "progress": False},
                       tmp_path / "out")
    by_id = results(tmp_path / "out")  # one result per request line, in no set order
    assert {k: r["status"] for k, r in by_id.items()} == {
        "line-1": "done", "line-4": "failed", "line-5": "rejected", "line-6": "rejected",
        "line-7": "failed", "last": "done", "line-9": "rejected"}
    assert by_id["line-9"]["reason"].startswith("jobs.jsonl:9: min_cores: 999 cores asked")
    assert by_id["line-1"]["stdout"] == "a\n" and by_id["line-4"]["reason"] == "exit code 2"
    assert "jobs.jsonl:5: invalid JSON" in by_id["line-5"]["reason"]
    assert by_id["line-6"]["reason"] == "jobs.jsonl:6: timeout_s: must be > 0 (got -1)"
    assert by_id["line-7"]["reason"] == "timeout after 0.3 s"
    s = doc["schedulers"]["elastic_greedy"]
    assert s["actions"] == 4 and s["failed"] == 2 and s["rejected"] == 3
    assert doc["live"]["done"] == 2 and doc["live"]["decisions"] >= 1
    table = (tmp_path / "out" / "results.md").read_text()
    assert "| elastic_greedy | 2 | 2 | 3 |" in table and table in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "results.json").read_text())["workload"] == "jobs.jsonl"


def results(run_dir) -> dict[str, dict]:
    """results.jsonl of a run by id (it is written in the order results come)."""
    lines = [json.loads(x) for x in (run_dir / "results.jsonl").read_text().splitlines()]
    by_id = {r["id"]: r for r in lines}
    assert len(by_id) == len(lines)  # one result per id
    return by_id


def test_rerun_on_the_same_journal_resumes_instead_of_repeating(tmp_path):
    # Each run of a line prints a new random token: a second run would print another.
    jobs = write_jobs(tmp_path / "jobs.jsonl", [
        job(CMD_PY, "-c", "import uuid; print(uuid.uuid4())") for _ in range(3)])
    cfg = {"jobs": jobs, "scheduler": "fifo", "progress": False,
           "journal": str(tmp_path / "journal.db")}
    run_dispatch(cfg, tmp_path / "a")
    run_dispatch(cfg, tmp_path / "b")
    a, b = results(tmp_path / "a"), results(tmp_path / "b")
    assert [r["status"] for r in b.values()] == ["done"] * 3
    assert len({r["stdout"] for r in a.values()}) == 3  # three runs, three tokens
    # each line ran once over both runs: the second answers from the journal
    assert {k: (r["stdout"], r["started_at"], r["attempts"]) for k, r in b.items()} == \
        {k: (r["stdout"], r["started_at"], 1) for k, r in a.items()}


def test_an_empty_job_file_is_an_error(tmp_path):
    from metasched.errors import ConfigError

    with pytest.raises(ConfigError, match="holds no requests"):
        count_requests(write_jobs(tmp_path / "e.jsonl", ["# nothing", ""]))


@pytest.mark.parametrize("args, message", [
    ([], "error: jobs: give the JSONL job file"),
    (["jobs=/nonexistent.jsonl"], "error: jobs: cannot read /nonexistent.jsonl"),
    (["jobs=JOBS", "scheduler=bogus"], "error: scheduler: unknown scheduler 'bogus'"),
    (["jobs=JOBS", "cores=[999]"], "error: cores: [999] are not usable here"),
    (["jobs=JOBS", "max_wait_s=-3"], "error: max_wait_s: must be a number > 0"),
    (["jobs=JOBS", "+endpoints={e: {rpm: -1, max_concurrency: 1}}"],
     "error: endpoints.e.rpm: must be > 0"),
    (["jobs=JOBS", "+services.x=nomodule:f"], "error: services.x: nomodule:f failed"),
])
@pytest.mark.subprocess
def test_cli_bad_settings_are_one_line_errors(tmp_path, args, message):
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job("true")])
    args = [a.replace("JOBS", jobs) for a in args]
    p = subprocess.run([PY, "-m", "metasched.cli.dispatch_app", *args,
                        f"hydra.run.dir={tmp_path}/out"], capture_output=True, text=True,
                       cwd=tmp_path, timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith(message) and p.stderr.count("\n") == 1, p.stderr


def _as_from_a_terminal() -> None:
    """SIGINT at its default, as a shell started from a terminal leaves it. A suite run in
    the background of a non-interactive shell (``make test &``, CI runners) passes SIGINT
    on ignored, and Python then keeps ignoring it instead of raising KeyboardInterrupt."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_dispatch(tmp_path, jobs, *args, finished: int = 0):
    """A real ``metasched-dispatch`` process, returned once a command of it runs (and
    ``finished`` requests have finished), with the pids of its running commands."""
    import time

    from metasched.runtime.journal import Journal

    out = tmp_path / "out"
    p = subprocess.Popen([PY, "-m", "metasched.cli.dispatch_app", f"jobs={jobs}",
                          "scheduler=fifo", f"hydra.run.dir={out}", *args], cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=_as_from_a_terminal)
    pids: list[int] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and p.poll() is None:  # until a command is running
        if (out / "journal.db").exists():
            with Journal(out / "journal.db", lock=False) as j:
                pids = [pid for _, pid in j.orphans()]
                done = j.counts()["finished"]
            if pids and done >= finished:
                break
        time.sleep(0.1)
    assert pids, f"no command started: {p.communicate(timeout=5)}"
    return p, pids


@pytest.mark.subprocess
@pytest.mark.parametrize("sig, status", [("SIGINT", 130), ("SIGTERM", 143), ("SIGHUP", 129)])
def test_a_stop_signal_kills_running_commands_and_says_how_to_resume(tmp_path, visible_dir,
                                                                     sig, status):
    """Ctrl-C, and what service managers and terminals send: the running commands are
    killed, what is left stays in the journal, one message says how to resume, exit
    status 128 + the signal; resuming finishes the rest without repeating the finished."""
    import signal

    from metasched.runtime.journal import Journal

    # Commands run in sandboxes: the gate lies where they can see it (a system path of
    # theirs), and the quick one shows each run by a new token (they cannot write here).
    gate = visible_dir / "gate"
    seen = f"sandbox.system_paths=[{visible_dir}]"
    quick = job(CMD_PY, "-c", "import uuid; print(uuid.uuid4())", id="quick")
    slow = [job("/bin/sh", "-c", 'test -e "$0" || sleep 30', str(gate), id=f"s{i}")
            for i in range(4)]
    jobs = write_jobs(tmp_path / "jobs.jsonl", [quick] + slow)
    p, pids = start_dispatch(tmp_path, jobs, seen, finished=1)
    try:
        p.send_signal(getattr(signal, sig))
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    db = tmp_path / "out" / "journal.db"
    assert p.returncode == status, err
    assert f"interrupted ({sig}): 1 requests finished, 4 unfinished" in err
    assert f"journal={db}" in err and "Traceback" not in err
    for pid in pids:  # the running commands were killed with the dispatcher
        assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read()
    first = results(tmp_path / "out")
    assert [r["status"] for r in first.values()] == ["done"]  # kept
    gate.write_text("")  # the re-run commands end at once
    # Resumed with the file edited: lines 2 and 3 now ask for something else under the
    # same ids, and are rejected rather than answered with the stored requests' results.
    edited = write_jobs(tmp_path / "jobs.jsonl",
                        [quick, job("true", id="s0"), job("false", id="s1"), *slow[2:]])
    run_dispatch({"jobs": edited, "scheduler": "fifo", "progress": False,
                  "journal": str(db), "sandbox": {"system_paths": [str(visible_dir)]}},
                 tmp_path / "resumed")
    again = results(tmp_path / "resumed")
    assert again["quick"]["status"] == "done"
    assert again["quick"]["stdout"] == first["quick"]["stdout"]  # not re-run
    assert [again[f"s{i}"]["status"] for i in range(4)] == ["rejected"] * 2 + ["done"] * 2
    assert again["s0"]["reason"] == ("jobs.jsonl:2: id: 's0' was accepted before with a "
                                     "different request; give this one another id (or, to "
                                     "start over, use a new journal)")
    with Journal(db) as j:  # what was accepted before ran, as accepted
        assert j.counts() == {"queued": 0, "running": 0, "finished": 5}


def test_duplicate_ids_and_bad_bytes_fail_alone_and_the_run_goes_on(tmp_path):
    path = tmp_path / "jobs.jsonl"
    path.write_bytes(b"\n".join([
        json.dumps(job("true", id="a")).encode(),
        json.dumps(job("echo", "again", id="a")).encode(),  # a second line with id a
        b'{"kind": "cpu", "argv": ["echo", "caf\xe9"], "timeout_s": 5}',  # Latin-1, not UTF-8
        json.dumps(job("echo", "fine")).encode(),
        json.dumps(job("echo", "clash", id="line-4")).encode(),  # line 4's id, given
    ]) + b"\n")
    run_dispatch({"jobs": str(path), "scheduler": "fifo", "progress": False},
                 tmp_path / "out")
    out = [json.loads(x) for x in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert len(out) == 5  # one result per line: the repeated ids are the lines rejected
    done = {r["id"]: r for r in out if r["status"] == "done"}
    assert sorted(done) == ["a", "line-4"] and done["line-4"]["stdout"] == "fine\n"
    assert sorted(r["reason"] for r in out if r["status"] == "rejected") == [
        "jobs.jsonl:2: id: 'a' is already the id of line 1 (give each line its own id)",
        "jobs.jsonl:3: not valid UTF-8 (byte 0xe9 at column 38)",
        "jobs.jsonl:5: id: 'line-4' is already the id of line 4 (give each line its own id)",
    ]
    assert (tmp_path / "out" / "results.md").exists()


def test_no_more_than_read_ahead_requests_are_accepted_and_unfinished(tmp_path):
    """Backpressure, from the journal's own times: at any instant at most ``read_ahead``
    requests had been accepted and not yet finished, however long the file."""
    from metasched.runtime.journal import Journal

    jobs = write_jobs(tmp_path / "jobs.jsonl",
                      [job("sleep", "0.05") for _ in range(40)])
    run_dispatch({"jobs": jobs, "scheduler": "fifo", "progress": False, "read_ahead": 4},
                 tmp_path / "out")
    with Journal(tmp_path / "out" / "journal.db") as j:
        rows = j._db.execute("SELECT accepted_at, finished_at FROM requests").fetchall()
    assert len(rows) == 40
    events = sorted([(t0, 1) for t0, _ in rows] + [(t1, -1) for _, t1 in rows],
                    key=lambda e: (e[0], e[1]))  # a finish before an accept at a tie
    open_, peak = 0, 0
    for _, step in events:
        open_ += step
        peak = max(peak, open_)
    assert peak <= 4


@pytest.mark.parametrize("lines, rejected", [
    # a given id, then a line whose line-<n> it is: the later line is rejected
    ([{"id": "line-3"}, {}, {}], {3: "is already the id of line 1"}),
    # a line-<n>, then a line giving that id
    ([{}, {"id": "line-1"}, {"id": "line-9"}], {2: "is already the id of line 1"}),
    ([{"id": "x"}, {"id": "y"}, {"id": "x"}], {3: "is already the id of line 1"}),
    ([{"id": "line-01"}, {}], {}),  # not line 1's id: "line-1" is
])
def test_ids_given_and_made_cannot_clash(tmp_path, lines, rejected):
    path = write_jobs(tmp_path / "jobs.jsonl", [{**job("true"), **extra} for extra in lines])
    out = {n: r for n, r in read_jobs(path)}
    assert {n: r.reason.split(": ", 1)[1] for n, r in out.items()
            if not hasattr(r, "argv")} == {n: f"id: {out[n].id!r} {why} (give each line its "
                                               f"own id)" for n, why in rejected.items()}


def test_job_lines_are_read_as_a_stream(tmp_path):
    """The reader holds one line at a time: a line is parsed only when it is asked for
    (a file that grows after the first line is read shows it)."""
    path = tmp_path / "jobs.jsonl"
    path.write_text(json.dumps(job("true")) + "\n")
    lines = read_jobs(path)
    first = next(lines)
    with open(path, "a") as f:  # appended after the first line was read
        f.write(json.dumps(job("false")) + "\n")
    second = next(lines)
    assert first[0] == 1 and second[0] == 2 and second[1].argv == ("false",)
    assert next(lines, None) is None


@pytest.mark.parametrize("setup, args, message", [
    ("", ["workdir=/nonexistent"],
     "error: workdir: /nonexistent: cannot make scratch directories there (no such "
     "directory)"),
    ("empty", ["journal=JOURNAL"], "error: journal: JOURNAL: empty (0 bytes): not a journal"),
    ("text", ["journal=JOURNAL"], "error: journal: JOURNAL: not an SQLite file"),
    ("", ["fsync=maybe"], "error: fsync: must be true or false (got 'maybe')"),
    ("", ["compact=-1"], "error: compact: must be a number of seconds >= 0 or null"),
    ("", ["read_ahead=0"], "error: read_ahead: must be a whole number in [1, 1000000]"),
    ("", ["gpu_standin=100000"], "error: gpu_standin: must be a whole number in [0, 64]"),
    ("", ["+scheduler_params.headroom=2", "scheduler=elastic_greedy"],
     "error: scheduler_params: elastic_greedy: "),
])
@pytest.mark.subprocess
def test_unusable_settings_stop_before_any_job_runs(tmp_path, setup, args, message):
    marker = tmp_path / "ran"
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job("touch", str(marker))])
    journal = tmp_path / "j.db"
    if setup == "empty":
        journal.touch()
    elif setup == "text":
        journal.write_text("hello\n")
    args = [a.replace("JOURNAL", str(journal)) for a in args]
    p = subprocess.run([PY, "-m", "metasched.cli.dispatch_app", f"jobs={jobs}", *args,
                        f"hydra.run.dir={tmp_path}/out"], capture_output=True, text=True,
                       cwd=tmp_path, timeout=120)
    message = message.replace("JOURNAL", str(journal))
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith(message) and p.stderr.count("\n") == 1, p.stderr
    assert not marker.exists()  # nothing ran (were it sandboxed, it could not write it:
    out = tmp_path / "out" / "results.jsonl"  # nor is there a result)
    assert not out.exists() or out.read_text() == ""
    if setup:
        assert journal.read_bytes() == (b"" if setup == "empty" else b"hello\n")  # untouched


@pytest.mark.subprocess
def test_a_second_dispatch_on_a_live_journal_is_refused(tmp_path):
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job("sleep", "30")])
    first, pids = start_dispatch(tmp_path, jobs)
    try:
        db = tmp_path / "out" / "journal.db"
        p = subprocess.run([PY, "-m", "metasched.cli.dispatch_app", f"jobs={jobs}",
                            f"journal={db}", f"hydra.run.dir={tmp_path}/second"],
                           capture_output=True, text=True, cwd=tmp_path, timeout=120)
        assert p.returncode == 2
        assert p.stderr == (f"error: journal: {db} is in use by another dispatcher (pid "
                            f"{first.pid}); stop it first, or choose another journal\n")
        assert all(os.path.exists(f"/proc/{pid}") for pid in pids)  # left alone
        assert first.poll() is None
    finally:
        first.kill()
        first.communicate(timeout=30)
    for pid in pids:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
