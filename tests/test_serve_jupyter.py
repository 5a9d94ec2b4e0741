"""``POST /run_jupyter`` and SandboxFusion's own PyPI client (``sandbox-fusion``):
its ``run_code``, ``run_concurrent`` and ``run_jupyter`` against the service on
127.0.0.1, and a trajectory's kernel, kept across requests and ended with it (looked
for in this machine's process table)."""

from __future__ import annotations

import base64
import os
import time
from pathlib import Path

import httpx
import pytest
import sandbox_fusion as sf
from serve_helpers import serving

from metasched.runtime.dispatch import DispatcherConfig
from metasched.serve import ServeConfig


@pytest.fixture(scope="module")
def served():
    dcfg = DispatcherConfig(scheduler="elastic_greedy", cores=[0, 1], tail_bytes=64 << 10)
    with serving(dcfg, ServeConfig(languages=["python"])) as s:
        yield s


def kernels() -> list[int]:
    """The pids of kernels alive now (their driver in their argv)."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                argv = Path(entry.path, "cmdline").read_bytes()
                state = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if b".metasched/kernel.py" in argv and state != "Z":
                pids.append(int(entry.name))
    return pids


def jupyter(url: str, **body) -> dict:
    r = httpx.post(f"{url}/run_jupyter", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_the_sandbox_fusion_client_runs_code_concurrently_and_notebooks(served):
    sf.set_endpoint(served.url)
    r = sf.run_code(sf.RunCodeRequest(code="print(6 * 7)", language="python"))
    assert r.status == sf.RunStatus.Success and r.run_result.stdout == "42\n"
    many = sf.run_concurrent(sf.run_code, kwargs=[
        {"request": sf.RunCodeRequest(code=f"print({i} ** 2)", language="python")}
        for i in range(8)], concurrency=8)
    assert [x.run_result.stdout for x in many] == [f"{i ** 2}\n" for i in range(8)]
    nb = sf.run_jupyter(sf.RunJupyterRequest(
        cells=["a = 123", "a", "print(open('in.txt').read())",
               "import sys; sys.stderr.write('e\\n')", "raise RuntimeError('boom')",
               "open('out.txt', 'w').write(str(a * 2))"],
        files={"in.txt": base64.b64encode(b"from a file").decode()},
        fetch_files=["out.txt"], total_timeout=60))
    assert nb.status == sf.RunStatus.Success and nb.driver.status == "Finished"
    cells = nb.cells
    assert cells[1].display == [{"text/plain": "123"}]
    assert cells[2].stdout == "from a file\n" and cells[3].stderr == "e\n"
    assert cells[4].error[0]["ename"] == "RuntimeError" and cells[4].error[0]["evalue"] == "boom"
    assert "RuntimeError: boom" in cells[4].error[0]["traceback"][-1]
    assert base64.b64decode(nb.files["out.txt"]) == b"246"
    assert not kernels()  # a notebook without a trajectory: its kernel ended with it


def test_a_trajectory_keeps_its_kernel_until_it_closes(served):
    first = jupyter(served.url, cells=["x = 20", "def f(y):\n    return x + y"],
                    trajectory="nb-1")
    assert first["status"] == "Success" and len(kernels()) == 1
    again = jupyter(served.url, cells=["f(22)"], trajectory="nb-1")
    assert again["cells"][0]["display"] == [{"text/plain": "42"}]
    other = jupyter(served.url, cells=["'x' in globals()"], trajectory="nb-2")
    assert other["cells"][0]["display"] == [{"text/plain": "False"}] and len(kernels()) == 2
    last = jupyter(served.url, cells=["x = 1"], trajectory="nb-2", reward=True)
    assert last["status"] == "Success"  # its reward: the trajectory closes once answered
    httpx.post(f"{served.url}/v1/trajectories/nb-1/close").raise_for_status()
    deadline = time.monotonic() + 5
    while kernels():
        assert time.monotonic() < deadline, "a kernel outlived its trajectory"
        time.sleep(0.05)
    fresh = jupyter(served.url, cells=["'x' in globals()"], trajectory="nb-1")
    assert fresh["cells"][0]["display"] == [{"text/plain": "False"}]


@pytest.mark.parametrize(("body", "timed_out"), [
    ({"cell_timeout": 1}, 1), ({"total_timeout": 1.5}, 1)])
def test_a_cell_past_its_time_stops_the_run_and_the_kernel_lives_on(served, body, timed_out):
    name = f"nb-t-{timed_out}-{len(body)}-{next(iter(body))}"
    doc = jupyter(served.url, cells=["n = 1", "import time; time.sleep(30)", "n"],
                  trajectory=name, **body)
    assert doc["status"] == "Failed" and doc["driver"]["status"] == "TimeLimitExceeded"
    assert len(doc["cells"]) == 2 and doc["cells"][1]["error"][0]["ename"] == "TimeoutError"
    assert doc["driver"]["execution_time"] < 5
    later = jupyter(served.url, cells=["n + 1"], trajectory=name)
    assert later["cells"][0]["display"] == [{"text/plain": "2"}]
    httpx.post(f"{served.url}/v1/trajectories/{name}/close").raise_for_status()


def test_each_cell_is_an_action_of_its_trajectory(served):
    before = served.dispatcher.stats()["done"]
    doc = jupyter(served.url, cells=["1", "2", "3"], trajectory="nb-count")
    assert [c["display"] for c in doc["cells"]] == [[{"text/plain": str(i)}] for i in (1, 2, 3)]
    assert served.dispatcher.stats()["done"] - before == 4  # the driver written, 3 cells
    httpx.post(f"{served.url}/v1/trajectories/nb-count/close").raise_for_status()


@pytest.mark.parametrize(("body", "message"), [
    ({"cells": "print(1)"}, "cells: must be a list (got 'print(1)')"),
    ({"cells": [], "total_timeout": 0}, "total_timeout: must be > 0 (got 0)"),
    ({"cells": [], "kernel": "julia"}, "kernel: must be one of python3 (got 'julia')"),
])
def test_bad_requests_are_one_line(served, body, message):
    r = httpx.post(f"{served.url}/run_jupyter", json=body, timeout=30)
    assert r.status_code == 422 and r.json()["detail"] == message, r.text
