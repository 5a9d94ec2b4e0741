"""The E2B-compatible API (/e2b) driven by the unmodified ``e2b`` SDK against a real
metasched-serve on 127.0.0.1: many sandboxes at once, each an agent loop of commands
and file writes and reads; a background process killed; a sandbox timeout expiring;
path sandboxes; API keys and access tokens. After each sandbox ends nothing of it
is left: no trajectory, no sandbox (its namespaces and tmpfs workspace), no process."""

from __future__ import annotations

import asyncio
import os
import time
import uuid

import httpx
import pytest

e2b = pytest.importorskip("e2b")

from metasched.runtime.dispatch import DispatcherConfig  # noqa: E402
from metasched.serve import ServeConfig  # noqa: E402
from tests.serve_helpers import serving  # noqa: E402

TOKEN_A, TOKEN_B = "a" * 16 + "-client-token", "b" * 16 + "-client-token"


@pytest.fixture(scope="module")
def served():
    with serving(DispatcherConfig(scheduler="elastic_greedy")) as srv:
        yield srv


def opts(srv, key: str = "unused", **more) -> dict:
    """Where the SDK goes: the service's /e2b for both URLs (E2B_API_URL and
    E2B_SANDBOX_URL as arguments)."""
    return {"api_url": f"{srv.url}/e2b", "sandbox_url": f"{srv.url}/e2b", "api_key": key,
            **more}


def processes_with(marker: str) -> list[int]:
    """Pids of this machine's processes whose command line holds ``marker``."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(pid))
            except OSError:
                pass
    return found


def sandbox_pid(srv, sandbox_id: str) -> int | None:
    """The init pid of the sandbox's namespaces (which hold its tmpfs workspace)."""
    sandboxes = srv.dispatcher.sandboxes
    box = sandboxes.get(f"e2b-{sandbox_id}") if sandboxes is not None else None
    return box.init_pid if box is not None else None


def wait_gone(srv, sandbox_id: str, init_pid: int | None, marker: str | None = None,
              within_s: float = 20.0) -> None:
    """Wait until nothing of the sandbox is left (or fail saying what is)."""
    deadline = time.monotonic() + within_s
    while True:
        left = []
        if f"e2b-{sandbox_id}" in srv.dispatcher.trajectories.by_name:
            left.append("its trajectory")
        if sandbox_pid(srv, sandbox_id) is not None:
            left.append("its sandbox")
        if init_pid is not None and os.path.exists(f"/proc/{init_pid}"):
            left.append(f"its namespaces' init ({init_pid})")
        if marker is not None and processes_with(marker):
            left.append(f"processes {processes_with(marker)}")
        if not left:
            return
        assert time.monotonic() < deadline, f"sandbox {sandbox_id}: {', '.join(left)} left"
        time.sleep(0.1)


async def agent_loop(srv, turns: int) -> tuple[str, int | None]:
    """One sandbox, ``turns`` turns of a command, a file write and a read; its id and
    its init pid (before it is killed)."""
    # Calls wait their turn in the dispatcher's queue (shortest first): on a busy
    # machine, longer than the SDK's default 60 s.
    sb = await e2b.AsyncSandbox.create(timeout=1200, envs={"AGENT": "x"},
                                       **opts(srv, request_timeout=600))
    for turn in range(turns):
        r = await sb.commands.run(f"echo $AGENT-{turn} > out-{turn}.txt && cat out-{turn}.txt"
                                  f" && ls notes 2>/dev/null | wc -l", timeout=600)
        assert r.exit_code == 0 and r.stdout.split() == [f"x-{turn}", str(turn)], r
        await sb.files.write(f"notes/{turn}.txt", f"turn {turn}\n" * (turn + 1))
        assert await sb.files.read(f"notes/{turn}.txt") == f"turn {turn}\n" * (turn + 1)
        assert await sb.files.read(f"out-{turn}.txt") == f"x-{turn}\n"
    names = sorted(e.name for e in await sb.files.list("notes"))
    assert names == sorted(f"{t}.txt" for t in range(turns))
    init_pid = sandbox_pid(srv, sb.sandbox_id)
    await sb.kill()
    return sb.sandbox_id, init_pid


