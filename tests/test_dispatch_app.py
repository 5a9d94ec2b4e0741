"""``metasched-dispatch``: a JSONL job file through the live dispatcher, end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import COMMAND_PY

from metasched.cli.dispatch_app import read_jobs, run_dispatch

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
    lines = [json.loads(x) for x in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert [r["id"] for r in lines] == ["line-1", "line-4", "line-5", "line-6", "line-7", "last",
                                        "line-9"]
    assert [r["status"] for r in lines] == ["done", "failed", "rejected", "rejected", "failed",
                                            "done", "rejected"]
    assert lines[6]["reason"].startswith("jobs.jsonl:9: min_cores: 999 cores asked")
    assert lines[0]["stdout"] == "a\n" and lines[1]["reason"] == "exit code 2"
    assert "jobs.jsonl:5: invalid JSON" in lines[2]["reason"]
    assert lines[3]["reason"] == "jobs.jsonl:6: timeout_s: must be > 0 (got -1)"
    assert lines[4]["reason"] == "timeout after 0.3 s"
    s = doc["schedulers"]["elastic_greedy"]
    assert s["actions"] == 4 and s["failed"] == 2 and s["rejected"] == 3
    assert doc["live"]["done"] == 2 and doc["live"]["decisions"] >= 1
    table = (tmp_path / "out" / "results.md").read_text()
    assert "| elastic_greedy | 2 | 2 | 3 |" in table and table in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "results.json").read_text())["workload"] == "jobs.jsonl"


def test_rerun_on_the_same_journal_resumes_instead_of_repeating(tmp_path):
    # Each run of a line prints a new random token: a second run would print another.
    jobs = write_jobs(tmp_path / "jobs.jsonl", [
        job(CMD_PY, "-c", "import uuid; print(uuid.uuid4())") for _ in range(3)])
    cfg = {"jobs": jobs, "scheduler": "fifo", "progress": False,
           "journal": str(tmp_path / "journal.db")}
    run_dispatch(cfg, tmp_path / "a")
    run_dispatch(cfg, tmp_path / "b")
    a, b = ([json.loads(x) for x in (tmp_path / d / "results.jsonl").read_text().splitlines()]
            for d in "ab")
    assert [r["status"] for r in b] == ["done"] * 3
    assert len({r["stdout"] for r in a}) == 3  # three runs, three tokens
    # each line ran once over both runs: the second answers from the journal
    assert [(r["stdout"], r["started_at"], r["attempts"]) for r in b] == \
        [(r["stdout"], r["started_at"], 1) for r in a]


def test_read_jobs_rejects_an_empty_file(tmp_path):
    from metasched.errors import ConfigError

    with pytest.raises(ConfigError, match="holds no requests"):
        read_jobs(write_jobs(tmp_path / "e.jsonl", ["# nothing"]))


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
def test_cli_bad_settings_are_one_line_errors(tmp_path, args, message):
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job("true")])
    args = [a.replace("JOBS", jobs) for a in args]
    p = subprocess.run([PY, "-m", "metasched.cli.dispatch_app", *args,
                        f"hydra.run.dir={tmp_path}/out"], capture_output=True, text=True,
                       cwd=tmp_path, timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith(message) and p.stderr.count("\n") == 1, p.stderr


def test_ctrl_c_kills_running_commands_and_says_how_to_resume(tmp_path):
    import signal
    import time

    from metasched.runtime.journal import Journal

    jobs = write_jobs(tmp_path / "jobs.jsonl", [job("sleep", "30") for _ in range(4)])
    out = tmp_path / "out"
    p = subprocess.Popen([PY, "-m", "metasched.cli.dispatch_app", f"jobs={jobs}",
                          "scheduler=fifo", f"hydra.run.dir={out}"], cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until a command is running
            if (out / "journal.db").exists():
                with Journal(out / "journal.db") as j:
                    pids = [pid for _, pid in j.orphans()]
                if pids:
                    break
            time.sleep(0.1)
        assert pids, "no command started"
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130
    assert "interrupted: 0 requests finished, 4 unfinished" in err
    assert f"journal={out / 'journal.db'}" in err and "Traceback" not in err
    for pid in pids:  # the running commands were killed with the dispatcher
        assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read()
