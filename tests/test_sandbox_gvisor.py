"""``sandbox.isolation: gvisor``: what its sandboxes guarantee beyond the sandboxes
suite that runs on both modes (test_security_sandbox_root, test_security_sandbox_net,
test_sandbox_isolation): a granted core confines the whole container on the host, a
command's end leaves nothing of it in the sandbox (seen from inside, where the host
cannot see gVisor's processes), a trajectory's end and a kill -9 of the dispatcher leave
no runsc process, and a missing runsc refuses the mode in one line.

Skipped, with the reason, where runsc cannot run (``make sandbox-tools`` installs it).
"""

from __future__ import annotations

import asyncio
import base64
import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import psutil
import pytest
from helpers import COMMAND_PY, cpu
from sandbox_helpers import ISOLATION_MODES, sandboxed_config
from sandbox_helpers import gvisor_mode as gvisor_mode  # noqa: F401 (a fixture)
from sandbox_helpers import isolation as isolation  # noqa: F401 (a fixture)

from metasched.errors import ConfigError
from metasched.runtime.dispatch import Dispatcher
from metasched.runtime.sandbox import egress, gvisor
from metasched.runtime.sandbox.config import SandboxConfig
from metasched.runtime.sandbox.manager import Sandboxes
from metasched.serve.e2b import programs as e2b_programs
from metasched.serve.files import write_argvs

pytestmark = pytest.mark.isolation
CORES = sorted(os.sched_getaffinity(0))
ROOT = str(Path(__file__).resolve().parents[1])


def _containers(tag: str) -> list[tuple[int, str]]:
    """(pid, command line) of runsc's live processes (sandbox, gofer, exec, ...) of the
    containers whose names start with ``tag``."""
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        line = " ".join(p.info["cmdline"] or [])
        if "runsc" in line and tag in line + " " and p.info["status"] != psutil.STATUS_ZOMBIE:
            out.append((p.pid, line))
    return out


def _cpuset(pid: int) -> Path:
    """``pid``'s cpuset cgroup directory."""
    path = next(line.split(":", 2)[2] for line in Path(f"/proc/{pid}/cgroup").read_text()
                .splitlines() if ":cpuset:" in line)
    return Path(f"/sys/fs/cgroup/cpuset{path}")


def _threads(pid: int) -> dict[int, tuple[int, int]]:
    """Every thread of every process in ``pid``'s cpuset cgroup: (CPU ticks used, the
    CPU it last ran on)."""
    out = {}
    for member in (_cpuset(pid) / "cgroup.procs").read_text().split():
        try:
            for task in Path(f"/proc/{member}/task").iterdir():
                f = (task / "stat").read_text().rsplit(")", 1)[1].split()
                out[int(task.name)] = (int(f[11]) + int(f[12]), int(f[36]))
        except (OSError, ValueError):
            pass
    return out


BUSY = textwrap.dedent("""
    import os, time
    kids = []
    for _ in range(4):
        pid = os.fork()
        if pid == 0:
            end = time.time() + 4
            while time.time() < end:
                pass
            os._exit(0)
        kids.append(pid)
    for pid in kids:
        os.waitpid(pid, 0)
""")


@pytest.mark.gvisor
@pytest.mark.skipif(len(CORES) < 2, reason="needs two cores")
async def test_four_busy_processes_granted_one_core_use_one_core(gvisor_mode):
    """The container's cgroup holds its running commands' cores: four busy processes
    granted one core use about one core of the host (the whole sandbox measured: gVisor's
    kernel, file proxy and the threads running the program)."""
    async with Dispatcher(sandboxed_config("v1", cores=CORES[:2])) as d:
        job = asyncio.ensure_future(d.submit(cpu(COMMAND_PY, "-c", BUSY, trajectory="t")))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            sb = d.sandboxes.get("t")
            if sb is not None and sb.ready.done():
                break
            await asyncio.sleep(0.05)
        tag = f"{d.sandboxes.gvisor.prefix}{sb.sid} "
        sandboxes = [pid for pid, line in _containers(tag) if " boot " in line]
        await asyncio.sleep(1.5)  # the processes are running
        pid = sandboxes[0]
        before, t0 = _threads(pid), time.monotonic()
        cpus = (_cpuset(pid) / "cpuset.cpus").read_text().strip()
        await asyncio.sleep(2.0)
        after = _threads(pid)
        ticks = {t: used - before.get(t, (0, 0))[0] for t, (used, _) in after.items()}
        used = sum(ticks.values()) / os.sysconf("SC_CLK_TCK") / (time.monotonic() - t0)
        ran_on = {after[t][1] for t, n in ticks.items() if n > 0}
        r = await job
    assert r.ok, r
    granted = r.allocation["cores"]
    assert len(granted) == 1
    print(f"cores used by 4 busy processes granted 1 core: {used:.2f}")
    assert cpus == str(granted[0])  # the whole container's cpuset, while it ran
    assert ran_on == set(granted)  # every thread of it that ran (gVisor's, the program's)
    assert used <= 1.25, used


