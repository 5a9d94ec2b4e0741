"""The sandbox server and the dispatcher's sandboxes, below the dispatcher: sandboxes
open, run commands as their own user inside their namespaces, keep a trajectory's
workspace between commands and lose it when closed; templates are laid in by overlay,
copy or extraction; failures are reported, not raised later."""

from __future__ import annotations

import asyncio
import os
import subprocess
import tarfile

import pytest
from helpers import running
from sandbox_helpers import run_in

from metasched.errors import ConfigError
from metasched.runtime.sandbox.workspace import template_from


async def test_command_runs_unprivileged_in_its_workspace(sandboxes):
    sandboxes.attach(asyncio.get_running_loop())
    sb = sandboxes.open("t1", size_mb=64, template=None, network=False)
    r = await run_in(sandboxes, sb, ["sh", "-c", "id -u; id -G; pwd; grep -E "
                                 "'^(CapEff|CapPrm|NoNewPrivs)' /proc/self/status"])
    assert r.code == 0, r.stderr
    uid, groups, cwd, cap_eff, cap_prm, nnp = r.stdout.split("\n")[:6]
    assert int(uid) == sb.uid and sb.uid >= 1000
    assert groups.split() == [str(sb.uid)]  # no supplementary group of the dispatcher
    assert cwd == "/workspace"
    assert cap_eff.split()[1] == cap_prm.split()[1] == "0000000000000000"
    assert nnp.split()[1] == "1"


async def test_trajectory_workspace_persists_then_is_gone_after_close(sandboxes):
    sandboxes.attach(asyncio.get_running_loop())
    sb = sandboxes.open("t1", size_mb=64, template=None, network=False)
    w = await run_in(sandboxes, sb, ["sh", "-c", "echo kept > note; echo tmp > /tmp/t"])
    r = await run_in(sandboxes, sb, ["cat", "note", "/tmp/t"])
    sandboxes.close_trajectory("t1")
    again = sandboxes.open("t1", size_mb=64, template=None, network=False)
    gone = await run_in(sandboxes, again, ["sh", "-c", "ls -A /workspace /tmp"])
    assert w.code == 0 and r.code == 0, (w.stderr, r.stderr)
    assert r.stdout == "kept\ntmp\n"
    assert gone.code == 0 and "note" not in gone.stdout and "t\n" not in gone.stdout


async def test_workspace_size_is_the_tmpfs_size(sandboxes):
    sandboxes.attach(asyncio.get_running_loop())
    sb = sandboxes.open("t1", size_mb=16, template=None, network=False)
    r = await run_in(sandboxes, sb, ["sh", "-c", "df -k /workspace | tail -1; "
                                 "dd if=/dev/zero of=big bs=1M count=32"])
    assert int(r.stdout.split()[1]) == 16 * 1024
    assert r.code != 0 and "No space left on device" in r.stderr


async def test_trajectory_less_commands_each_get_a_private_workspace(sandboxes):
    sandboxes.attach(asyncio.get_running_loop())
    sb = sandboxes.shared(network=False)
    a = await run_in(sandboxes, sb, ["sh", "-c", "echo a > mine; echo a > /tmp/mine; id -u"])
    b = await run_in(sandboxes, sb, ["sh", "-c", "ls -A /workspace /tmp; id -u"])
    assert a.code == 0 and b.code == 0, (a.stderr, b.stderr)
    assert "mine" not in b.stdout
    assert a.stdout.split()[-1] != b.stdout.split()[-1]  # a user id each


@pytest.mark.parametrize("how", ["overlay", "copy", "tar"])
async def test_template_seeds_the_workspace(sandboxes, tmp_path, how):
    src = tmp_path / ("with,comma" if how == "copy" else "repo")  # overlay cannot take ','
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_text("X = 1\n")
    (src / "README").write_text("hello\n")
    path = src
    if how == "tar":
        path = tmp_path / "repo.tar.gz"
        with tarfile.open(path, "w:gz") as t:
            t.add(src, arcname=".")
    template = template_from(str(path))

    sandboxes.attach(asyncio.get_running_loop())
    sb = sandboxes.open("t1", size_mb=64, template=template, network=False)
    r = await run_in(sandboxes, sb, ["sh", "-c", "cat README pkg/mod.py && "
                                 "echo 'X = 2' > pkg/mod.py && echo new > added"])
    r2 = await run_in(sandboxes, sb, ["cat", "pkg/mod.py", "added"])
    assert sb.seeded == how
    assert r.code == 0, r.stderr
    assert r.stdout == "hello\nX = 1\n"
    assert r2.stdout == "X = 2\nnew\n"
    assert (src / "pkg" / "mod.py").read_text() == "X = 1\n"  # the template is untouched
    assert not (src / "added").exists()


async def test_bad_archive_fails_the_sandbox_with_the_reason(sandboxes, tmp_path):
    bad = tmp_path / "broken.tar"
    bad.write_bytes(b"this is not a tar archive" * 100)

    sandboxes.attach(asyncio.get_running_loop())
    sb = sandboxes.open("t1", size_mb=64, template=template_from(str(bad)), network=False)
    with pytest.raises(OSError) as e:
        await sb.ready
    why = str(e.value)
    assert "cannot seed the workspace" in why and "tar" in why


