"""A command killed for its memory says so: a last stderr line and the message of
/run_code (its status stays SandboxFusion's: Failed, the run Finished with its
return code), the end of an E2B command, the error of a code interpreter's cell."""

from __future__ import annotations

import httpx
import pytest

e2b = pytest.importorskip("e2b")
ci = pytest.importorskip("e2b_code_interpreter")

from metasched.runtime.dispatch import DispatcherConfig  # noqa: E402
from metasched.serve import ServeConfig  # noqa: E402
from tests.serve_helpers import serving  # noqa: E402
from tests.test_serve_e2b import opts  # noqa: E402

HOG = "x = [bytearray(2**20) for _ in range(3000)]"  # 3 GiB, a MiB at a time
LINE = "memory limit exceeded (512 MB): killed for using more memory than its limit"


@pytest.fixture(scope="module")
def served():
    with serving(DispatcherConfig(scheduler="elastic_greedy"),
                 ServeConfig(languages=["python"])) as srv:
        yield srv


def test_run_code_says_memory_ran_out(served):
    r = httpx.post(f"{served.url}/run_code", json={
        "code": HOG, "language": "python", "memory_limit_MB": 512}, timeout=120).json()
    assert r["status"] == "Failed" and r["message"] == LINE
    assert r["run_result"]["status"] == "Finished" and r["run_result"]["return_code"] != 0
    assert r["run_result"]["stderr"].splitlines()[-1] == LINE


def test_e2b_command_says_memory_ran_out(served):
    sb = e2b.Sandbox.create(envs={"METASCHED_MEMORY_MB": "512"}, **opts(served))
    try:
        with pytest.raises(e2b.CommandExitException) as info:
            sb.commands.run(f"python3 -c '{HOG}'")
        assert info.value.stderr.splitlines()[-1] == LINE
        assert "memory limit exceeded (512 MB)" in info.value.error
    finally:
        sb.kill()


def test_interpreter_cell_says_memory_ran_out_and_the_context_starts_again(served):
    sb = ci.Sandbox.create(envs={"METASCHED_MEMORY_MB": "512"}, **opts(served))
    try:
        sb.run_code("a = 1")
        ex = sb.run_code(HOG)
        assert ex.error.name == "KernelError"
        assert "memory limit exceeded (512 MB)" in ex.error.value
        assert sb.run_code("a").error.name == "NameError"  # a new kernel: state gone
        assert sb.run_code("2 + 2").text == "4"
    finally:
        sb.kill()