@pytest.mark.parametrize("isolation", ISOLATION_MODES, indirect=True)
@pytest.mark.parametrize("ends", ["times out", "exits"])
async def test_nothing_of_a_command_outlives_it_as_seen_from_its_sandbox(isolation,  # noqa: F811
                                                                         ends):
    """A command's daemons (a double fork in a session of its own) are gone when it
    ends, as its trajectory's next command sees it (in gVisor the host sees no
    process of the sandbox's)."""
    marker = f"daemon-{uuid.uuid4().hex[:12]}"
    main = "sleep 60" if ends == "times out" else "true"
    script = (f"(setsid sh -c 'sleep 300; echo {marker}' </dev/null >/dev/null 2>&1 &); "
              f"sleep 0.5; {main}")
    look = f"ps -eo args | grep -c '[d]aemon-{marker[7:]}' || true"
    async with Dispatcher(sandboxed_config()) as d:
        r = await d.submit(cpu("/bin/sh", "-c", script, timeout_s=3, trajectory="t"))
        seen = await d.submit(cpu("/bin/sh", "-c", look, trajectory="t"))
    if ends == "times out":
        assert r.status == "failed" and r.reason == "timeout after 3 s", r
    else:
        assert r.ok, r
    assert seen.ok and seen.stdout.strip() == "0", seen


@pytest.mark.parametrize("isolation", ISOLATION_MODES, indirect=True)
async def test_output_larger_than_a_pipe_arrives_before_the_exit(isolation):  # noqa: F811
    """Megabytes on stdout and stderr at once (far more than a pipe holds: in gVisor
    the exec server relays them in frames) end as written: the exit is reported after
    the last byte; commands side by side in one sandbox keep their own output."""
    script = ("import sys\n"
              "tag = sys.argv[1].encode()\n"
              "for i in range(200000):\n"
              "    line = b'%s %08d\\n' % (tag, i)\n"
              "    sys.stdout.buffer.write(line)\n"
              "    sys.stderr.buffer.write(line.upper())\n")
    async with Dispatcher(sandboxed_config()) as d:
        rs = await asyncio.gather(*(d.submit(cpu(
            "/usr/bin/python3", "-c", script, tag, trajectory="t", timeout_s=120))
            for tag in ("a", "b")))
    for tag, r in zip(("a", "b"), rs, strict=True):
        assert r.ok, r
        data = "".join(f"{tag} {i:08d}\n" for i in range(199000, 200000))
        assert r.stdout == data[-len(r.stdout):] and len(r.stdout) >= 4000, r.stdout[-200:]
        assert r.stderr == data.upper()[-len(r.stderr):] and len(r.stderr) >= 4000


@pytest.mark.gvisor
async def test_a_trajectorys_end_removes_its_container_and_bundle(gvisor_mode):
    """(Not wiped for reuse: test_sandbox_gvisor_reuse.py.)"""
    async with Dispatcher(sandboxed_config(sandbox={"gvisor_reuse": False})) as d:
        r = await d.submit(cpu("/bin/sh", "-c", "echo kept > /workspace/f; cat f",
                               trajectory="t"))
        sid = d.sandboxes.get("t").sid
        tag = f"{d.sandboxes.gvisor.prefix}{sid} "  # (the warm ones are other containers)
        running = [pid for pid, line in _containers(tag) if " boot " in line]
        bundles = [Path(d.sandboxes.gvisor.directory) / f"sandbox-{sid}"]
        assert bundles[0].exists()
        d.close_trajectory("t")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (
                _containers(tag) or any(b.exists() for b in bundles)):
            await asyncio.sleep(0.05)
        left = _containers(tag)
        assert not any(b.exists() for b in bundles)
    assert r.ok and r.stdout == "kept\n", r
    assert running and not left


KILLED_CHILD = textwrap.dedent("""
    import asyncio, sys
    from metasched.runtime.dispatch import Dispatcher, DispatcherConfig
    from metasched.runtime.sandbox.config import SandboxConfig

    async def main():
        cfg = DispatcherConfig(scheduler="elastic_greedy",
                               sandbox=SandboxConfig(isolation="gvisor"))
        async with Dispatcher(cfg) as d:
            d.accept({"kind": "cpu", "argv": ["/bin/sh", "-c",
                      "setsid sleep 600 & sleep 600"], "timeout_s": 900, "trajectory": "t"})
            d.flush()
            print("accepted", flush=True)
            await asyncio.sleep(3600)

    asyncio.run(main())
""")


