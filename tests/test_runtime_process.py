"""The CPU executor: real subprocesses, pinned, limited, timed out, cancelled, cleaned up."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

from metasched.runtime.outcome import Outcome
from metasched.runtime.process import (
    THREAD_ENV_VARS,
    kill_group,
    limits,
    run_process,
    start_process,
    workdir,
)
from metasched.runtime.process.child import Tail
from metasched.runtime.process.fd_watch import FdWatch

PY = sys.executable
CPUS = sorted(os.sched_getaffinity(0))


def run(argv: list[str], **kwargs) -> Outcome:
    kwargs.setdefault("cores", CPUS[:1])
    kwargs.setdefault("timeout_s", 10.0)
    return asyncio.run(run_process(argv, **kwargs))


def py(code: str) -> list[str]:
    return [PY, "-c", textwrap.dedent(code)]


def gone(pid: int) -> bool:
    """The process no longer runs (it may linger as a zombie of an init that does not
    reap, which is dead all the same)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def wait_gone(pid: int, within_s: float = 2.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if gone(pid):
            return True
        time.sleep(0.01)
    return gone(pid)


def open_fds() -> int:
    """Descriptors open now, once finished event loops are collected (each loop that
    ran commands holds one epoll set for their pipes and pidfds until then)."""
    gc.collect()
    return len(os.listdir("/proc/self/fd"))


def start_ticks(stat: str) -> int:
    """A /proc stat line's start time, in clock ticks since boot."""
    return int(stat.rsplit(")", 1)[1].split()[19])


def ticks_now() -> int:
    """Now, on the clock /proc's start times count (a new thread's own start time, so
    a container's virtual uptime cannot skew it)."""
    box: list[int] = []
    thread = threading.Thread(
        target=lambda: box.append(start_ticks(Path("/proc/thread-self/stat").read_text())))
    thread.start()
    thread.join()
    return box[0]


def my_zombies(born_since: int = 0) -> list[int]:
    """Children of this process that exited and were never reaped, started at or after
    ``born_since`` (clock ticks since boot): a child an earlier test left running may
    exit, unreaped, during a later test, and is not that test's leak."""
    me = os.getpid()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] == "Z" and int(fields[1]) == me and start_ticks(stat) >= born_since:
            out.append(int(name))
    return out


@pytest.fixture(params=["prlimit", "preexec"])
def limits_path(request, monkeypatch):
    """Run a test through both ways of setting rlimits: the prlimit(1) launcher and, where
    it is missing, a preexec_fn (fork)."""
    if request.param == "prlimit":
        if limits.prlimit_launcher() is None:
            pytest.skip("no util-linux prlimit")
    else:
        monkeypatch.setattr(limits, "_prlimit_checked", True)
        monkeypatch.setattr(limits, "_prlimit_path", None)
    return request.param


def test_success_keeps_the_stdout_tail(tmp_path):
    out = run(py("print('x' * 10000); print('end')"), tail_bytes=100, cwd_root=str(tmp_path))
    assert out.ok and out.reason == "" and out.exit_code == 0
    assert out.stdout == "x" * 95 + "\nend\n"
    assert out.stderr == ""
    assert out.detail == {"pid": out.detail["pid"], "cores": CPUS[:1]}
    assert isinstance(out.detail["pid"], int)


@pytest.mark.parametrize(("argv", "reason", "code"), [
    (["/bin/false"], "exit code 1", 1),
    (py("import sys; print('oops', file=sys.stderr); sys.exit(3)"), "exit code 3", 3),
])
def test_nonzero_exit(argv, reason, code):
    out = run(argv)
    assert not out.ok and out.reason == reason and out.exit_code == code
    if code == 3:
        assert out.stderr == "oops\n"


@pytest.mark.parametrize("sig", [signal.SIGSEGV, signal.SIGTERM, signal.SIGABRT])
def test_death_by_signal(sig):
    out = run(py(f"import os, signal; os.kill(os.getpid(), {int(sig)})"))
    assert not out.ok
    assert out.reason == f"killed by {sig.name}" and out.exit_code == -sig