@pytest.mark.parametrize("n_sandboxes,turns", [
    (4, 5),
    pytest.param(16, 20, marks=pytest.mark.slow),
])
async def test_sandboxes_run_agent_loops_and_leave_nothing(served, n_sandboxes, turns):
    t0 = time.perf_counter()
    done = await asyncio.gather(*(agent_loop(served, turns) for _ in range(n_sandboxes)))
    elapsed = time.perf_counter() - t0
    assert len({sid for sid, _ in done}) == n_sandboxes
    for sid, init_pid in done:
        await asyncio.to_thread(wait_gone, served, sid, init_pid)
    assert not await e2b.AsyncSandbox.list(**opts(served)).next_items()
    print(f"{n_sandboxes} sandboxes x {turns} turns: {elapsed:.1f} s")


def test_background_process_is_listed_and_killed(served):
    marker = f"marker-{uuid.uuid4().hex}"
    sb = e2b.Sandbox.create(**opts(served))
    handle = sb.commands.run(f"sleep 300 # {marker}", background=True, timeout=0)
    assert [p.pid for p in sb.commands.list()] == [handle.pid]
    deadline = time.monotonic() + 10
    while not processes_with(marker):
        assert time.monotonic() < deadline, "the background process never started"
        time.sleep(0.05)
    assert handle.kill()
    with pytest.raises(e2b.CommandExitException):
        handle.wait()
    assert not processes_with(marker)
    assert sb.commands.list() == []
    assert not sb.commands.kill(handle.pid)  # gone: nothing to kill
    assert sb.commands.run("echo still here").stdout == "still here\n"
    init_pid = sandbox_pid(served, sb.sandbox_id)
    sb.kill()
    wait_gone(served, sb.sandbox_id, init_pid, marker)


@pytest.mark.parametrize("stdin", [False, True])
def test_process_in_a_subdirectory_streams_and_is_killed(served, stdin):
    sb = e2b.Sandbox.create(**opts(served))
    sb.files.make_dir("sub")
    handle = sb.commands.run("pwd; sleep 300", background=True, cwd="/home/user/sub",
                             stdin=stdin, timeout=0)
    lines = []
    for stdout, _, _ in handle:
        lines.append(stdout)
        break
    assert lines[0].rstrip().endswith("/sub")
    t0 = time.monotonic()
    assert handle.kill()
    assert time.monotonic() - t0 < 10
    with pytest.raises(e2b.CommandExitException):
        handle.wait()
    sb.kill()


def test_a_create_not_served_in_time_is_refused_and_never_served_late(served, monkeypatch):
    from metasched.serve.e2b import sandboxes

    monkeypatch.setattr(sandboxes, "CREATE_S", 0.001)  # no sandbox starts that fast
    t0 = time.monotonic()
    with pytest.raises(e2b.ServiceBusyException, match="could not be created within"):
        e2b.Sandbox.create(**opts(served))
    assert time.monotonic() - t0 < 5
    time.sleep(1)  # its first command, had it run, would have finished by now
    assert e2b.Sandbox.list(**opts(served)).next_items() == []
    monkeypatch.undo()
    e2b.Sandbox.create(**opts(served)).kill()  # the next one is served


@pytest.mark.parametrize("cwd", ["/etc", "..", "/home/user/../..", "~/../x", "/home"])
def test_cwd_outside_the_workspace_is_refused(served, cwd):
    sb = e2b.Sandbox.create(**opts(served))
    with pytest.raises(e2b.InvalidArgumentException, match="outside the sandbox's workspace"):
        sb.commands.run("pwd", cwd=cwd)
    assert sb.commands.run("pwd", cwd="~/.").stdout.strip()  # inside: runs
    sb.kill()


@pytest.mark.parametrize("stdin", [False, True])
def test_cwd_through_a_link_out_is_refused(served, stdin):
    sb = e2b.Sandbox.create(**opts(served))
    sb.commands.run("ln -s / out")
    with pytest.raises(e2b.CommandExitException) as info:
        sb.commands.run("pwd", cwd="out/etc", stdin=stdin)
    assert "leads outside the sandbox's workspace" in info.value.stderr
    sb.kill()