@pytest.mark.gvisor
def test_kill_9_of_the_dispatcher_leaves_no_gvisor_process(gvisor_mode):
    child = subprocess.Popen([sys.executable, "-c", KILLED_CHILD], stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": ROOT})
    tag = f"metasched-{child.pid}-"
    try:
        assert child.stdout.readline().split() == ["accepted"]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(
                " exec " in line for _, line in _containers(tag)):
            time.sleep(0.05)
        before = _containers(tag)
        child.kill()
        child.wait()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and _containers(tag):
            time.sleep(0.05)
        left = _containers(tag)
    finally:
        child.kill()
        child.wait()
        for pid, _ in _containers(tag):
            os.kill(pid, 9)
    assert any(" boot " in line for _, line in before)
    assert left == []


def test_a_missing_runsc_refuses_the_mode_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(gvisor, "SEARCH", str(tmp_path))
    with pytest.raises(ConfigError) as e:
        Sandboxes(SandboxConfig(isolation="gvisor"))
    line = str(e.value)
    assert line.startswith("sandbox.isolation: gvisor: gVisor's runsc is not installed")
    assert "\n" not in line


@pytest.mark.gvisor
def test_the_startup_line_says_gvisor(gvisor_mode):
    sandboxes = Sandboxes(SandboxConfig(isolation="gvisor", cgroups="none"))
    try:
        line = sandboxes.describe()
    finally:
        sandboxes.close()
    assert line.startswith("sandboxes: gVisor (runsc version"), line
    if egress.find_tools()[0] is not None:
        assert ("network granted: egress public through slirp4netns, gVisor's sockets in "
                "the sandbox's own net namespace") in line, line


@pytest.mark.parametrize("isolation", ISOLATION_MODES, indirect=True)
async def test_writes_through_a_symlink_by_the_workspaces_home_name_land_in_it(
        isolation):  # noqa: F811
    """``/home/user`` is the workspace in both modes: a symbolic link through it leads
    back into the workspace, and /run_code's and E2B's writes through one land there;
    a link leading out of the workspace is still refused by E2B's."""
    setup = ("mkdir sub && echo old > target.txt && ln -s /home/user/target.txt link "
             "&& ln -s /home/user/sub dir && ln -s /etc/hostname out")
    async with Dispatcher(sandboxed_config()) as d:
        made = await d.submit(cpu("/bin/sh", "-c", setup, trajectory="t"))
        assert made.ok, made
        writes = [*write_argvs({"link": base64.b64encode(b"run_code").decode()}),
                  *e2b_programs.write_argvs("dir/new.txt", b"e2b"),
                  *e2b_programs.write_argvs("/home/user/link", b"e2b link")]
        for argv in writes:
            r = await d.submit(cpu(*argv, trajectory="t"))
            assert r.ok and '"error"' not in r.stdout, r
        out = await d.submit(cpu(*next(e2b_programs.write_argvs("out", b"x")),
                                 trajectory="t"))
        seen = await d.submit(cpu("/bin/sh", "-c", "cat /workspace/target.txt; echo; "
                                  "cat /workspace/sub/new.txt", trajectory="t"))
    assert "leads outside the sandbox's workspace" in out.stdout, out
    assert seen.ok and seen.stdout.split() == ["e2b", "link", "e2b"], seen


FDS = textwrap.dedent("""
    import os
    seen = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()):
        for name in ("fd", "fdinfo"):
            try:
                fds = os.listdir(f"/proc/{pid}/{name}")
            except OSError:
                continue
            seen += [f"{pid}/{name}/{fd}" for fd in fds]
        for fd in range(16):
            try:
                seen.append(f"{pid}/fd/{fd} -> " + os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                pass
    print("\\n".join(seen) or "none")
""")


@pytest.mark.parametrize("isolation", ISOLATION_MODES, indirect=True)
async def test_a_command_cannot_list_or_readlink_other_processes_descriptors(
        isolation):  # noqa: F811
    """The sandbox's root processes (in gVisor: its init and exec server) are not the
    commands' to look into: no ``/proc/PID/fd`` entry of theirs is listed or read."""
    async with Dispatcher(sandboxed_config()) as d:
        r = await d.submit(cpu("/usr/bin/python3", "-c", FDS, trajectory="t"))
    assert r.ok and r.stdout.strip() == "none", r