def test_timeout_kills_the_whole_group(tmp_path):
    # The child starts a grandchild in its own group (the default) and waits on it.
    code = """
        import subprocess, sys, time
        g = subprocess.Popen(["sleep", "60"])
        print(g.pid, flush=True)
        time.sleep(60)
    """
    t0 = time.monotonic()
    out = run(py(code), timeout_s=1.0, cwd_root=str(tmp_path))
    elapsed = time.monotonic() - t0
    assert not out.ok and out.reason == "timeout after 1 s" and out.exit_code == -9
    assert elapsed < 3.0
    grandchild = int(out.stdout.split()[0])
    assert wait_gone(grandchild)
    assert gone(out.detail["pid"])
    assert list(tmp_path.iterdir()) == []


def test_leftovers_of_the_group_are_killed_when_the_main_process_exits():
    out = run(py("""
        import subprocess
        g = subprocess.Popen(["sleep", "60"], stdout=subprocess.DEVNULL)
        print(g.pid)
    """), timeout_s=5.0)
    assert out.ok
    assert wait_gone(int(out.stdout))


@pytest.mark.parametrize("limit_mb", [300, 500])
def test_memory_limit_python_memory_error(limits_path, limit_mb):
    out = run(py("b = bytearray(2 * 1024**3)"), mem_limit_mb=limit_mb)
    assert not out.ok and out.reason == f"memory limit exceeded ({limit_mb} MB)"
    assert out.exit_code == 1 and "MemoryError" in out.stderr


def test_memory_limit_leaves_room_for_python_itself():
    # The limit is on address space: a normal Python child runs fine under it.
    out = run(py("b = bytearray(100 * 1024**2); print(len(b))"), mem_limit_mb=400)
    assert out.ok and out.stdout == f"{100 * 1024**2}\n"


def test_memory_limit_growth_without_a_message():
    # Touches memory until an allocation fails, then exits quietly: recognised by its
    # peak resident set near the limit.
    out = run(py("""
        import os
        chunks = []
        try:
            while True:
                chunks.append(bytearray(8 * 1024**2))
        except MemoryError:
            os._exit(1)
    """), mem_limit_mb=300)
    assert out.reason == "memory limit exceeded (300 MB)" and out.stderr == ""


def test_memory_limit_of_the_group_is_watched():
    # Three forked workers of ~150 MB each: every one is under RLIMIT_AS (300 MB), the
    # group is not, and the watchdog kills it.
    out = run(py("""
        import os, time
        for _ in range(3):
            if os.fork() == 0:
                b = bytearray(150 * 1024**2)
                time.sleep(30)
                os._exit(0)
        time.sleep(30)
    """), mem_limit_mb=300, timeout_s=20.0)
    assert out.reason == "memory limit exceeded (300 MB)" and out.exit_code == -9


C_SOURCES = {
    "grow": r"""
        #include <stdlib.h>
        #include <string.h>
        int main(void) {
            for (;;) {
                char *p = malloc(8 << 20);
                if (!p) return 1;
                memset(p, 1, 8 << 20);
            }
        }""",
    "huge": r"""
        #include <errno.h>
        #include <stdio.h>
        #include <stdlib.h>
        #include <string.h>
        int main(void) {
            char *p = malloc((size_t)2 << 30);
            if (!p) { fprintf(stderr, "malloc: %s\n", strerror(errno)); return 2; }
            return 0;
        }""",
}


@pytest.mark.parametrize("program", sorted(C_SOURCES))
def test_memory_limit_c_malloc_failure(limits_path, tmp_path, program):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    src, exe = tmp_path / f"{program}.c", tmp_path / program
    src.write_text(textwrap.dedent(C_SOURCES[program]))
    subprocess.run([cc, "-O0", "-o", str(exe), str(src)], check=True)
    out = run([str(exe)], mem_limit_mb=200)
    assert not out.ok and out.reason == "memory limit exceeded (200 MB)"


