"""Trajectory workspaces through the live dispatcher: a file written in one action is
read by the next and is gone once the trajectory closes (by its reward action, by
``close_trajectory``, or after its idle time); a workspace's size is the sandbox memory
the scheduler accounts; requests about workspaces are checked with one-line errors."""

from __future__ import annotations

import asyncio
import tarfile

import pytest
from sandbox_helpers import sandboxed_config as cfg

from metasched.runtime.dispatch import Dispatcher

pytestmark = pytest.mark.isolation


def sh(script: str, **kw) -> dict:
    return {"kind": "cpu", "argv": ["/bin/sh", "-c", script],
            "timeout_s": kw.pop("timeout_s", 30), **kw}


@pytest.mark.parametrize("closed_by", ["reward", "close_trajectory", "idle"])
async def test_a_file_lives_as_long_as_its_trajectory(closed_by):
    config = cfg(trajectory_idle_s=0.3) if closed_by == "idle" else cfg()
    async with Dispatcher(config) as d:
        wrote = await d.submit(sh("echo step1 > notes.txt", trajectory="t", turn=0))
        read = await d.submit(sh("cat notes.txt", trajectory="t", turn=1,
                                 reward=closed_by == "reward"))
        if closed_by == "close_trajectory":
            d.close_trajectory("t")
        elif closed_by == "idle":
            await asyncio.sleep(1.0)  # > trajectory_idle_s, ticks of 0.05 s
        assert d.sandboxes.get("t") is None  # the sandbox (and its workspace) is gone
        after = await d.submit(sh("ls -A; cat notes.txt", trajectory="t", turn=0))
    assert wrote.ok and read.ok, (wrote.stderr, read.stderr)
    assert read.stdout == "step1\n"
    assert after.status == "failed" and "No such file" in after.stderr
    assert after.stdout == ""


async def test_workspace_memory_is_the_sandbox_memory_the_scheduler_accounts():
    async with Dispatcher(cfg(mem_gb=2.0)) as d:
        free0 = d.state.cpu.mem_free[0]
        await d.submit(sh("true", trajectory="a", workspace_mb=512))
        held = free0 - d.state.cpu.mem_free[0]
        d.close_trajectory("a")
        freed = d.state.cpu.mem_free[0]
    assert held == pytest.approx(0.5)
    assert freed == free0


async def test_a_trajectory_waits_for_sandbox_memory():
    async with Dispatcher(cfg(mem_gb=1.0)) as d:
        first = await d.submit(sh("echo a > f", trajectory="a", workspace_mb=768))
        second = asyncio.ensure_future(d.submit(sh("echo b", trajectory="b",
                                                   workspace_mb=768)))
        await asyncio.sleep(0.5)
        waited = not second.done()
        d.close_trajectory("a")  # frees 768 MB: b's sandbox can be made
        second = await asyncio.wait_for(second, 10)
    assert first.ok and waited and second.ok and second.stdout == "b\n"


async def test_template_seeds_each_trajectory_separately(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "test_x.py").write_text("def test_x():\n    assert True\n")
    archive = tmp_path / "repo.tar"
    with tarfile.open(archive, "w") as t:
        t.add(repo, arcname=".")

    templates = {"repo": str(repo), "archive": str(archive)}
    async with Dispatcher(cfg(sandbox={"templates": templates})) as d:
        a = await d.submit(sh("ls; echo changed > test_x.py", trajectory="a",
                              workspace_template="repo"))
        b = await d.submit(sh("cat test_x.py", trajectory="b",
                              workspace_template="archive"))
        a2 = await d.submit(sh("cat test_x.py", trajectory="a"))
    assert a.ok and a.stdout == "test_x.py\n", a.stderr
    assert b.stdout.startswith("def test_x")  # its own copy, untouched by a
    assert a2.stdout == "changed\n"
    assert (repo / "test_x.py").read_text().startswith("def test_x")


@pytest.mark.parametrize("first, later, message", [
    ({}, {"network": True}, "network: trajectory t's sandbox was made with network=false"),
    ({}, {"workspace_mb": 64}, "workspace_mb: trajectory t's workspace was made with 1024 MB"),
    ({}, {"workspace_template": "repo"}, "workspace_template: trajectory t's workspace was "
     "made from nothing"),
    (None, {"workspace_template": "/nonexistent"}, "workspace_template: unknown template "
     "'/nonexistent' (configured: repo)"),
    (None, {"workspace_mb": 1e9}, "workspace_mb: 1e+09 MB exceeds this node's memory"),
])
async def test_workspace_requests_are_checked(first, later, message, tmp_path):
    async with Dispatcher(cfg(sandbox={"templates": {"repo": str(tmp_path)}})) as d:
        if first is not None:
            await d.submit(sh("true", trajectory="t", **first))
        r = await d.submit(sh("true", trajectory="t", **later))
    assert r.status == "rejected"
    assert r.reason.startswith(message), r.reason
    assert "\n" not in r.reason


async def test_a_failed_sandbox_fails_its_commands_with_the_reason(tmp_path):
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(b"not gzip at all" * 10)

    async with Dispatcher(cfg(sandbox={"templates": {"bad": str(bad)}})) as d:
        r = await d.submit(sh("true", trajectory="t", workspace_template="bad"))
        ok = await d.submit(sh("echo fine", trajectory="u"))
    assert r.status == "failed" and r.reason.startswith("cannot start: cannot seed the "
                                                        "workspace"), r.reason
    assert ok.ok and ok.stdout == "fine\n"
