"""Per-command cgroup slots on this machine's hierarchies: the cpuset a process cannot
widen, a memory limit that counts tmpfs pages and every process, a process limit, and
a kill that reaches processes which left the command's session. Each test runs with
every cgroup mode this machine can run ("auto": v2 kill + v1 controllers here; "v1":
v1 only, killed by freezing forks and killing members)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
from sandbox_helpers import needs_controllers

from metasched.runtime.sandbox import cgroups

pytestmark = pytest.mark.isolation(bwrap=False)  # root and cgroups; no sandbox

MODES = ["auto", "v1"]


@pytest.fixture(params=MODES)
def tree(request):
    if os.geteuid() != 0:
        pytest.skip("cgroups need root here")
    h = needs_controllers(*cgroups.CONTROLLERS, mode=request.param)
    t = cgroups.CgroupTree(h)
    yield t
    assert t.close(), "the tree's directories were not all removed"
    for d in t.dirs.values():
        assert not os.path.exists(d)


def spawn_in(slot: cgroups.Slot, code: str, **kw) -> subprocess.Popen:
    """A Python child that joins ``slot`` before running ``code``."""
    fds = slot.procs_fds

    def join():
        for fd in fds:
            os.write(fd, b"0")
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], pass_fds=fds,
                            preexec_fn=join, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kw)


def finish(slot: cgroups.Slot, p: subprocess.Popen, timeout: float = 60) -> tuple[str, str]:
    out, err = p.communicate(timeout=timeout)
    slot.kill()
    assert slot.wait_empty(5)
    return out, err


def test_discover_places_each_controller_or_says_why():
    for mode in ("auto", "v1", "v2", "none"):
        h = cgroups.discover(mode)
        for c in cgroups.CONTROLLERS:
            assert (c in h.placement()) != (c in h.missing), (mode, c)
            if c in h.missing:
                assert h.missing[c]
        assert "\n" not in h.describe()
    assert cgroups.discover("none").placement() == {}


def test_cpuset_cannot_be_widened(tree):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores")
    slot = tree.new_slot()
    slot.configure([0], None, None)
    p = spawn_in(slot, """
        import os
        os.sched_setaffinity(0, {0, 1})  # ask for both cores
        print(sorted(os.sched_getaffinity(0)))
    """)
    out, err = finish(slot, p)
    assert out.strip() == "[0]", err
    # and the shell tool does no better
    slot.configure([1], None, None)
    p = spawn_in(slot, """
        import subprocess
        subprocess.run(["taskset", "-p", "-c", "0,1", str(__import__("os").getpid())],
                       capture_output=True)
        print(sorted(__import__("os").sched_getaffinity(0)))
    """)
    out, _ = finish(slot, p)
    assert out.strip() == "[1]"


def test_memory_limit_counts_every_process(tree):
    slot = tree.new_slot()
    slot.configure([0], 200 << 20, None)
    # four workers in their own sessions, 100 MB each: 400 MB > 200 MB
    p = spawn_in(slot, """
        import os, subprocess, sys, time
        code = "import time; b = b'x' * (100 << 20); time.sleep(3)"
        ps = [subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
              for _ in range(4)]
        print([q.wait() for q in ps])
    """)
    out, _ = finish(slot, p)
    assert slot.exceeded()[0]
    assert "-9" in out  # the kernel killed at least one worker


def test_memory_limit_counts_tmpfs_pages(tree):
    slot = tree.new_slot()
    slot.configure([0], 64 << 20, None)
    path = f"/dev/shm/metasched-test-{os.getpid()}"
    try:
        p = spawn_in(slot, f"""
            with open({path!r}, "wb") as f:
                for _ in range(256):
                    f.write(b"x" * (1 << 20))
                    f.flush()
            print("wrote")
        """)
        out, _ = finish(slot, p)
        assert "wrote" not in out
        assert p.returncode == -9
        assert slot.exceeded()[0]
    finally:
        if os.path.exists(path):
            os.unlink(path)


def test_memory_limit_is_on_top_of_what_the_slot_holds(tree):
    slot = tree.new_slot()
    path = f"/dev/shm/metasched-test-{os.getpid()}"
    try:
        slot.configure([0], None, None)
        p = spawn_in(slot, f"open({path!r}, 'wb').write(b'x' * (48 << 20))")
        finish(slot, p)
        held = slot.memory_used()
        assert held >= 48 << 20
        slot.configure([0], 32 << 20, None)  # 32 MB more than the file it holds
        p = spawn_in(slot, "b = b'y' * (16 << 20); print('ok')")
        out, _ = finish(slot, p)
        assert out.strip() == "ok" and not slot.exceeded()[0]
    finally:
        if os.path.exists(path):
            os.unlink(path)


def test_process_limit_stops_a_fork_bomb(tree):
    slot = tree.new_slot()
    slot.configure([0], None, 32)
    p = spawn_in(slot, """
        import os, time
        n = 0
        try:
            for _ in range(300):
                if os.fork() == 0:
                    os.close(1), os.close(2)  # the test reads the parent's output to EOF
                    time.sleep(30)
                    os._exit(0)
                n += 1
        except OSError as e:
            print("refused after", n, e.errno)
    """)
    out, _ = finish(slot, p)
    assert out.startswith("refused after"), out
    assert int(out.split()[2]) < 32
    assert slot.exceeded()[1]


def test_kill_reaches_processes_that_left_the_session(tree):
    slot = tree.new_slot()
    slot.configure([0], None, None)
    p = spawn_in(slot, """
        import os, subprocess, sys
        # a double-forked daemon in a session of its own
        subprocess.Popen(["setsid", "sh", "-c", "sleep 300 & sleep 300"])
        print("started", flush=True)
    """)
    p.stdout.readline()
    p.wait(10)
    time.sleep(0.2)
    assert slot.members(), "the daemon should still be in the slot"
    slot.kill()
    assert slot.wait_empty(5)
    p.communicate()


def test_slots_are_reused_and_removed(tree):
    a = tree.new_slot()
    b = tree.new_slot()
    assert set(a.dirs.values()).isdisjoint(b.dirs.values())
    a.configure([0], 10 << 20, 10)
    a.configure([0], None, None)  # back to unlimited
    assert a.remove() and all(not os.path.exists(d) for d in a.dirs.values())
    assert a not in tree.slots and b in tree.slots


def test_v2_without_controllers_still_holds_and_kills_a_command():
    """Where v2 is writable but its controllers are elsewhere (this machine: all bound to
    v1), a v2-only tree still tracks a command's processes and kills them all; its
    limits fall back (and ``discover`` says why)."""
    if os.geteuid() != 0:
        pytest.skip("cgroups need root here")
    h = cgroups.discover("v2")
    if h.v2 is None:
        pytest.skip(f"no writable cgroup v2 here: {h.describe()}")
    if not h.missing:
        pytest.skip("v2 has every controller here: the fixture's modes cover it")
    assert all("not enabled" in why or "cannot enable" in why for why in h.missing.values())
    tree = cgroups.CgroupTree(h)
    try:
        assert set(tree.dirs) == {"v2"} and tree.controllers == h.v2_controllers
        slot = tree.new_slot()
        slot.configure([0], 64 << 20, 8)  # nothing to set where a controller is missing
        p = spawn_in(slot, """
            import subprocess
            subprocess.Popen(["setsid", "sleep", "300"])
            print("started", flush=True)
        """)
        p.stdout.readline()
        p.wait(10)
        time.sleep(0.2)
        assert len(slot.members()) == 1 and not slot.empty()  # the daemon, held
        slot.kill()
        assert slot.wait_empty(5)
        p.communicate()
    finally:
        assert tree.close()