def test_rlimits_are_in_place_when_the_program_starts(limits_path):
    code = """
        import resource as r, sys
        print(sys.argv[0], [r.getrlimit(x) for x in (r.RLIMIT_AS, r.RLIMIT_CPU, r.RLIMIT_CORE)])
    """
    out = run([PY, "-c", textwrap.dedent(code), "--", "-x"], mem_limit_mb=512, cpu_time_s=2.5)
    assert out.ok, out
    mib = 512 * 1024**2
    assert out.stdout == f"-c [({mib}, {mib}), (3, 4), (0, 0)]\n"


@pytest.mark.parametrize(("make_argv", "why"), [
    (lambda tmp: ["metasched-no-such-program"], "metasched-no-such-program: command not found"),
    (lambda tmp: [str(tmp)], "Permission denied"),
])
def test_cannot_start_under_limits(limits_path, tmp_path, make_argv, why):
    out = run(make_argv(tmp_path), mem_limit_mb=300)
    assert out.reason == f"cannot start: {why}"


def test_failures_without_a_memory_limit_are_not_blamed_on_memory():
    out = run(py("import sys; print('MemoryError', file=sys.stderr); sys.exit(1)"))
    assert out.reason == "exit code 1"


@pytest.mark.parametrize("ignore_sigxcpu", [False, True])
def test_cpu_time_limit(limits_path, ignore_sigxcpu):
    # Soft limit 1 s (0.3 rounded up) raises SIGXCPU; ignoring it meets the hard limit
    # (2 s) and SIGKILL. Both are the CPU limit.
    prelude = "import signal; signal.signal(signal.SIGXCPU, signal.SIG_IGN)\n"
    code = (prelude if ignore_sigxcpu else "") + "while True: pass"
    t0 = time.monotonic()
    out = run([PY, "-c", code], cpu_time_s=0.3, timeout_s=60.0)
    assert out.reason == "cpu time limit exceeded"
    assert out.exit_code == (-signal.SIGKILL if ignore_sigxcpu else -signal.SIGXCPU)
    assert time.monotonic() - t0 < 30  # CPU seconds, so slower on a busy machine


@pytest.mark.parametrize("cores", [[0], [1], [0, 1]], ids=str)
def test_child_runs_on_exactly_the_granted_cores(cores):
    if not set(cores) <= set(CPUS):
        pytest.skip(f"needs cpus {cores}")
    before = os.sched_getaffinity(0)
    out = run(py("import os; print(sorted(os.sched_getaffinity(0)))"), cores=cores)
    assert out.ok and json.loads(out.stdout) == cores
    assert out.detail["cores"] == cores
    # The event-loop thread pinned itself only around the spawn.
    assert os.sched_getaffinity(0) == before


def test_child_has_null_stdin_its_own_session_and_no_other_descriptors():
    # An inheritable descriptor of this process (another action's pipe, say) must not
    # reach the child: it would hold that pipe open for as long as it runs.
    r, w = os.pipe()
    high = os.dup2(w, 100, inheritable=True)
    try:
        out = run(py("""
            import json, os, sys
            print(json.dumps({"stdin": os.readlink("/proc/self/fd/0"), "read": sys.stdin.read(),
                              "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
                              "ids": [os.getpid(), os.getpgid(0), os.getsid(0)]}))
        """))
    finally:
        for fd in (r, w, high):
            os.close(fd)
    assert out.ok, out
    info = json.loads(out.stdout)
    assert info["stdin"] == "/dev/null" and info["read"] == ""
    # 0-2, and the descriptor listdir opened to list them.
    assert info["fds"] == [0, 1, 2, 3]
    assert info["ids"] == [out.detail["pid"]] * 3  # leads its own session and group


@pytest.mark.parametrize("cores", [[0], [0, 1]], ids=str)
def test_thread_variables_equal_the_core_count(cores):
    if not set(cores) <= set(CPUS):
        pytest.skip(f"needs cpus {cores}")
    names = ["OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
             "NUMEXPR_NUM_THREADS", "TORCH_NUM_THREADS", "VECLIB_MAXIMUM_THREADS"]
    assert set(names) <= set(THREAD_ENV_VARS)
    names_literal = repr(list(THREAD_ENV_VARS))
    code = f"import json, os; print(json.dumps({{k: os.environ.get(k) for k in {names_literal}}}))"
    # extra_env cannot undo them: the core count is what the action was granted.
    out = run([PY, "-c", code], cores=cores, extra_env={"OMP_NUM_THREADS": "64"})
    assert out.ok
    assert json.loads(out.stdout) == {k: str(len(cores)) for k in THREAD_ENV_VARS}


