"""Deadlines through ``/run_code``, over real HTTP on 127.0.0.1 and real sandboxes on
this machine's cores: a burst of busy loops larger than the cores is answered before
each caller gives up, with the verdict SandboxFusion gives (``status: Failed``,
``run_result.status: TimeLimitExceeded``); commands that idle on their cores do not
keep another waiting; with ``on_deadline: refuse`` a request that cannot start in time
is answered 504 before its caller gives up (metasched.runtime.dispatch.sharing)."""

from __future__ import annotations

import asyncio
import statistics
import time

import httpx
import pytest
from serve_helpers import serving

from metasched.runtime.dispatch import DispatcherConfig
from metasched.runtime.dispatch.deadline_config import DeadlineConfig
from metasched.runtime.sandbox.config import SandboxConfig
from metasched.serve import ServeConfig
from metasched.serve.deadlines import SANDBOX_FUSION_MARGIN_S, SKYRL_RUN_ONLY_MARGIN_S

LOOP = "while True:\n    pass\n"


def _config(**deadlines) -> DispatcherConfig:
    # Small workspaces: a hundred sandboxes at once fit this machine's memory.
    return DispatcherConfig(scheduler="elastic_greedy", sandbox=SandboxConfig(workspace_mb=64),
                            deadlines=DeadlineConfig(**deadlines))


@pytest.fixture(scope="module")
def served():
    with serving(_config(), ServeConfig(languages=["python"])) as s:
        yield s


async def _burst(url: str, bodies: list[dict], wait_s: float, headers: dict | None = None
                 ) -> list[tuple[float, int, dict]]:
    """Post every body at once, each caller giving up after ``wait_s`` (as verl's and
    SkyRL's clients do: a read timeout); (seconds to the answer, status, body) each."""
    async def one(c: httpx.AsyncClient, body: dict) -> tuple[float, int, dict]:
        t0 = time.monotonic()
        r = await c.post("/run_code", json=body, headers=headers or {})
        return time.monotonic() - t0, r.status_code, r.json()

    limits = httpx.Limits(max_connections=len(bodies))
    async with httpx.AsyncClient(base_url=url, timeout=wait_s, limits=limits) as c:
        return await asyncio.gather(*(one(c, b) for b in bodies))


def _time_limit(answers: list[tuple[float, int, dict]]) -> None:
    assert [code for _, code, _ in answers] == [200] * len(answers)
    assert {(doc["status"], doc["run_result"]["status"]) for _, _, doc in answers} == {
        ("Failed", "TimeLimitExceeded")}


async def test_busy_loops_beyond_the_cores_answer_before_the_callers_give_up(served):
    # SkyRL's coder client: run_timeout alone, and it waits run_timeout + 2 s. Ten 2 s
    # loops on this machine's cores would take 10 s one core each; each caller gets its
    # "time limit" within its 4 s.
    wait_s = 2 + SKYRL_RUN_ONLY_MARGIN_S
    answers = await _burst(served.url, [{"code": LOOP, "run_timeout": 2}] * 10, wait_s)
    _time_limit(answers)
    assert max(t for t, _, _ in answers) < wait_s
    assert served.dispatcher.stats()["deadline_shared"] > 0


async def test_the_deadline_header_wins_over_the_derived_deadline(served):
    # verl's fields would give 2 + 2 + 10 s; the header says 4.
    answers = await _burst(served.url, [{"code": LOOP, "compile_timeout": 2,
                                          "run_timeout": 2}] * 8, 4.0,
                           headers={"X-Metasched-Deadline-S": "4"})
    _time_limit(answers)


@pytest.mark.parametrize("path, body", [
    ("/run_code", {"code": "print(1)"}),
    ("/v1/actions", {"kind": "cpu", "argv": ["true"]}),
])
def test_a_bad_deadline_header_is_422_in_one_line(served, path, body):
    r = httpx.post(f"{served.url}{path}", json=body,
                   headers={"X-Metasched-Deadline-S": "soon"}, timeout=30)
    assert r.status_code == 422
    assert r.json()["detail"] == ("X-Metasched-Deadline-S: must be a number of seconds > 0 "
                                  "and <= 2592000 (got 'soon')")


