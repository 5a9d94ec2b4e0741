"""``fetch_files`` of ``/run_code`` and ``/run_jupyter`` past one command's output,
streamed in the answer as the files are read, by SandboxFusion's own client
(``sandbox-fusion``): the same JSON a whole answer would be, the same rules as a
small fetch (a missing file, a directory, a FIFO, a link out of the workspace, an
unreadable file, ``/proc``), and files past ``max_file_mb`` named in ``fetch_errors``."""

from __future__ import annotations

import base64
import time

import httpx
import pytest
import sandbox_fusion as sf
from serve_helpers import serving

from metasched.runtime.dispatch import DispatcherConfig
from metasched.serve import ServeConfig
from metasched.serve.sandbox_fusion import RunCodeResponse

CAP_MB = 3.0  # max_file_mb here: one answer's fetched files
TAIL = 64 << 10  # tail_bytes: a fetched file past about 60 KiB is read in pieces


@pytest.fixture(scope="module")
def served():
    dcfg = DispatcherConfig(scheduler="elastic_greedy", cores=[0, 1], tail_bytes=TAIL)
    with serving(dcfg, ServeConfig(languages=["python"], max_file_mb=CAP_MB)) as s:
        yield s


FETCH_CODE = """import os
open('big.bin', 'wb').write(bytes(range(256)) * 4096 + b'end')  # 1 MiB and 3 bytes
open('small.txt', 'w').write('small')
os.mkdir('d')
os.mkfifo('fifo')
os.symlink('/etc/hostname', 'out')
open('secret', 'w').write('x')
os.chmod('secret', 0)
"""
BIG = bytes(range(256)) * 4096 + b"end"


def test_run_code_fetches_files_past_one_commands_output_by_the_sandbox_fusion_client(
        served):
    sf.set_endpoint(served.url)
    paths = ["big.bin", "small.txt", "d", "fifo", "missing", "secret", "/proc/self/status"]
    r = sf.run_code(sf.RunCodeRequest(code=FETCH_CODE, language="python",
                                      fetch_files=paths))
    assert r.status == sf.RunStatus.Success, r
    assert list(r.files) == ["big.bin", "small.txt", "/proc/self/status"]
    assert base64.b64decode(r.files["big.bin"]) == BIG
    assert base64.b64decode(r.files["small.txt"]) == b"small"
    assert b"Name:" in base64.b64decode(r.files["/proc/self/status"])
    doc = httpx.post(f"{served.url}/run_code", timeout=120, json={
        "code": FETCH_CODE, "fetch_files": paths}).json()
    assert doc["fetch_errors"] == {"d": "not a regular file", "fifo": "not a regular file",
                                   "missing": "not found", "secret": "Permission denied"}


def test_a_link_out_of_the_workspace_reads_the_sandboxs_file_not_the_hosts(served):
    code = "import os\nos.symlink('/etc/shadow', 'out')\nos.symlink('/proc/1/environ', 'p')\n"
    doc = httpx.post(f"{served.url}/run_code", timeout=120, json={
        "code": code, "fetch_files": ["out", "p"]}).json()
    assert doc["files"] == {} and doc["fetch_errors"]["out"] == "not found"
    assert doc["fetch_errors"]["p"] in ("not found", "Permission denied")


def test_fetched_files_over_max_file_mb_are_named_and_the_rest_come_back(served):
    code = ("open('a.bin', 'wb').write(bytes(2 << 20))\n"
            "open('b.bin', 'wb').write(bytes(2 << 20))\n"
            "open('c.txt', 'w').write('c')\n")
    r = httpx.post(f"{served.url}/run_code", timeout=120, json={
        "code": code, "fetch_files": ["a.bin", "b.bin", "c.txt"]})
    doc = r.json()
    assert r.status_code == 200 and doc["status"] == "Success"
    assert list(doc["files"]) == ["a.bin", "c.txt"]
    assert base64.b64decode(doc["files"]["a.bin"]) == bytes(2 << 20)
    assert doc["fetch_errors"] == {"b.bin": "holds 2097152 bytes: more than fetch_files may "
                                   "bring back in one answer (3145728 bytes, max_file_mb)"}


def test_run_jupyter_fetches_a_file_past_one_commands_output(served):
    sf.set_endpoint(served.url)
    nb = sf.run_jupyter(sf.RunJupyterRequest(
        cells=["open('big.bin', 'wb').write(bytes(range(256)) * 4096 + b'end')",
               "{'files': {}}"], fetch_files=["big.bin"], total_timeout=60))
    assert nb.status == sf.RunStatus.Success
    assert base64.b64decode(nb.files["big.bin"]) == BIG
    assert nb.cells[1].display == [{"text/plain": "{'files': {}}"}]


def test_a_streamed_answer_is_the_json_a_whole_one_would_be(served):
    r = httpx.post(f"{served.url}/run_code", timeout=120, json={
        "code": "open('big.bin', 'wb').write(bytes(200000))\nprint('ok')",
        "fetch_files": ["big.bin", "nothing"]})
    assert r.headers["content-type"] == "application/json"
    whole = RunCodeResponse.model_validate_json(r.content)  # what FastAPI would write
    assert whole.files == {"big.bin": base64.b64encode(bytes(200000)).decode()}
    assert r.content == whole.model_dump_json().encode()


def test_a_client_that_leaves_a_streamed_answer_ends_its_trajectory(served):
    def open_runs() -> list[str]:  # /run_code's own trajectories still open
        return [n for n in list(served.dispatcher.trajectories.by_name) if n.startswith("run-")]

    assert open_runs() == []
    with httpx.stream("POST", f"{served.url}/run_code", timeout=120, json={
            "code": "open('big.bin', 'wb').write(bytes(2 << 20))",
            "fetch_files": ["big.bin"]}) as r:
        first = next(r.iter_raw())
        assert first.startswith(b'{"status":"Success"') and open_runs() != []
    deadline = time.monotonic() + 30  # the client is gone mid-answer
    while open_runs() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert open_runs() == []