def test_own_temporary_working_directory_removed_afterwards(tmp_path):
    # The command leaves files and a directory it made unreadable and unwritable.
    out = run(py("""
        import os
        print(os.getcwd())
        os.makedirs("a/b")
        open("a/b/f", "w").write("x")
        os.chmod("a/b", 0)
        os.chmod("a", 0o500)
    """), cwd_root=str(tmp_path))
    assert out.ok
    cwd = Path(out.stdout.strip())
    assert cwd.parent == tmp_path and cwd.name.startswith("metasched-")
    assert not cwd.exists() and list(tmp_path.iterdir()) == []


def test_each_run_gets_a_fresh_directory(tmp_path):
    async def both() -> list[Outcome]:
        argv = py("import os; print(os.getcwd(), os.listdir('.'))")
        return await asyncio.gather(*(run_process(argv, cores=CPUS[:1], timeout_s=10,
                                                  cwd_root=str(tmp_path)) for _ in range(2)))
    first, second = asyncio.run(both())
    assert first.stdout != second.stdout and "[]" in first.stdout and "[]" in second.stdout


def test_environment_inherited_or_exactly_given(monkeypatch):
    monkeypatch.setenv("METASCHED_PROCESS_TEST", "inherited")
    dump = py("import json, os; print(json.dumps(dict(os.environ)))")

    inherited = json.loads(run(dump).stdout)
    assert inherited["METASCHED_PROCESS_TEST"] == "inherited"
    assert inherited["PATH"] == os.environ["PATH"]

    empty = json.loads(run(dump, env={}).stdout)
    # CPython may add LC_CTYPE when it coerces the C locale.
    assert set(empty) - {"LC_CTYPE"} == {"PATH", *THREAD_ENV_VARS}
    assert empty["PATH"] == os.environ["PATH"]

    given = json.loads(run(dump, env={"PATH": "/usr/bin:/bin", "A": "1"},
                           extra_env={"B": "é"}).stdout)
    assert given["PATH"] == "/usr/bin:/bin" and given["A"] == "1" and given["B"] == "é"
    assert "METASCHED_PROCESS_TEST" not in given


def test_a_command_printing_10_mb_keeps_only_the_tail():
    code = """
        import sys
        chunk = b"y" * (1 << 20)
        for _ in range(10):
            sys.stdout.buffer.write(chunk)
            sys.stderr.buffer.write(chunk)
        sys.stdout.buffer.write(b"STDOUT-END")
        sys.stderr.buffer.write(b"STDERR-END")
    """
    tracemalloc.start()
    try:
        out = run(py(code), tail_bytes=4096)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out.ok
    assert len(out.stdout) == 4096 and out.stdout.endswith("y" * 10 + "STDOUT-END")
    assert len(out.stderr) == 4096 and out.stderr.endswith("STDERR-END")
    assert peak < 2 * 1024**2  # 20 MB went through the pipes, not into memory


@pytest.mark.parametrize("tail_bytes", [0, 1, 5, 6, 100])
def test_tail_buffer_is_bounded(tail_bytes):
    tail = Tail(tail_bytes)
    data = b""
    for chunk in (b"ab", b"cdefg", b"", b"h" * 50, b"ij"):
        tail.feed(chunk)
        data += chunk
        assert bytes(tail.buf) == (data[-tail_bytes:] if tail_bytes else b"")


def test_invalid_utf8_is_replaced():
    out = run(py("import sys; sys.stdout.buffer.write(b'ok\\xff\\xfe')"))
    assert out.ok and out.stdout == "ok\ufffd\ufffd"


