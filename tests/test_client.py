"""metasched.client: the blocking and the asyncio client against a running service."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from serve_helpers import serving

from metasched.client import AsyncClient, Client, ServiceError
from metasched.serve import ServeConfig

TOKEN = "client-test-token-0123"


@pytest.fixture(scope="module")
def served():
    with serving() as s:
        yield s


def test_run_submit_and_result(served):
    with Client(served.url) as c:
        r = c.run(argv=["echo", "hi"])
        assert (r.status, r.stdout, r.exit_code) == ("done", "hi\n", 0)
        rid = c.submit({"argv": ["sleep", "0.2"]}, id="sub-1")
        assert rid == "sub-1"
        assert c.result(rid) is None or c.result(rid).status == "done"
        assert c.wait(rid).status == "done"
        assert c.result(rid, wait_s=1).stdout == ""


def test_bad_input_comes_back_rejected_and_unknown_ids_raise(served):
    with Client(served.url) as c:
        r = c.run(argv=["true"], timeout_s=-1)
        assert r.status == "rejected" and "timeout_s: must be > 0" in r.reason
        with pytest.raises(ServiceError) as e:
            c.result("no-such-id")
        assert e.value.status == 404


def test_trajectory_context_gives_name_task_and_successive_turns(served):
    trajs = served.dispatcher.state.trajectories
    with Client(served.url) as c, c.trajectory("t-17", task="swe", turn=5) as t:
        assert t.run(argv=["true"]).ok and t.run(argv=["true"]).ok
        traj = max(trajs.values(), key=lambda x: x.id)
        assert (traj.task, traj.turn) == ("swe", 7)  # turns 5 and 6 ran
        assert t.turn == 7


@pytest.mark.parametrize("prompt", ["p-3", None])
def test_a_trajectory_sends_its_prompt_with_each_action(served, prompt):
    name = f"t-prompt-{prompt}"
    with Client(served.url) as c, c.trajectory(name, prompt=prompt) as t:
        assert t.run(argv=["true"]).ok
        assert served.dispatcher.trajectories.get(name).prompt == prompt


async def test_an_async_trajectory_sends_its_prompt(served):
    async with AsyncClient(served.url) as c, c.trajectory("t-async-prompt", prompt="p-4") as t:
        assert (await t.run(argv=["true"])).ok
        assert served.dispatcher.trajectories.get("t-async-prompt").prompt == "p-4"


@pytest.mark.parametrize("prompt, header", [("p-3", "p-3"), (None, None)])
def test_run_code_in_a_trajectory_sends_the_prompt_header(prompt, header):
    seen = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("X-Prompt-Id"))
        return httpx.Response(200, json={"status": "Success"})

    with Client("http://sf", transport=httpx.MockTransport(answer)) as c:
        t = c.trajectory("t-1", prompt=prompt)
        assert t.run_code("print(1)")["status"] == "Success"
    assert seen == [header]


def test_wait_gives_up_at_its_deadline(served):
    with Client(served.url) as c:
        with pytest.raises(TimeoutError):
            c.run(argv=["sleep", "3"], wait_s=0.3)


def test_token_is_sent_and_a_refusal_raises():
    with serving(config=ServeConfig(token=TOKEN, languages=[])) as s:
        with Client(s.url, token=TOKEN) as c:
            assert c.run(argv=["true"]).ok and c.status()["service"]["ready"]
        with Client(s.url) as c, pytest.raises(ServiceError) as e:
            c.run(argv=["true"])
        assert e.value.status == 401 and "bearer token" in e.value.detail


async def test_async_client_runs_concurrently(served):
    async with AsyncClient(served.url) as c:
        results = await asyncio.gather(*(c.run(argv=["echo", str(i)]) for i in range(8)))
        assert [r.stdout for r in results] == [f"{i}\n" for i in range(8)]
        async with c.trajectory(task="async") as t:
            assert (await t.run(argv=["true"])).ok
            assert t.name.startswith("traj-") and t.turn == 1
        assert (await c.status())["queue"] == {"cpu": 0, "gpu": 0, "api": 0}
