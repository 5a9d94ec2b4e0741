"""``POST /run_code`` against SandboxFusion's contract, driven as its clients drive it:
verl's code reward posts a JSON string with every field (``files: {}``, ``stdin`` null
or text, ``memory_limit_MB``) and reads ``status``, ``compile_result`` and
``run_result`` (``status``, ``return_code``, ``stdout``, ``stderr``,
``execution_time``); SkyRL-agent posts ``{language, code, stdin, run_timeout}`` and reads
``status`` and ``run_result.stdout``/``stderr``. Commands run in the dispatcher's
sandboxes, on this machine's cores."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import shutil
import uuid

import httpx
import pytest
from serve_helpers import serving

from metasched.runtime.dispatch import DispatcherConfig
from metasched.serve import ServeConfig
from metasched.serve.files import PER_COMMAND, PIECE, write_argvs

LANGS = ["python", "bash"] + (["cpp"] if shutil.which("g++") else [])
needs_cpp = pytest.mark.skipif("cpp" not in LANGS, reason="g++ is not installed")


@pytest.fixture(scope="module")
def served():
    # Results keep 4 MiB of a command's output: the fetched files come back through it.
    dcfg = DispatcherConfig(scheduler="elastic_greedy", tail_bytes=4 << 20)
    with serving(dcfg, ServeConfig(languages=LANGS)) as s:
        yield s


def verl(url: str, code: str, *, language: str = "python", stdin: str | None = None,
         timeout: int = 10, memory_limit_mb: int = 1024) -> dict:
    """verl's call: the body as a JSON string, every field given, 200 expected."""
    payload = json.dumps({"compile_timeout": timeout, "run_timeout": timeout, "code": code,
                          "stdin": stdin, "memory_limit_MB": memory_limit_mb,
                          "language": language, "files": {}, "fetch_files": []})
    r = httpx.post(f"{url}/run_code", content=payload, timeout=2 * timeout + 60,
                   headers={"Content-Type": "application/json", "Accept": "application/json"})
    assert r.status_code == 200, r.text
    return r.json()