@pytest.mark.parametrize("value, message", [
    ("/nonexistent/x", "no such file or directory"),
    ("/etc/hostname", "not a directory or a tar archive"),
])
def test_template_path_errors_are_one_line(value, message):
    with pytest.raises(ConfigError) as e:
        template_from(value)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith("workspace_template: ")


async def test_missing_program_cannot_start(sandboxes):
    sandboxes.attach(asyncio.get_running_loop())
    sb = sandboxes.open("t1", size_mb=64, template=None, network=False)
    await sb.ready
    r, w = os.pipe()
    try:
        with pytest.raises(OSError) as e:
            sandboxes.start(sb, argv=["no-such-program-here"], env={b"PATH": b"/usr/bin"},
                        cores=[0], mem_limit_mb=None, pids_max=None, out_w=w, err_w=w)
    finally:
        os.close(r)
        os.close(w)
    err = e.value
    assert err.strerror == "No such file or directory"


async def test_commands_die_with_the_server(sandboxes):
    sandboxes.attach(asyncio.get_running_loop())
    sb = sandboxes.open("t1", size_mb=64, template=None, network=False)
    task = asyncio.ensure_future(run_in(sandboxes, sb, ["sleep", "60"]))
    await asyncio.sleep(0.5)
    sandboxes.server.proc.kill()  # the server dies: its sandboxes' namespaces end
    r = await asyncio.wait_for(task, 10)
    assert r.status == -1  # reported lost, not waited for forever
    for _ in range(100):
        if subprocess.run(["kill", "-0", str(r.pid)], capture_output=True).returncode != 0:
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("the command outlived its sandbox server")


# --- spawns pipelined through the server ------------------------------------------------

def _sleeping(marker: str) -> list:
    return running(["sleep", marker])


async def test_a_sandboxed_start_returns_before_the_server_has_started_it(sandboxes):
    """start_process only sends the spawn: the loop goes on while the server starts the
    command; its pid (and on_start) come with the server's reply."""
    from metasched.runtime.process.run import start_process

    sandboxes.attach(asyncio.get_running_loop())
    sb = sandboxes.open("t1", size_mb=64, template=None, network=False)
    await sb.ready
    pids: list[int] = []
    proc = start_process(["/bin/echo", "hi"], cores=[0], timeout_s=30, sandboxes=sandboxes,
                         sandbox=sb, cwd_root="/tmp", on_start=pids.append)
    at_return = (proc.pid, list(pids), proc.not_started)
    out = await proc.wait()
    pid0, pids0, not_started = at_return
    assert (pid0, pids0, not_started) == (None, [], False)
    assert out.ok and out.stdout == "hi\n"
    assert pids == [out.detail["pid"]]


async def test_a_program_missing_in_the_sandbox_fails_and_gives_its_user_and_slot_back(sandboxes):
    from metasched.runtime.process.run import run_process

    sandboxes.attach(asyncio.get_running_loop())
    sb = sandboxes.open("t1", size_mb=64, template=None, network=False)
    shared = sandboxes.shared(False)
    await asyncio.gather(sb.ready, shared.ready)
    in_use = sandboxes.uids.in_use
    outs = [await run_process(["/no/such/program"], cores=[0], timeout_s=30,
                              sandboxes=sandboxes, sandbox=box, cwd_root="/tmp")
            for box in (sb, shared, sb)]
    ok = await run_process(["/bin/true"], cores=[0], timeout_s=30, sandboxes=sandboxes,
                           sandbox=sb, cwd_root="/tmp")
    running, shared_running = sb.running, shared.running
    in_use_before, in_use_after = in_use, sandboxes.uids.in_use
    assert [o.reason for o in outs] == ["cannot start: No such file or directory"] * 3
    assert all("pid" not in o.detail for o in outs)
    assert ok.ok and running == shared_running == 0
    assert in_use_before == in_use_after  # the trajectory-less command's own user is back


async def test_a_command_killed_before_the_server_started_it_does_not_survive(sandboxes):
    """abandon() in the same loop turn as the start: the kill comes before the server's
    reply, and still ends the command once it runs; it never reaches the slot while the
    server is in it for the spawn (the server, and every sandbox, would die with it)."""
    from metasched.runtime.process.run import run_process, start_process

    marker = f"{60 + os.getpid() % 1000 / 1000:.3f}"

    sandboxes.attach(asyncio.get_running_loop())
    sb = sandboxes.open("t1", size_mb=64, template=None, network=False)
    await sb.ready
    proc = start_process(["sleep", marker], cores=[0], timeout_s=60, sandboxes=sandboxes,
                         sandbox=sb, cwd_root="/tmp")
    assert proc.pid is None
    proc.abandon()
    for _ in range(100):  # the reply comes, the kill follows it
        await asyncio.sleep(0.02)
        if proc.pid is not None and not _sleeping(marker):
            break
    after = await run_process(["/bin/echo", "next"], cores=[0], timeout_s=30,
                              sandboxes=sandboxes, sandbox=sb, cwd_root="/tmp")
    pid, left, running = proc.pid, _sleeping(marker), sb.running
    server_alive = sandboxes.server.alive
    assert server_alive and after.ok and after.stdout == "next\n"
    assert pid is not None and left == [] and running == 0