def test_stdin_reaches_a_background_process(served):
    sb = e2b.Sandbox.create(**opts(served))
    handle = sb.commands.run("cat", background=True, stdin=True)
    sb.commands.send_stdin(handle.pid, "hello ")
    sb.commands.send_stdin(handle.pid, "world")
    sb.commands.close_stdin(handle.pid)
    assert handle.wait().stdout == "hello world"
    sb.kill()


def test_output_streams_while_the_command_runs(served):
    sb = e2b.Sandbox.create(**opts(served))
    seen: list[tuple[float, str, str]] = []
    r = sb.commands.run("echo first; echo warn >&2; sleep 2; echo second",
                        on_stdout=lambda s: seen.append((time.monotonic(), "out", s)),
                        on_stderr=lambda s: seen.append((time.monotonic(), "err", s)))
    ended = time.monotonic()
    assert (r.exit_code, r.stdout, r.stderr) == (0, "first\nsecond\n", "warn\n")
    first = next(t for t, kind, text in seen if kind == "out" and "first" in text)
    assert ended - first >= 1.0, seen  # the first line came long before the end
    assert "".join(t for _, k, t in seen if k == "out") == r.stdout
    # a background process's output, read by iterating its handle
    handle = sb.commands.run("for i in 1 2 3; do echo line $i; sleep 0.3; done; echo e >&2",
                             background=True)
    out, err, times = [], [], []
    for stdout, stderr, _ in handle:
        times.append(time.monotonic())
        out.append(stdout or "")
        err.append(stderr or "")
    assert ("".join(out), "".join(err)) == ("line 1\nline 2\nline 3\n", "e\n")
    assert times[-1] - times[0] >= 0.4, times  # pieces as they came, not all at the end
    assert handle.wait().stdout == "line 1\nline 2\nline 3\n"
    # another client's stream of a running process: its output from then on
    handle = sb.commands.run("echo a; sleep 1; echo b", background=True)
    joined = sb.commands.connect(handle.pid)
    assert joined.wait().stdout.endswith("b\n") and handle.wait().stdout == "a\nb\n"
    sb.kill()


def test_output_past_tail_bytes_arrives_whole(served):
    sb = e2b.Sandbox.create(**opts(served))
    tail = served.dispatcher.config.tail_bytes
    chunks: list[str] = []
    r = sb.commands.run("seq 1 60000; seq 1 30000 >&2", on_stdout=chunks.append)
    expected = "".join(f"{i}\n" for i in range(1, 60001))
    assert len(expected) > 50 * tail
    assert r.stdout == expected and "".join(chunks) == expected
    assert r.stderr == "".join(f"{i}\n" for i in range(1, 30001))
    # the first process's output files are removed (the listing's own are there)
    assert sb.commands.run("ls -A .e2b").stdout.split() == ["1001.err", "1001.out"]
    sb.kill()


def test_output_comes_at_the_end_without_a_view_of_the_workspace():
    """Without sandboxes (isolation none: no workspace the service can see) a
    command's output still arrives, with its end."""
    config = DispatcherConfig(scheduler="elastic_greedy", sandbox={"isolation": "none"})
    with serving(config) as srv:
        sb = e2b.Sandbox.create(**opts(srv))
        assert sandbox_pid(srv, sb.sandbox_id) is None  # no namespaces to look into
        chunks: list[str] = []
        r = sb.commands.run("echo one; echo two >&2", on_stdout=chunks.append)
        assert (r.stdout, r.stderr, "".join(chunks)) == ("one\n", "two\n", "one\n")
        sb.kill()


@pytest.mark.parametrize("planted", ["file", "dir"])
def test_output_files_never_lead_out_of_the_workspace(served, planted, tmp_path):
    """A command that puts a symbolic link in place of the next process's output file
    (or of the control directory) gets nothing of the host's file at that path."""
    secret = "host-secret-" + uuid.uuid4().hex
    (tmp_path / "1001.out").write_text(secret)
    sb = e2b.Sandbox.create(**opts(served))
    if planted == "file":
        sb.commands.run(f"ln -s {tmp_path}/1001.out .e2b/1001.out")
    else:
        sb.commands.run(f"mkdir -p {tmp_path} && rm -rf .e2b && ln -s {tmp_path} .e2b")
    seen: list[str] = []
    try:
        r = sb.commands.run("echo inside", on_stdout=seen.append)
        got = r.stdout + r.stderr
    except e2b.CommandExitException as e:
        got = e.stdout + e.stderr
    assert secret not in got + "".join(seen)
    assert (tmp_path / "1001.out").read_text() == secret
    sb.kill()