def post(url: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{url}/run_code", json=body, timeout=120, **kw)


def test_correct_output_with_stdin(served):
    doc = verl(served.url, "a, b = map(int, input().split())\nprint(a + b)\n", stdin="2 40\n")
    assert doc["status"] == "Success" and doc["compile_result"] is None
    run = doc["run_result"]
    assert (run["status"], run["return_code"], run["stdout"]) == ("Finished", 0, "42\n")
    assert 0 < run["execution_time"] < 10 and run["stderr"] == ""


def test_wrong_output_is_a_success_whose_stdout_differs(served):
    expected = "10"  # what the task wanted; the program computes 5 * 3
    doc = verl(served.url, "print(int(input()) * 3)\n", stdin="5")
    assert doc["status"] == "Success" and doc["run_result"]["return_code"] == 0
    got = doc["run_result"]["stdout"].rstrip("\n")
    assert got == "15" and got != expected  # verl scores it a wrong answer


def test_runtime_error_is_failed_with_its_exit_status_and_traceback(served):
    doc = verl(served.url, "print('before')\nraise ValueError('bad input')\n")
    assert doc["status"] == "Failed"
    run = doc["run_result"]
    assert (run["status"], run["return_code"], run["stdout"]) == ("Finished", 1, "before\n")
    assert "ValueError: bad input" in run["stderr"]


def test_time_limit_is_failed_time_limit_exceeded(served):
    doc = verl(served.url, "while True:\n    pass\n", timeout=1)
    assert doc["status"] == "Failed"
    run = doc["run_result"]
    assert run["status"] == "TimeLimitExceeded" and run["return_code"] is None
    assert 0.9 < run["execution_time"] < 5


@needs_cpp
def test_cpp_compiles_then_runs(served):
    code = ("#include <iostream>\nint main() { long a, b; std::cin >> a >> b; "
            "std::cout << a * b << std::endl; return 0; }\n")
    doc = verl(served.url, code, language="cpp", stdin="6 7", timeout=60)
    assert doc["status"] == "Success"
    assert (doc["compile_result"]["status"], doc["compile_result"]["return_code"]) == (
        "Finished", 0)
    assert doc["run_result"]["stdout"] == "42\n"


@needs_cpp
def test_cpp_compile_error_is_failed_without_a_run(served):
    doc = verl(served.url, "int main() { return undeclared; }\n", language="cpp", timeout=60)
    assert doc["status"] == "Failed" and doc["run_result"] is None
    comp = doc["compile_result"]
    assert comp["status"] == "Finished" and comp["return_code"] != 0
    assert "undeclared" in comp["stderr"]


def test_bash(served):
    doc = verl(served.url, 'read x; echo "got $x"; exit 3\n', language="bash", stdin="it\n")
    assert doc["status"] == "Failed"
    assert (doc["run_result"]["stdout"], doc["run_result"]["return_code"]) == ("got it\n", 3)


def test_skyrl_shaped_request(served):
    r = post(served.url, {"language": "python", "code": "import sys\nprint(sys.stdin.read()[::-1])",
                          "stdin": "abc", "run_timeout": 10})
    assert r.status_code == 200
    doc = r.json()
    assert doc["status"] == "Success" and doc["run_result"]["stdout"] == "cba\n"


def test_files_in_and_out(served):
    data = bytes(range(256)) * 4
    code = ("import os\n"
            "raw = open('data/in.bin', 'rb').read()\n"
            "os.makedirs('out', exist_ok=True)\n"
            "open('out/rev.bin', 'wb').write(raw[::-1])\n"
            "print(len(raw), open('notes.txt').read())\n")
    r = post(served.url, {"code": code, "files": {
        "data/in.bin": base64.b64encode(data).decode(),
        "notes.txt": base64.b64encode(b"hello").decode(), "ignored.txt": None},
        "fetch_files": ["out/rev.bin", "data/in.bin", "not-there.txt"]})
    doc = r.json()
    assert doc["status"] == "Success", doc
    assert doc["run_result"]["stdout"] == "1024 hello\n"
    assert set(doc["files"]) == {"out/rev.bin", "data/in.bin"}  # a missing file is left out
    assert base64.b64decode(doc["files"]["out/rev.bin"]) == data[::-1]
    assert base64.b64decode(doc["files"]["data/in.bin"]) == data


def test_files_are_fetched_after_a_failed_run(served):
    code = "open('log.txt', 'w').write('partial')\nraise SystemExit(2)\n"
    doc = post(served.url, {"code": code, "fetch_files": ["log.txt"]}).json()
    assert doc["status"] == "Failed" and doc["run_result"]["return_code"] == 2
    assert base64.b64decode(doc["files"]["log.txt"]) == b"partial"


def test_a_file_larger_than_one_command_line(served):
    data = hashlib.sha256(b"seed").digest() * (PER_COMMAND // 16)  # 2 MiB
    assert len(base64.b64encode(data)) > 2 * PER_COMMAND  # it takes three writing commands
    code = ("import hashlib\nprint(hashlib.sha256(open('big.bin', 'rb').read()).hexdigest())\n")
    doc = post(served.url, {"code": code, "files": {
        "big.bin": base64.b64encode(data).decode()}}).json()
    assert doc["status"] == "Success", doc
    assert doc["run_result"]["stdout"] == hashlib.sha256(data).hexdigest() + "\n"


def test_a_named_trajectory_keeps_its_workspace_across_requests(served):
    headers = {"X-Trajectory-Id": "traj-files", "X-Turn": "0"}
    doc = post(served.url, {"code": "open('state.txt', 'w').write('turn 0')"},
               headers=headers).json()
    assert doc["status"] == "Success"
    doc = post(served.url, {"code": "print(open('state.txt').read())"},
               headers={**headers, "X-Turn": "1"}).json()
    assert doc["run_result"]["stdout"] == "turn 0\n"
    # Without a trajectory, each request starts from an empty workspace.
    doc = post(served.url, {"code": "import os\nprint(os.path.exists('state.txt'))"}).json()
    assert doc["run_result"]["stdout"] == "False\n"


@pytest.mark.parametrize("headers, body, prompt", [
    ({"X-Prompt-Id": "p-5"}, {}, "p-5"),
    ({}, {"prompt": "p-6"}, "p-6"),
    ({}, {"prompt": 7}, "7"),
    ({"X-Prompt-Id": "p-5"}, {"prompt": "p-6"}, "p-6"),  # the body wins
], ids=["header", "body", "number", "both"])
def test_the_prompt_reaches_the_trajectory(served, headers, body, prompt):
    name = f"traj-prompt-{prompt}-{len(headers)}"
    r = post(served.url, {"code": "print(1)", "trajectory": name, **body}, headers=headers)
    assert r.json()["status"] == "Success"
    assert served.dispatcher.trajectories.get(name).prompt == prompt
    httpx.post(f"{served.url}/v1/trajectories/{name}/close", timeout=30)


@pytest.mark.parametrize("headers, body, message", [
    ({"X-Prompt-Id": "p"}, {}, "prompt: only a trajectory answers a prompt"),
    ({}, {"prompt": "p"}, "prompt: only a trajectory answers a prompt"),
    ({"X-Trajectory-Id": "t"}, {"prompt": ["p"]}, "prompt: must be a string (got ['p'])"),
    ({"X-Trajectory-Id": "t", "X-Prompt-Id": ""}, {}, "X-Prompt-Id: must not be empty"),
    ({"X-Trajectory-Id": "t", "X-Prompt-Id": "p" * 257}, {},
     "X-Prompt-Id: must have at most 256 characters"),
    ({}, {"trajectory": "t", "prompt": "p" * 257}, "prompt: must have at most 256 characters"),
], ids=["header-alone", "body-alone", "body-type", "header-empty", "header-long", "body-long"])
def test_a_bad_prompt_is_422_in_one_line(served, headers, body, message):
    r = post(served.url, {"code": "print(1)", **body}, headers=headers)
    assert r.status_code == 422
    assert r.json()["detail"].startswith(message) and "\n" not in r.json()["detail"]


def test_unsupported_language_is_a_sandbox_error_naming_it(served):
    doc = verl(served.url, "print 1", language="cobol")
    assert doc["status"] == "SandboxError"
    assert doc["message"].startswith("language: 'cobol' is not offered here")
    assert doc["run_result"] is None and doc["compile_result"] is None


@pytest.mark.parametrize("body, message", [
    ({"language": "python"}, "code: is required"),
    ({"code": "x", "run_timeout": 0}, "run_timeout: must be > 0 (got 0)"),
    ({"code": "x", "run_timeout": 1e9}, "run_timeout: must be <= 2592000 (30 days; got"),
    ({"code": "x", "files": {"a.txt": "%%%"}}, "files.a.txt: must be base64 (got '%%%')"),
    ({"code": "x", "files": {"": "eA=="}}, "files: bad key: must not be empty (got '')"),
    ({"code": "x", "memory_limit_MB": -5}, "memory_limit_MB: must be >= -1 (got -5)"),
    ({"code": "x", "turn": "3"}, "turn: must be a whole number (got '3')"),
    ([1, 2], "body: must be a JSON object (got [1, 2])"),
])
def test_a_body_that_is_not_a_request_is_422_in_one_line(served, body, message):
    r = post(served.url, body)
    assert r.status_code == 422
    assert r.json()["detail"].startswith(message) and "\n" not in r.json()["detail"]


def test_a_json_body_sent_as_a_form_is_told_to_say_it_is_json(served):
    """``curl -d`` sends a form's content type: FastAPI does not read it as JSON; the
    answer says how to send it, not that the (valid) JSON is not an object."""
    r = httpx.post(served.url + "/run_code", content=b'{"code": "print(1)"}',
                   headers={"content-type": "application/x-www-form-urlencoded"}, timeout=30)
    assert r.status_code == 422
    assert r.json()["detail"] == ("body: send it as JSON (Content-Type: application/json; "
                                  "got application/x-www-form-urlencoded)")


async def test_100_concurrent_requests_on_this_machine_are_all_answered(served):
    """100 at once (more than the cores, and more than sandboxes fit at once): each one
    waits its turn and gets its own answer; none is refused."""
    async def one(c: httpx.AsyncClient, i: int) -> tuple[int, dict]:
        r = await c.post("/run_code", json={
            "code": "import time\nn = int(input())\ntime.sleep(0.05)\nprint(n * n)",
            "stdin": str(i), "run_timeout": 30})
        return r.status_code, r.json()

    limits = httpx.Limits(max_connections=100)
    async with httpx.AsyncClient(base_url=served.url, timeout=600, limits=limits) as c:
        answers = await asyncio.gather(*(one(c, i) for i in range(100)))
    assert [code for code, _ in answers] == [200] * 100
    assert [doc["status"] for _, doc in answers] == ["Success"] * 100
    assert [doc["run_result"]["stdout"] for _, doc in answers] == [
        f"{i * i}\n" for i in range(100)]


def test_write_commands_fit_a_command_line():
    files = {"a": "A" * (PER_COMMAND + 5), "b": "", "c": "C" * 10}
    argvs = list(write_argvs(files))
    assert len(argvs) == 2
    for argv in argvs:
        triples = argv[3:]
        assert len(triples) % 3 == 0
        assert all(len(x) <= PIECE for x in triples)
        assert sum(len(x) for x in triples) <= PER_COMMAND + 3 * PIECE
    # The pieces, in order, are the contents; the first of each file truncates.
    pieces = [t for argv in argvs for t in zip(*[iter(argv[3:])] * 3, strict=True)]
    for path, text in files.items():
        mine = [(mode, data) for p, mode, data in pieces if p == path]
        assert mine[0][0] == "w" and all(m == "a" for m, _ in mine[1:])
        assert "".join(d for _, d in mine) == text


def test_without_sandboxes_no_language_is_offered_and_the_answer_says_why():
    from metasched.runtime.sandbox.config import SandboxConfig

    dcfg = DispatcherConfig(scheduler="elastic_greedy",
                            sandbox=SandboxConfig(isolation="none"))
    with serving(dcfg, ServeConfig(languages=None)) as s:
        doc = post(s.url, {"code": "print(1)"}).json()
        status = httpx.get(f"{s.url}/v1/status", timeout=30).json()["service"]
    assert doc["status"] == "SandboxError"
    assert "commands have no trajectory workspace here" in doc["message"]
    assert status["languages"] == [] and "python" in status["unavailable"]


@pytest.mark.parametrize("route", ["/run_code", "/v1/actions"])
def test_a_daemon_started_by_a_request_ends_with_its_step(served, route):
    """A background process (double fork, its own session) does not outlive the step
    that started it, even in a trajectory still open: no per-client cap is needed for
    ``/run_code`` or native actions, only E2B's background commands run past their
    request."""
    import psutil

    marker = f"daemon-{uuid.uuid4().hex[:12]}"
    # It runs while the step does: the step finds it by its shell's command line (the
    # marker is spelt whole there alone, and the pattern does not match itself).
    script = (f"x=aemon-{marker[7:]}; (setsid sh -c \"sleep 300; echo d$x\" </dev/null "
              f">/dev/null 2>&1 &); sleep 0.3; "
              f"grep -l '[d]aemon-{marker[7:]}' /proc/[0-9]*/cmdline 2>/dev/null | wc -l")
    head = {"X-Trajectory-Id": f"traj-{marker}", "X-Turn": "0"}
    if route == "/run_code":
        r = post(served.url, {"code": script, "language": "bash"}, headers=head)
        out = r.json()["run_result"]["stdout"]
    else:
        r = httpx.post(f"{served.url}/v1/actions", params={"wait": 60}, timeout=120, json={
            "kind": "cpu", "argv": ["sh", "-c", script], "timeout_s": 30,
            "trajectory": f"traj-{marker}"})
        out = r.json()["stdout"]
    assert int(out) >= 1, r.text  # its trajectory stays open (named), the daemon does not
    alive = [p.pid for p in psutil.process_iter(["cmdline"])
             if any(marker in part for part in p.info["cmdline"] or [])]
    assert alive == []
