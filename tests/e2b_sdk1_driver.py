"""Run by a Python with E2B's SDK 1.x (``METASCHED_E2B1_PYTHON``), against a service
with ``e2b_sdk1_ports`` (``E2B_DEBUG=true`` in its environment): prints one JSON
object of what the SDK saw.

- ``sdk``: ``e2b_code_interpreter.Sandbox`` as rllm constructs it: cells with state,
  a result's text, stdout, an error's traceback, commands, files, ``kill()`` (sent
  nothing in debug mode) and ``is_running()`` once the sandbox is killed by id;
- ``rllm``: rllm's ``E2BPythonInterpreter`` (from ``PYTHONPATH``), unmodified, through
  a multi-turn loop of tool calls that build on each other's state;
- ``rllm_restart``: that tool's own restart after a cell that does not end (with
  ``e2b_sdk1_replace`` on the service);
- ``cells N``: the seconds of N ``run_code("1")``, one by one.
"""

from __future__ import annotations

import json
import sys
import time

import httpx

API = "http://127.0.0.1:3000"  # SDK 1.x's API in debug mode


def sdk() -> dict:
    from e2b_code_interpreter import Sandbox

    out: dict = {}
    sb = Sandbox(api_key="unused", timeout=600)
    out["id"] = sb.sandbox_id
    sb.run_code("import math\nx = 41")
    ex = sb.run_code("print('hi')\nx + 1")
    out["text"], out["stdout"] = ex.text, ex.logs.stdout
    ex = sb.run_code("def f():\n    return 1 / 0\nf()")
    out["error"] = [ex.error.name, ex.error.value, ex.error.traceback]
    out["after_error"] = sb.run_code("x * 2").text
    r = sb.commands.run("echo $HOME; pwd; echo oops >&2")
    out["command"] = [r.exit_code, r.stdout, r.stderr]
    sb.files.write("/home/user/notes.txt", "from files\n")
    out["cat"] = sb.commands.run("cat notes.txt").stdout
    sb.commands.run("echo from commands > made.txt")
    out["read"] = sb.files.read("/home/user/made.txt")
    out["listed"] = sorted(e.name for e in sb.files.list("/home/user"))
    out["cell_sees_file"] = sb.run_code("open('/home/user/made.txt').read()").text
    out["running"] = sb.is_running()
    sb.kill()  # debug mode: the SDK sends nothing
    out["running_after_kill"] = sb.is_running()
    out["delete"] = httpx.delete(f"{API}/sandboxes/{sb.sandbox_id}").status_code
    out["running_after_delete"] = sb.is_running()
    return out


LOOP = [  # each call prints once: rllm's tool asserts exactly one stdout chunk
    "data = [3, 1, 4, 1, 5, 9, 2, 6]\nprint(len(data))",
    "total = sum(data)\nprint('total', total)\ntotal",
    "def mean(xs):\n    return sum(xs) / len(xs)\nprint(mean(data))",
    "import statistics\nprint(statistics.median(data))\nsorted(data)[-1]",
    "print('before')\nundefined_name + total",
    "data.append(total)\nprint(data[-1], len(data))\nmean(data)",
]


def rllm() -> dict:
    from rllm.tools.code_tools.e2b_tool import E2BPythonInterpreter

    tool = E2BPythonInterpreter(n_sandboxes=1, api_key="unused")
    sid = tool.sandboxes[0].sandbox_id
    calls = []
    for code in LOOP:
        t0 = time.perf_counter()
        o = tool(code=code, timeout=20)
        calls.append({"stdout": o.stdout, "stderr": o.stderr, "output": o.output,
                      "error": o.error, "s": time.perf_counter() - t0})
    tool._kill_sandbox()  # sends nothing in debug mode
    httpx.delete(f"{API}/sandboxes/{sid}")
    return {"id": sid, "calls": calls}


def rllm_restart() -> dict:
    """rllm's own way out of a cell that does not end: three timeouts, then its
    ``_restart_sandbox`` (a kill, sent nothing, and a new sandbox)."""
    from rllm.tools.code_tools.e2b_tool import E2BPythonInterpreter

    tool = E2BPythonInterpreter(n_sandboxes=1, api_key="unused")
    first = tool.sandboxes[0].sandbox_id
    calls = [tool(code="x = 5\nprint(x)", timeout=20),
             tool(code="print('spin')\nwhile True:\n    pass", timeout=1),
             tool(code="print('x' in globals())", timeout=20),
             tool(code="x = 7\nprint(x * 6)", timeout=20)]
    second = tool.sandboxes[0].sandbox_id
    httpx.delete(f"{API}/sandboxes/{second}")
    return {"ids": [first, second], "calls": [
        {"stdout": o.stdout, "stderr": o.stderr, "error": o.error} for o in calls]}


def cells(n: int) -> dict:
    from e2b_code_interpreter import Sandbox

    sb = Sandbox(api_key="unused", timeout=600)
    try:
        sb.run_code("1")
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            assert sb.run_code("1").text == "1"
            times.append(time.perf_counter() - t0)
        return {"times": times}
    finally:
        httpx.delete(f"{API}/sandboxes/{sb.sandbox_id}")


if __name__ == "__main__":
    mode = sys.argv[1]
    modes = {"sdk": sdk, "rllm": rllm, "rllm_restart": rllm_restart}
    result = modes[mode]() if mode in modes else cells(int(sys.argv[2]))
    print(json.dumps(result))
