"""``metasched-serve`` as a command: bad settings are one line and exit status 2 before
anything listens; a good one serves until SIGTERM, then exits 128 + 15."""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import httpx
import pytest
from helpers import free_port
from serve_helpers import wait_for_ping

pytestmark = pytest.mark.subprocess

PY = sys.executable


def _serve(tmp_path, *args: str) -> list[str]:
    """The command line; no /run_code languages unless asked (probing takes seconds)."""
    if not any(a.startswith("languages=") for a in args):
        args = (*args, "languages=[]")
    return [PY, "-m", "metasched.cli.serve_app", *args, f"hydra.run.dir={tmp_path}/out"]


def test_help_names_every_front_door():
    """--help names each front door the application answers at: the first part of every
    route's path (/run_code, /run_jupyter, /e2b, /v1 and its quota proxy, /metrics)."""
    from metasched.serve.app import create_app
    from metasched.serve.route_table import routes

    text = subprocess.run([PY, "-m", "metasched.cli.serve_app", "--help"],
                          capture_output=True, text=True, timeout=60, check=True).stdout
    doors = {"/" + r.path.split("/")[1] for r in routes(create_app(lambda: None, owns=False))}
    assert {"/run_code", "/run_jupyter", "/e2b", "/v1", "/metrics"} <= doors
    for door in doors:
        assert re.search(rf"{door}\b", text), f"--help does not name {door}"
    assert "/v1/endpoints/" in text  # the quota proxy


@pytest.mark.parametrize("args, message", [
    (["host=0.0.0.0"], "error: token: listening on 0.0.0.0 needs a token"),
    (["languages=[cobol]"], "error: languages: unknown language 'cobol'"),
    (["+endpoints={s: {rpm: 60, max_concurrency: 1, url: 'ftp://x'}}"],
     "error: endpoints.s.url: must start with http:// or https://"),
    (["sandbox.isolation=maybe"], "error: sandbox.isolation: must be one of"),
])
def test_bad_settings_are_one_line_errors(tmp_path, args, message):
    p = subprocess.run(_serve(tmp_path, *args), capture_output=True, text=True, cwd=tmp_path,
                       timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith(message) and p.stderr.count("\n") == 1, p.stderr


def test_serves_until_sigterm(tmp_path):
    port = free_port()
    p = subprocess.Popen(_serve(tmp_path, f"port={port}", "languages=[python]",
                                "scheduler=elastic_greedy"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=tmp_path)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_ping(url, p)
        doc = httpx.post(f"{url}/run_code", json={"code": "print(6 * 7)"}, timeout=60).json()
        assert doc["status"] == "Success" and doc["run_result"]["stdout"] == "42\n"
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