def test_timeout_ends_the_sandbox_and_its_processes(served):
    marker = f"marker-{uuid.uuid4().hex}"
    sb = e2b.Sandbox.create(timeout=3, **opts(served))
    sb.commands.run(f"sleep 300 # {marker}", background=True, timeout=0)
    sb.files.write("kept.txt", "x")
    init_pid = sandbox_pid(served, sb.sandbox_id)
    assert init_pid is None or os.path.exists(f"/proc/{init_pid}")
    sb.set_timeout(4)  # from now: later than the first
    time.sleep(2.5)
    assert sb.is_running() or sb.files.read("kept.txt") == "x"
    wait_gone(served, sb.sandbox_id, init_pid, marker, within_s=15)
    with pytest.raises(e2b.SandboxException):
        e2b.Sandbox.connect(sb.sandbox_id, **opts(served))
    with pytest.raises(e2b.SandboxException):
        sb.commands.run("true")


def test_idle_sandbox_ends_after_the_trajectory_idle_time():
    with serving(DispatcherConfig(scheduler="elastic_greedy", trajectory_idle_s=1.0),
                 ServeConfig(languages=[])) as srv:
        sb = e2b.Sandbox.create(timeout=600, **opts(srv))
        sb.files.write("kept.txt", "x")
        init_pid = sandbox_pid(srv, sb.sandbox_id)
        wait_gone(srv, sb.sandbox_id, init_pid, within_s=15)
        assert not e2b.Sandbox.list(**opts(srv)).next_items()
        with pytest.raises(e2b.SandboxException):
            sb.files.read("kept.txt")


@pytest.mark.parametrize("path", [
    "../outside.txt", "/etc/passwd", "notes/../../outside.txt", "link/passwd",
    "/home/user/../../etc/passwd"])
def test_paths_stay_in_the_workspace(served, path):
    sb = e2b.Sandbox.create(**opts(served))
    sb.commands.run("mkdir -p notes && ln -s /etc link")
    with pytest.raises(e2b.SandboxException, match="outside the sandbox's workspace"):
        sb.files.read(path)
    with pytest.raises(e2b.SandboxException, match="outside the sandbox's workspace"):
        sb.files.write(path, "escaped")
    with pytest.raises(e2b.SandboxException, match="outside the sandbox's workspace"):
        sb.files.remove(path)
    assert sb.commands.run("cat /etc/hostname >/dev/null; ls").stdout.split() == [
        "link", "notes"]
    sb.kill()


def test_files_round_trip_binary_and_large(served):
    sb = e2b.Sandbox.create(**opts(served))
    blob = os.urandom(20_000)  # past one read's piece (tail_bytes): several pieces
    sb.files.write("/home/user/data/blob.bin", blob)
    assert bytes(sb.files.read("data/blob.bin", format="bytes")) == blob
    info = sb.files.get_info("data/blob.bin")
    assert info.size == len(blob) and info.type.value == "file"
    assert sb.files.make_dir("data/sub") and not sb.files.make_dir("data/sub")
    sb.files.rename("data/blob.bin", "data/sub/moved.bin")
    assert [e.name for e in sb.files.list("data", depth=2)] == ["sub", "moved.bin"]
    sb.files.remove("data")
    assert not sb.files.exists("data")
    with pytest.raises(e2b.NotFoundException):
        sb.files.read("missing.txt")
    sb.kill()


def test_pause_is_refused_with_a_reason_and_info_answers(served):
    sb = e2b.Sandbox.create(**opts(served))
    with pytest.raises(e2b.SandboxException, match="not supported"):
        sb.pause()
    assert sb.get_metrics() == []
    assert sb.get_info().metadata == {} and sb.get_info().cpu_count == 1
    sb.kill()