def test_native_busy_loops_with_the_header_answer_before_it(served):
    # POST /v1/actions with the header, waiting for the result: each loop is answered
    # ("timeout after 2 s") before the 4 s the header gives.
    async def run() -> list[tuple[float, dict]]:
        async def one(c: httpx.AsyncClient) -> tuple[float, dict]:
            t0 = time.monotonic()
            r = await c.post("/v1/actions", params={"wait": 4},
                             json={"kind": "cpu", "argv": ["python3", "-c", LOOP],
                                   "timeout_s": 2},
                             headers={"X-Metasched-Deadline-S": "4"})
            return time.monotonic() - t0, r.json()
        async with httpx.AsyncClient(base_url=served.url, timeout=30) as c:
            return await asyncio.gather(*(one(c) for _ in range(6)))

    answers = asyncio.run(run())
    assert [doc.get("reason") for _, doc in answers] == ["timeout after 2 s"] * 6
    assert max(t for t, _ in answers) < 4.0


async def test_idle_commands_do_not_keep_a_hello_world_waiting(served):
    # Three sleepers hold (or wait for) this machine's cores doing nothing; their
    # measured CPU use frees a core for the hello-world at once, not after the sleep.
    sleep = {"code": "import time\ntime.sleep(8)\nprint('woke')", "run_timeout": 30}
    async with httpx.AsyncClient(base_url=served.url, timeout=60) as c:
        sleepers = [asyncio.ensure_future(c.post("/run_code", json=sleep)) for _ in range(3)]
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        r = await c.post("/run_code", json={"code": "print('hello')", "run_timeout": 5})
        took = time.monotonic() - t0
        woke = await asyncio.gather(*sleepers)
    assert r.json()["run_result"]["stdout"] == "hello\n"
    assert took < 4.0, took
    assert [w.json()["run_result"]["stdout"] for w in woke] == ["woke\n"] * 3


async def test_a_burst_beyond_sandbox_memory_is_answered_before_its_deadline():
    # A node of 3 GB holds two 1 GB workspaces beside the shared sandbox: the others'
    # sandboxes are opened at their latest start, past the memory pool (a workspace's
    # size caps what it may hold), rather than keeping their callers waiting.
    cfg = DispatcherConfig(scheduler="elastic_greedy", mem_gb=3.0)
    with serving(cfg, ServeConfig(languages=["python"])) as s:
        answers = await _burst(s.url, [{"code": LOOP, "run_timeout": 3}] * 8, 12.0,
                               headers={"X-Metasched-Deadline-S": "12"})
        _time_limit(answers)
        assert max(t for t, _, _ in answers) < 12.0
        assert s.dispatcher.stats()["deadline_sandboxes"] > 0


async def test_with_refuse_a_request_that_cannot_start_in_time_is_504_before_its_deadline():
    # Six 3 s loops, each caller waiting 12 s: two run at once on this machine's cores,
    # and the others cannot all start in time: each of those is answered 504 (which
    # verl's client retries) well before its caller gives up, never a silent wait.
    with serving(_config(on_deadline="refuse"), ServeConfig(languages=["python"])) as s:
        answers = await _burst(s.url, [{"code": LOOP, "run_timeout": 3}] * 6, 12.0,
                               headers={"X-Metasched-Deadline-S": "12"})
    codes = sorted(code for _, code, _ in answers)
    assert 504 in codes and set(codes) <= {200, 504}
    for t, code, doc in answers:
        assert t < 12.0
        if code == 504:
            assert " deadline: not started after " in doc["detail"]
        else:
            assert doc["run_result"]["status"] == "TimeLimitExceeded"


@pytest.mark.slow  # ~30 s
async def test_hundred_concurrent_ten_second_busy_loops_as_verl_sends_them(served, capsys):
    # verl's call: compile_timeout = run_timeout = 10, read timeout 10 + 10 + 10 s.
    wait_s = 10 + 10 + SANDBOX_FUSION_MARGIN_S
    body = {"code": LOOP, "language": "python", "compile_timeout": 10, "run_timeout": 10,
            "memory_limit_MB": 1024, "stdin": None, "files": {}, "fetch_files": []}
    answers = await _burst(served.url, [body] * 100, wait_s)
    _time_limit(answers)
    times = [t for t, _, _ in answers]
    with capsys.disabled():
        print(f"\n100 busy loops: median answer {statistics.median(times):.2f} s, worst "
              f"{max(times):.2f} s (deadline {wait_s:g} s)")
    assert max(times) < wait_s
