"""E2B's code interpreter (metasched.serve.e2b.interpreter) driven by the unmodified
e2b-code-interpreter SDK: only its two URLs and a key are set."""

from __future__ import annotations

import asyncio
import base64
import time

import pytest

e2b = pytest.importorskip("e2b")
ci = pytest.importorskip("e2b_code_interpreter")

from metasched.runtime.dispatch import DispatcherConfig  # noqa: E402
from metasched.runtime.sandbox.config import SandboxConfig  # noqa: E402
from metasched.serve import ServeConfig  # noqa: E402
from metasched.serve.e2b.templates import build_layers, load_templates  # noqa: E402
from tests.serve_helpers import serving  # noqa: E402
from tests.test_serve_e2b import opts, sandbox_pid, wait_gone  # noqa: E402


@pytest.fixture(scope="module")
def served():
    with serving(DispatcherConfig(scheduler="elastic_greedy")) as srv:
        yield srv


async def test_cells_keep_state_stream_and_report_errors(served):
    sb = await ci.AsyncSandbox.create(**opts(served))
    try:
        seen = []
        ex = await sb.run_code("import time\nx = 41\nprint('one')\nprint('two')\n"
                               "time.sleep(0.5)\nprint('three', end='')\nx + 1",
                               on_stdout=lambda m: seen.append(m.line))
        assert ex.text == "42" and ex.error is None
        # As Jupyter's kernel sends them: what was printed together in one event.
        assert ex.logs.stdout == ["one\ntwo\n", "three"] and seen == ex.logs.stdout
        assert ex.results[0].is_main_result
        ex = await sb.run_code("s = 'abc'\ns")
        assert ex.text == "abc" and ex.execution_count == 2
        ex = await sb.run_code("import sys\nprint('warn', file=sys.stderr)\nx * 2")
        assert ex.text == "82" and ex.logs.stderr == ["warn\n"]
        ex = await sb.run_code("def f():\n    return 1 / 0\nf()")
        assert ex.error.name == "ZeroDivisionError" and ex.error.value == "division by zero"
        assert 'File "<cell>", line 2, in f' in ex.error.traceback
        assert "interpreter_kernel" not in ex.error.traceback
        ex = await sb.run_code("class H:\n    def _repr_html_(self):\n        return '<b>h</b>'\n"
                               "    def _repr_json_(self):\n        return {'a': 1}\nH()")
        assert ex.results[0].html == "<b>h</b>" and ex.results[0].json == {"a": 1}
        ex = await sb.run_code("import os\nos.environ['K'], os.getcwd()", envs={"K": "v"})
        assert ex.text == "('v', '/home/user')"
    finally:
        await sb.kill()


async def test_bash_and_contexts(served):
    sb = await ci.AsyncSandbox.create(**opts(served))
    try:
        ex = await sb.run_code("A=5; cd /tmp; echo $HOME", language="bash")
        assert ex.logs.stdout == ["/home/user\n"] and ex.error is None
        ex = await sb.run_code("echo $A $(pwd); false", language="bash")
        assert ex.logs.stdout == ["5 /tmp\n"]
        assert ex.error.name == "CommandExitError" and ex.error.value == "exit status 1"
        await sb.run_code("y = 1")
        ctx = await sb.create_code_context(cwd="/tmp")
        ex = await sb.run_code("import os\n'y' in dir(), os.getcwd()", context=ctx)
        assert ex.text == "(False, '/tmp')"
        await sb.run_code("z = 3", context=ctx)
        assert (await sb.run_code("z", context=ctx)).text == "3"
        listed = {c.id: c.language for c in await sb.list_code_contexts()}
        assert listed[ctx.id] == "python" and sorted(listed.values()) == [
            "bash", "python", "python"]
        await sb.restart_code_context(ctx)
        assert (await sb.run_code("z", context=ctx)).error.name == "NameError"
        await sb.remove_code_context(ctx)
        assert ctx.id not in {c.id for c in await sb.list_code_contexts()}
        with pytest.raises(e2b.NotFoundException):
            await sb.run_code("1", context=ctx)
        with pytest.raises(e2b.SandboxException, match="language 'cobol': not offered"):
            await sb.run_code("1", language="cobol")
    finally:
        await sb.kill()


async def test_a_cell_past_its_timeout_is_interrupted_and_the_state_kept(served):
    sb = await ci.AsyncSandbox.create(**opts(served))
    try:
        await sb.run_code("n = 7")
        t0 = time.monotonic()
        with pytest.raises(e2b.TimeoutException):
            await sb.run_code("import time\ntime.sleep(60)", timeout=1)
        ex = await sb.run_code("n")
        assert ex.text == "7", ex
        assert time.monotonic() - t0 < 20  # the sleep was interrupted, not waited for
    finally:
        await sb.kill()


async def interpreter_loop(srv, cells: int) -> tuple[str, int | None]:
    """One sandbox, ``cells`` cells that each build on the one before; its id and its
    namespaces' init pid (before it is killed)."""
    sb = await ci.AsyncSandbox.create(timeout=1200, **opts(srv, request_timeout=600))
    await sb.run_code("acc = []", timeout=600)
    for i in range(cells):
        ex = await sb.run_code(f"acc.append({i})\nprint(len(acc))\nsum(acc)", timeout=600)
        assert ex.error is None and ex.text == str(sum(range(i + 1))), ex
        assert ex.logs.stdout == [f"{i + 1}\n"]
    init_pid = sandbox_pid(srv, sb.sandbox_id)
    await sb.kill()
    assert not await sb.is_running()
    return sb.sandbox_id, init_pid


@pytest.mark.parametrize("n_sandboxes,cells", [
    (4, 5),
    pytest.param(16, 20, marks=pytest.mark.slow),
])
async def test_sandboxes_at_once_run_cells_and_leave_nothing(served, n_sandboxes, cells):
    t0 = time.perf_counter()
    done = await asyncio.gather(*(interpreter_loop(served, cells) for _ in range(n_sandboxes)))
    elapsed = time.perf_counter() - t0
    assert len({sid for sid, _ in done}) == n_sandboxes
    for sid, init_pid in done:
        await asyncio.to_thread(wait_gone, served, sid, init_pid, "kernel.py")
    assert not served.dispatcher.kernels.running
    print(f"{n_sandboxes} sandboxes x {cells} cells: {elapsed:.1f} s")


@pytest.mark.slow  # installs matplotlib and numpy from the registry once (cached)
async def test_matplotlib_figures_come_back_as_png(tmp_path_factory):
    templates = load_templates("configs/examples/e2b_templates.yaml")
    wanted = {"code-interpreter-v1": templates["code-interpreter-v1"]}
    layers = build_layers(wanted)
    with serving(DispatcherConfig(scheduler="elastic_greedy",
                                  sandbox=SandboxConfig(**layers)),
                 ServeConfig(languages=[], e2b_templates=wanted)) as srv:
        sb = await ci.AsyncSandbox.create(**opts(srv, request_timeout=600))
        try:
            ex = await sb.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\n"
                                   "plt.show()\n'done'", timeout=600)
            assert ex.error is None and ex.text == "done"
            assert base64.b64decode(ex.results[0].png).startswith(b"\x89PNG")
            ex = await sb.run_code("plt.figure()\nplt.bar([1], [2])\nNone")
            assert [r.formats() for r in ex.results] == [["text", "png"]]
        finally:
            await sb.kill()