def test_api_keys_and_access_tokens():
    config = ServeConfig(languages=[], tokens={"a": TOKEN_A, "b": TOKEN_B})
    with serving(DispatcherConfig(scheduler="elastic_greedy"), config) as srv:
        with pytest.raises(e2b.AuthenticationException):
            e2b.Sandbox.create(**opts(srv, "wrong-key-000000000"))
        sb = e2b.Sandbox.create(**opts(srv, TOKEN_A))
        assert sb.commands.run("echo ok").stdout == "ok\n"
        # another client neither sees nor reaches it
        assert [s.sandbox_id for s in e2b.Sandbox.list(**opts(srv, TOKEN_A)).next_items()] \
            == [sb.sandbox_id]
        assert not e2b.Sandbox.list(**opts(srv, TOKEN_B)).next_items()
        with pytest.raises(e2b.SandboxException):
            e2b.Sandbox.connect(sb.sandbox_id, **opts(srv, TOKEN_B))
        assert not e2b.Sandbox.kill(sb.sandbox_id, **opts(srv, TOKEN_B))
        # nor through the native API, into its trajectory
        r = httpx.post(f"{srv.url}/v1/actions", headers={"Authorization": f"Bearer {TOKEN_B}"},
                       json={"kind": "cpu", "argv": ["true"],
                             "trajectory": f"e2b-{sb.sandbox_id}"}, timeout=30)
        assert r.status_code == 403, r.text
        # in-sandbox calls without its access token are refused
        stranger = e2b.Sandbox(sandbox_id=sb.sandbox_id, sandbox_domain=None,
                               envd_version=sb._envd_version, envd_access_token="guess",
                               connection_config=e2b.ConnectionConfig(
                                   extra_sandbox_headers={"E2b-Sandbox-Id": sb.sandbox_id,
                                                          "X-Access-Token": "guess"},
                                   **opts(srv, TOKEN_B)))
        with pytest.raises(e2b.SandboxException):
            stranger.commands.run("echo in")
        with pytest.raises(e2b.SandboxException):
            stranger.files.read("x")
        sb.kill()


def test_example_script_runs_against_the_service(served):
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).parent.parent / "examples" / "e2b_sandbox.py"
    env = {**os.environ, "E2B_API_URL": f"{served.url}/e2b",
           "E2B_SANDBOX_URL": f"{served.url}/e2b", "E2B_API_KEY": "unused"}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "turn 2: exit 0, stdout 'turn 2 done', file 'hello 2'" in out.stdout
    assert "killed: True" in out.stdout and out.stdout.rstrip().endswith("killed")


def test_a_client_at_its_command_cap_is_refused_and_others_are_not():
    config = ServeConfig(languages=[], tokens={"a": TOKEN_A, "b": TOKEN_B}, client_commands=2)
    with serving(DispatcherConfig(scheduler="elastic_greedy"), config) as srv:
        a = e2b.Sandbox.create(**opts(srv, TOKEN_A))
        held = [a.commands.run("sleep 300", background=True, timeout=0) for _ in range(2)]
        with pytest.raises(e2b.SandboxException, match="2 commands running.*client_commands"):
            a.commands.run("echo over", background=True)
        b = e2b.Sandbox.create(**opts(srv, TOKEN_B))
        assert b.commands.run("echo ok").stdout == "ok\n"  # another client's share
        held[0].kill()
        with pytest.raises(e2b.CommandExitException):
            held[0].wait()
        assert a.commands.run("echo again").stdout == "again\n"  # below its cap again
        a.kill()
        b.kill()


def test_a_download_over_max_file_mb_is_refused_in_one_line():
    config = ServeConfig(languages=[], max_file_mb=1.0)
    with serving(DispatcherConfig(scheduler="elastic_greedy", tail_bytes=65536), config) as srv:
        sb = e2b.Sandbox.create(**opts(srv))
        sb.commands.run("head -c 3000000 /dev/zero > big; head -c 900000 /dev/zero > small")
        with pytest.raises(e2b.SandboxException, match=r"'big' holds 3000000 bytes, more "
                           r"than a download may \(1048576: max_file_mb\)"):
            sb.files.read("big", format="bytes")
        # under the cap: streamed in pieces of under 64 KiB, whole
        assert sb.files.read("small", format="bytes") == bytes(900000)
        sb.kill()