def not_executable(tmp_path: Path) -> list[str]:
    path = tmp_path / "script.sh"
    path.write_text("#!/bin/sh\necho hi\n")
    path.chmod(0o644)
    return [str(path)]


@pytest.mark.parametrize(("make_argv", "why"), [
    (lambda tmp: ["/nonexistent/program"], "No such file or directory"),
    (lambda tmp: ["metasched-no-such-program"], "metasched-no-such-program: command not found"),
    (not_executable, "Permission denied"),
    (lambda tmp: [], "empty argv"),
])
def test_cannot_start(tmp_path, make_argv, why):
    work = tmp_path / "work"
    work.mkdir()
    fds = open_fds()
    since = ticks_now()
    out = run(make_argv(tmp_path), cwd_root=str(work))
    assert out == Outcome(ok=False, reason=f"cannot start: {why}", detail={"cores": CPUS[:1]})
    assert open_fds() == fds and list(work.iterdir()) == [] and my_zombies(since) == []


def test_cannot_start_without_a_working_directory(tmp_path):
    out = run(["/bin/true"], cwd_root=str(tmp_path / "missing"))
    assert out.reason == "cannot start: No such file or directory"


def test_cannot_start_on_cores_the_machine_lacks():
    before = os.sched_getaffinity(0)
    out = run(["/bin/true"], cores=[4000])
    assert out.reason == "cannot start: Invalid argument"
    assert os.sched_getaffinity(0) == before


def test_cannot_start_with_a_bad_environment():
    out = run(["/bin/true"], env={"A=B": "1"})
    assert out.reason == "cannot start: illegal environment variable name"


def test_misuse_raises():
    with pytest.raises(TypeError):
        run("echo hi")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        run(["/bin/true"], cores=[])
    with pytest.raises(ValueError):
        run(["/bin/true"], timeout_s=0)


def test_cancellation_kills_the_group(tmp_path):
    pids_file = tmp_path / "pids"
    work = tmp_path / "work"
    work.mkdir()
    code = f"""
        import os, subprocess, time
        g = subprocess.Popen(["sleep", "60"])
        with open({str(pids_file)!r}, "w") as f:
            f.write(f"{{os.getpid()}} {{g.pid}}")
        time.sleep(60)
    """

    async def scenario() -> list[int]:
        task = asyncio.create_task(run_process(py(code), cores=CPUS[:1], timeout_s=30,
                                               cwd_root=str(work)))
        for _ in range(500):
            await asyncio.sleep(0.01)
            if pids_file.exists() and len(pids_file.read_text().split()) == 2:
                break
        pids = [int(p) for p in pids_file.read_text().split()]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return pids

    fds = open_fds()
    child, grandchild = asyncio.run(scenario())
    assert gone(child) and wait_gone(grandchild)
    assert child not in my_zombies()
    assert list(work.iterdir()) == [] and open_fds() == fds


def test_many_concurrent_runs_leak_nothing(tmp_path):
    cases = [
        (["/bin/true"], {}),
        (["/bin/false"], {}),
        (["/bin/echo", "hello"], {}),
        (["metasched-no-such-program"], {}),
        (["sleep", "5"], {"timeout_s": 0.2}),
        (py("b = bytearray(2 * 1024**3)"), {"mem_limit_mb": 300}),
    ]

    async def many() -> list[Outcome]:
        jobs = []
        for i in range(60):
            argv, extra = cases[i % len(cases)]
            kwargs = {"cores": [CPUS[i % len(CPUS)]], "timeout_s": 10.0,
                      "cwd_root": str(tmp_path), **extra}
            jobs.append(run_process(argv, **kwargs))
        return await asyncio.gather(*jobs)

    run(["/bin/true"])  # first-use allocations (e.g. asyncio's) are not leaks
    fds = open_fds()
    since = ticks_now()
    outs = asyncio.run(many())
    reasons = [o.reason for o in outs[:len(cases)]]
    assert reasons == ["", "exit code 1", "", "cannot start: metasched-no-such-program: "
                       "command not found",
                       "timeout after 0.2 s", "memory limit exceeded (300 MB)"]
    assert all(o.stdout == "hello\n" for o in outs[2::len(cases)])
    assert open_fds() == fds
    assert my_zombies(since) == []
    assert list(tmp_path.iterdir()) == []


