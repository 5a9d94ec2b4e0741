"""Adversarial commands through the live dispatcher, each trying to break out, and each
blocked: reading or writing another trajectory's workspace or the journal, signalling
another job or the dispatcher, widening the granted CPU set, exceeding the memory limit
through tmpfs or ``setsid`` workers, outliving the timeout as a daemon, fork-bombing,
reading the dispatcher's secrets, reaching the network when not allowed.

The tests that need cgroups run under every cgroup mode; a mode this machine cannot run
(e.g. cgroup v2 controllers where v1 holds them) is skipped with its reason (``-rs``).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import psutil
import pytest
from helpers import COMMAND_PY
from sandbox_helpers import (  # noqa: F401 (isolation: a fixture)
    MODE,
    isolation,
    needs_controllers,
)
from sandbox_helpers import sandboxed_config as cfg

from metasched.runtime.dispatch import Dispatcher

PY = COMMAND_PY  # what a sandbox's user can run (see helpers)
CORES = sorted(os.sched_getaffinity(0))
CGROUP_MODES = ["auto", "v1", "v2"]


pytestmark = [pytest.mark.isolation, pytest.mark.usefixtures("isolation")]


def cpu(code: str, **kw) -> dict:
    """A Python command (the test's interpreter: visible read-only in every sandbox)."""
    return {"kind": "cpu", "argv": [PY, "-c", textwrap.dedent(code)],
            "timeout_s": kw.pop("timeout_s", 60), **kw}


def sh(script: str, **kw) -> dict:
    return {"kind": "cpu", "argv": ["/bin/sh", "-c", script],
            "timeout_s": kw.pop("timeout_s", 60), **kw}


def cgroup_mode(mode: str, *controllers: str) -> str:
    needs_controllers(*controllers, mode=mode)
    return mode


# ---------------------------------------------------------------- workspaces, journal


async def test_another_trajectorys_workspace_is_out_of_reach(tmp_path):
    secret = uuid.uuid4().hex

    async with Dispatcher(cfg()) as d:
        await d.submit(sh(f"echo {secret} > secret", trajectory="victim"))
        victim = asyncio.ensure_future(d.submit(sh("sleep 5", trajectory="victim")))
        await asyncio.sleep(0.5)
        attack = await d.submit(cpu(f"""
            import glob, os
            found, wrote = [], []
            for pattern in ["/proc/*/root/workspace/*", "/proc/*/cwd/*", "/workspace/*",
                            "/tmp/*", "/dev/shm/*", "/.sandbox/*", "/proc/*/root/tmp/*"]:
                for p in glob.glob(pattern):
                    try:
                        if {secret!r} in open(p).read():
                            found.append(p)
                    except OSError:
                        pass
            for pid in os.listdir("/proc"):
                if pid.isdigit() and int(pid) != os.getpid():
                    try:
                        open(f"/proc/{{pid}}/cwd/planted", "w").write("x")
                        wrote.append(pid)
                    except OSError:
                        pass
            print("found", found, "wrote", wrote)
        """, trajectory="attacker"))
        check = await d.submit(sh("cat secret; ls", trajectory="victim"))
        await victim
    assert attack.ok, attack.stderr
    assert attack.stdout.strip() == "found [] wrote []"
    assert check.stdout.split() == [secret, "secret"]  # nothing planted


async def test_the_journal_can_be_neither_read_nor_written(visible_dir):
    # Outside /tmp, which sandboxes have their own of, in a directory open to all: only
    # hiding keeps its files away.
    db = str(visible_dir / "journal.db")
    mark = uuid.uuid4().hex  # written only by the attack (its text never is: see below)

    async with Dispatcher(cfg(journal=db)) as d:
        r = await d.submit(cpu(f"""
            import glob, os
            db = {db!r}
            out = []
            for p in [db, db + "-wal", db + "-shm", *glob.glob("/proc/*/fd/*")]:
                try:
                    data = open(p, "rb").read(1 << 20)
                    out.append((p, b"SQLite" in data or b"request" in data))
                except OSError:
                    pass
            for p in [db, db + "-wal"]:
                try:
                    open(p, "ab").write({mark[::-1]!r}[::-1].encode())
                    out.append("wrote")
                except OSError as e:
                    out.append(e.strerror)
            print(out)
        """, trajectory="t"))
        r = r
    data = open(db, "rb").read() + open(db + "-wal", "rb").read() \
        if os.path.exists(db + "-wal") else open(db, "rb").read()
    assert r.ok, r.stderr
    assert "True" not in r.stdout  # nothing of the journal was readable
    assert "wrote" not in r.stdout
    assert data[:6] == b"SQLite" and mark.encode() not in data


async def test_a_command_holds_no_descriptor_of_the_dispatcher_or_its_server():
    """Only stdin, stdout and stderr: a descriptor of the sandbox server's socket would
    let a command ask a root process to start anything."""
    code = "import os; print(sorted(int(fd) for fd in os.listdir('/proc/self/fd')))"

    async with Dispatcher(cfg()) as d:
        results = await asyncio.gather(d.submit(cpu(code)),
                                       d.submit(cpu(code, trajectory="t")))
    for r in results:
        assert r.ok, r.stderr
        assert json.loads(r.stdout)[:3] == [0, 1, 2] and len(json.loads(r.stdout)) == 4
        # (the fourth: the directory listing itself)


# ---------------------------------------------------------------- signals


async def test_cannot_signal_another_job_or_the_dispatcher():
    async with Dispatcher(cfg()) as d:
        pids: dict[str, int] = {}
        victims = [asyncio.ensure_future(d.submit(sh("sleep 4", trajectory="v", id="v"))),
                   asyncio.ensure_future(d.submit(sh("sleep 4", id="w")))]
        for _ in range(200):
            await asyncio.sleep(0.02)
            for proc in d.executors.commands:
                if proc.pid:
                    pids.setdefault(str(len(pids)), proc.pid)
            if len(pids) >= 2:
                break
        targets = [*pids.values(), os.getpid(), d.sandboxes.server.pid]
        attacks = await asyncio.gather(
            d.submit(cpu(f"""
                import os, signal
                res = []
                for pid in {targets!r} + list(range(1, 400)):
                    try:
                        os.kill(pid, signal.SIGKILL)
                        res.append(pid)
                    except OSError:
                        pass
                try:
                    os.kill(-1, signal.SIGKILL)  # everything this user may signal
                except OSError:
                    pass
                print(sorted(set(res) - {{os.getpid()}}))
            """, trajectory="a", timeout_s=20)),
            d.submit(sh("kill -9 -1; kill -9 1 2 3; echo done", timeout_s=20)))
        results = await asyncio.gather(*victims)
        attack, attack2 = attacks
    # the only processes it could kill were its own (pid 1 of its namespace is not
    # killable from inside it either)
    assert attack.stdout.strip() in ("[]", ""), attack.stdout
    assert [r.status for r in results] == ["done", "done"], [r.reason for r in results]


# ---------------------------------------------------------------- CPU


@pytest.mark.skipif(len(CORES) < 2, reason="needs two cores")
@pytest.mark.parametrize("mode", CGROUP_MODES)
async def test_cpu_set_cannot_be_widened(mode):
    cgroup_mode(mode, "cpuset")
    async with Dispatcher(cfg(mode, cores=CORES[:2])) as d:
        r = await d.submit(cpu("""
            import os, subprocess
            os.sched_setaffinity(0, set(range(os.cpu_count())))
            subprocess.run(["taskset", "-p", "-c", "0-%d" % (os.cpu_count() - 1),
                            str(os.getpid())], capture_output=True)
            for line in open("/proc/self/cgroup"):
                if ":cpuset:" not in line and not line.startswith("0::"):
                    continue
                path = "/sys/fs/cgroup/" + ("cpuset" if ":cpuset:" in line else "unified")
                path += line.strip().split(":", 2)[2] + "/cpuset.cpus"
                try:
                    open(path, "w").write("0-%d" % (os.cpu_count() - 1))
                    print("widened", path)
                except OSError:
                    pass
            print(sorted(os.sched_getaffinity(0)))
        """))
    assert r.ok, r.stderr
    assert "widened" not in r.stdout
    assert r.stdout.strip().splitlines()[-1] == str(r.allocation["cores"])
    assert len(r.allocation["cores"]) == 1


# ---------------------------------------------------------------- memory


@pytest.mark.parametrize("mode", CGROUP_MODES)
@pytest.mark.parametrize("where", ["/workspace", "/tmp", "/dev/shm"])
async def test_tmpfs_files_count_against_the_memory_limit(mode, where):
    cgroup_mode(mode, "memory")

    async with Dispatcher(cfg(mode)) as d:
        r = await d.submit(sh(f"dd if=/dev/zero of={where}/fill bs=1M count=500",
                              mem_limit_mb=100, trajectory="t", workspace_mb=1024))
    assert r.status == "failed" and r.reason == "memory limit exceeded (100 MB)", r


@pytest.mark.parametrize("mode", CGROUP_MODES)
async def test_setsid_workers_count_against_the_memory_limit(mode):
    cgroup_mode(mode, "memory")

    async with Dispatcher(cfg(mode)) as d:
        r = await d.submit(cpu("""
            import subprocess, sys
            code = "import time; b = b'x' * (150 << 20); time.sleep(2)"
            ps = [subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
                  for _ in range(4)]
            print([p.wait() for p in ps])
        """, mem_limit_mb=300))
    assert r.status == "failed" and r.reason == "memory limit exceeded (300 MB)", r


# ---------------------------------------------------------------- processes


def _marker_alive(marker: str) -> list[int]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        if any(marker in part for part in (p.info["cmdline"] or [])):
            out.append(p.pid)
    return out


@pytest.mark.parametrize("mode", CGROUP_MODES)
@pytest.mark.parametrize("exits", ["times out", "exits"])
async def test_daemons_do_not_outlive_their_command(mode, exits):
    cgroup_mode(mode)
    marker = f"daemon-{uuid.uuid4().hex[:12]}"
    main = "sleep 60" if exits == "times out" else "true"
    # double fork + setsid; the daemon's shell carries the marker in its command line
    script = (f"(setsid sh -c 'sleep 300; echo {marker}' </dev/null >/dev/null 2>&1 &); "
              f"sleep 0.3; {main}")

    async with Dispatcher(cfg(mode)) as d:
        r = await d.submit(sh(script, timeout_s=2, trajectory="t"))
        await asyncio.sleep(0.3)
        alive_while_open = _marker_alive(marker)
        alive = alive_while_open
    if exits == "times out":
        assert r.status == "failed" and r.reason == "timeout after 2 s", r
    else:
        assert r.ok, r
    assert alive == []  # dead once the command ended, with the trajectory still open
    assert _marker_alive(marker) == []


@pytest.mark.parametrize("mode", CGROUP_MODES)
async def test_fork_bomb_is_bounded(mode):
    cgroup_mode(mode, "pids")
    if MODE["isolation"] == "gvisor":  # its tasks are not host processes: not counted here
        pytest.skip("gvisor: pids_max is not enforced per command in this mode (Sandboxes, "
                    "gvisor: gaps)")

    async with Dispatcher(cfg(mode, sandbox={"pids_max": 64})) as d:
        # this test's own descendants: other tenants' processes on a shared host
        # are not the bomb's
        me = psutil.Process()

        def descendants() -> int:
            return len(me.children(recursive=True))

        before = descendants()
        bomb = asyncio.ensure_future(d.submit(cpu("""
            import os, time
            while True:
                try:
                    os.fork()
                except OSError:
                    time.sleep(0.01)
        """, timeout_s=3)))
        peak = 0
        while not bomb.done():
            peak = max(peak, descendants() - before)
            await asyncio.sleep(0.05)
        after = await d.submit(sh("echo alive"))
        bomb = bomb.result()
    assert bomb.status == "failed"
    assert 0 < peak <= 64 + 16  # the limit, and the sandbox's own helpers
    assert after.ok and after.stdout.strip() == "alive"


# ---------------------------------------------------------------- environment, network


SECRETS_CHILD = textwrap.dedent("""
    import asyncio, json, sys
    from metasched.runtime.dispatch import Dispatcher, DispatcherConfig
    from metasched.runtime.sandbox.config import SandboxConfig

    async def main():
        cfg = DispatcherConfig(scheduler="elastic_greedy",
                               sandbox=SandboxConfig(isolation=sys.argv[1]))
        # every environment it can read; only lines naming a secret kept (output tails
        # are bounded)
        look = ("{ env; for f in /proc/*/environ; do cat $f; echo; done; } 2>/dev/null "
                "| tr '\\\\0' '\\\\n' | grep -e SECRET -e MINE -e ^PATH=")
        async with Dispatcher(cfg) as d:
            rs = await asyncio.gather(
                d.submit({"kind": "cpu", "argv": ["/bin/sh", "-c", look], "timeout_s": 30}),
                d.submit({"kind": "cpu", "argv": ["/bin/sh", "-c", look], "timeout_s": 30,
                          "trajectory": "t", "env": {"MINE": "given"}}))
        print(json.dumps([[r.status, r.stdout] for r in rs]))

    asyncio.run(main())
""")


def test_the_dispatchers_secrets_stay_out_of_commands():
    # In the dispatcher's environment from its start, so in its /proc/PID/environ too.
    secret = uuid.uuid4().hex
    env = {**os.environ, "AWS_SECRET_ACCESS_KEY": secret}
    p = subprocess.run([sys.executable, "-c", SECRETS_CHILD, MODE["isolation"]], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    (s1, out1), (s2, out2) = json.loads(p.stdout)
    assert s1 == s2 == "done"
    assert secret not in out1 + out2
    assert "MINE=given" in out2 and "PATH=" in out2


@pytest.fixture
def server():
    """A TCP server on 127.0.0.1 in the dispatcher's network namespace, counting the
    connections it accepts."""
    sock = socket.create_server(("127.0.0.1", 0))
    sock.settimeout(0.2)
    accepted = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except (TimeoutError, OSError):
                continue
            accepted.append(1)
            conn.close()
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield sock.getsockname()[1], accepted
    stop.set()
    t.join()
    sock.close()


async def test_no_network_unless_allowed(server):
    """Not without network, and not the host with it either (granted network reaches
    only what ``sandbox.egress`` allows: tests/test_security_sandbox_net.py)."""
    port, accepted = server
    probe = f"""
        import socket
        try:
            socket.create_connection(("127.0.0.1", {port}), timeout=2).close()
            print("connected")
        except OSError as e:
            print("refused", e.errno)
    """

    async with Dispatcher(cfg()) as d:
        blocked, blocked_traj, granted = await asyncio.gather(d.submit(cpu(probe)),
                                                              d.submit(cpu(probe, trajectory="t")),
                                                              d.submit(cpu(probe, network=True)))
    assert blocked.stdout.startswith("refused") and blocked_traj.stdout.startswith("refused")
    assert granted.stdout.startswith("refused"), granted  # never the host
    connected = socket.create_connection(("127.0.0.1", port), timeout=2)  # it is up
    connected.close()
    time.sleep(0.3)
    assert len(accepted) == 1