def test_exit_is_noticed_without_pidfds(monkeypatch):
    # Old kernels (or seccomp profiles) refuse pidfd_open: a thread waits instead.
    since = ticks_now()

    def refuse(pid: int, flags: int = 0) -> int:
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(os, "pidfd_open", refuse)
    assert run(["/bin/echo", "hi"]).stdout == "hi\n"
    out = run(["sleep", "5"], timeout_s=0.2)
    assert out.reason == "timeout after 0.2 s" and gone(out.detail["pid"])
    assert my_zombies(since) == []


def test_kill_group():
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    kill_group(proc.pid)
    assert proc.wait(timeout=5) == -signal.SIGKILL
    kill_group(proc.pid)  # a group that is gone is fine
    with pytest.raises(ValueError):
        kill_group(0)  # would be this process's own group


def run_confined(argv: list[str], cgroups: str, **kwargs) -> Outcome:
    """``run`` on the host (no isolation) with the dispatcher's cgroup slots."""
    from metasched.runtime.sandbox.config import SandboxConfig
    from metasched.runtime.sandbox.manager import Sandboxes

    async def go() -> Outcome:
        sandboxes = Sandboxes(SandboxConfig(isolation="none", cgroups=cgroups))
        sandboxes.attach(asyncio.get_running_loop())
        try:
            kwargs.setdefault("cores", CPUS[:1])
            kwargs.setdefault("timeout_s", 10.0)
            return await run_process(argv, sandboxes=sandboxes, **kwargs)
        finally:
            await asyncio.sleep(0.05)  # the slot's release
            sandboxes.close()
    return asyncio.run(go())


@pytest.fixture
def cgroups_here():
    from metasched.runtime.sandbox import cgroups

    if os.geteuid() != 0:
        pytest.skip("cgroups need root here")
    missing = cgroups.discover("auto").missing
    if missing:
        pytest.skip(f"cgroup controllers unavailable: {missing}")


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two cores")
def test_host_command_in_a_cgroup_cannot_widen_its_cores(cgroups_here):
    out = run_confined(py("""
        import os
        os.sched_setaffinity(0, set(range(os.cpu_count())))
        print(sorted(os.sched_getaffinity(0)))
    """), "auto", cores=CPUS[1:2])
    assert out.ok and json.loads(out.stdout) == CPUS[1:2]
    # without cgroups, affinity alone: the command can widen it (the documented fallback)
    out = run_confined(py("""
        import os
        os.sched_setaffinity(0, set(range(os.cpu_count())))
        print(sorted(os.sched_getaffinity(0)))
    """), "none", cores=CPUS[1:2])
    assert out.ok and len(json.loads(out.stdout)) > 1


def test_host_command_in_a_cgroup_is_limited_as_a_whole(cgroups_here):
    workers = py("""
        import subprocess, sys
        code = "import time; b = b'x' * (100 << 20); time.sleep(5)"
        ps = [subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
              for _ in range(3)]
        print([p.wait() for p in ps])
    """)
    out = run_confined(workers, "auto", mem_limit_mb=200)
    assert not out.ok and out.reason == "memory limit exceeded (200 MB)", out
    forks = py("""
        import os, sys, time
        for _ in range(100):
            if os.fork() == 0:
                os.close(1), os.close(2)
                time.sleep(5)
                os._exit(0)
    """)
    out = run_confined(forks, "auto", pids_max=20)
    assert not out.ok and out.reason == "process limit exceeded (20)", out


def test_host_command_in_a_cgroup_leaves_no_daemon(cgroups_here, tmp_path):
    marker = f"left-{os.getpid()}-{id(tmp_path)}"
    out = run_confined(["/bin/sh", "-c", f"(setsid sh -c 'sleep 60; echo {marker}' "
                        "</dev/null >/dev/null 2>&1 &); sleep 0.2"], "auto")
    assert out.ok
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
    assert left.stdout.strip() == ""


def test_fd_watch_survives_a_failing_callback_and_releases_its_loop():
    """A callback that raises goes to the loop's exception handler and the others still
    run; a finished loop and its epoll set are released (nothing keeps the loop alive)."""
    seen: list[str] = []
    errors: list[dict] = []

    async def go() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
        watch = FdWatch.for_loop(loop)
        assert FdWatch.for_loop(loop) is watch  # one per loop
        pipes = [os.pipe(), os.pipe()]

        def boom() -> None:
            raise RuntimeError("boom")

        def read(fd: int) -> None:
            seen.append(os.read(fd, 10).decode())
            watch.remove(fd)

        watch.add(pipes[0][0], boom)
        watch.add(pipes[1][0], lambda: read(pipes[1][0]))
        for _, w in pipes:
            os.write(w, b"x")
        for _ in range(20):
            await asyncio.sleep(0.01)
            if seen and errors:
                break
        watch.remove(pipes[0][0])
        for r, w in pipes:
            os.close(r)
            os.close(w)

    fds = open_fds()
    asyncio.run(go())
    assert seen == ["x"]
    assert str(errors[0]["exception"]) == "boom"
    errors.clear()  # its traceback's frames refer to the loop
    assert open_fds() == fds and len(FdWatch._by_loop) == 0


def test_workdir_is_private_and_never_an_existing_one(tmp_path, monkeypatch):
    import itertools
    import stat

    monkeypatch.setattr(workdir, "_workdir_numbers", itertools.count(5))
    taken = tmp_path / f"metasched-{os.getpid()}-5"  # left by an earlier process
    taken.mkdir()
    (taken / "keep").write_text("x")
    path = Path(workdir.make_workdir(str(tmp_path)))
    assert path.name == f"metasched-{os.getpid()}-6" and list(path.iterdir()) == []
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    assert (taken / "keep").read_text() == "x"


def test_start_process_spawns_before_returning_and_waits_once(tmp_path):
    async def go() -> tuple[Outcome, str]:
        proc = start_process(["sleep", "0.2"], cores=CPUS[:1], timeout_s=10,
                                     cwd_root=str(tmp_path))
        os.kill(proc.pid, 0)  # running already: no event-loop turn was needed
        assert os.sched_getaffinity(proc.pid) == set(CPUS[:1])
        out = await proc.wait()
        try:
            await proc.wait()
        except RuntimeError as e:
            return out, str(e)
        return out, ""

    out, second = asyncio.run(go())
    assert out.ok and out.detail["pid"] > 0
    assert second == ""  # a finished Process answers again with its Outcome
    assert list(tmp_path.iterdir()) == []


def test_abandoned_process_is_killed_reaped_and_cleaned_up(tmp_path):
    fds = open_fds()

    async def go() -> tuple[int, Outcome]:
        proc = start_process(py("import time; time.sleep(30)"), cores=CPUS[:1],
                                     timeout_s=60, cwd_root=str(tmp_path))
        proc.abandon()
        proc.abandon()  # idempotent
        for _ in range(200):  # reaped in the background once SIGKILL has taken effect
            await asyncio.sleep(0.01)
            if proc.pid not in my_zombies() and not _alive(proc.pid):
                break
        return proc.pid, await proc.wait()

    pid, out = asyncio.run(go())
    assert not _alive(pid) and pid not in my_zombies()
    assert out.reason == "cancelled" and not out.ok
    assert list(tmp_path.iterdir()) == [] and open_fds() == fds


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_a_finished_process_still_held_keeps_only_its_outcomes_output():
    """A finished command still referenced (a process in a reference cycle is freed only
    when the collector gets to it) holds its output once, in its outcome: the tail it
    was read into is dropped."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        proc = start_process(
            [sys.executable, "-c", "import sys; sys.stdout.write('x' * 4_000_000)"],
            cores=CPUS[:1], timeout_s=30, tail_bytes=4_000_000)
        outcome = await proc.wait()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(outcome.stdout) == 4_000_000
    assert held < 6_000_000, held  # the outcome's 4 MB, not also a 4 MB tail
