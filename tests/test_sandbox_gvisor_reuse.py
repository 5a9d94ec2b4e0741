"""``sandbox.gvisor_reuse``: a sandbox (a trajectory-less command's, or a closed
trajectory's) is wiped and serves the next one of its kind, which sees nothing of the
one before: no file in ``/workspace``, ``/tmp`` or ``/dev/shm``, no process (not even
a zombie), none of its environment; where the wipe cannot make it so (a System V IPC
object left in gVisor's kernel), the container is replaced instead.

Each test runs its commands one after the other (nothing started ahead), so that each
is given the container of the one before once wiped; the last prints its user and
gVisor's boot time (the container it ran in) and everything the one before could have
left (of processes: those of the commands' user; the init, the exec server and its
zygote are root's).
"""

from __future__ import annotations

import json
import uuid

import pytest
from helpers import cpu
from sandbox_helpers import gvisor_mode as gvisor_mode  # noqa: F401 (a fixture)
from sandbox_helpers import sandboxed_config

from metasched.runtime.dispatch import Dispatcher

pytestmark = [pytest.mark.isolation, pytest.mark.gvisor]

# What the second command sees (as JSON).
LOOK = """
import ctypes, json, os, struct
libc = ctypes.CDLL(None)
def used(call, at):
    b = ctypes.create_string_buffer(128)
    call(b)
    return struct.unpack_from("10i", b.raw)[at]
me = os.getpid()
print(json.dumps({
    "boot": [os.getuid(), [x for x in open("/proc/stat") if x.startswith("btime")]],
    "files": {d: sorted(os.listdir(d)) for d in ("/workspace", "/tmp", "/dev/shm")},
    "workspace_mode": oct(os.stat("/workspace").st_mode & 0o7777),
    "processes": [open(f"/proc/{p}/cmdline").read() for p in os.listdir("/proc")
                  if p.isdigit() and int(p) != me and os.stat(f"/proc/{p}").st_uid],
    "env": sorted(os.environ),
    "ipc": [used(lambda b: libc.shmctl(0, 14, b), 0), used(lambda b: libc.msgctl(0, 12, b), 0),
            used(lambda b: libc.semctl(0, 0, 19, b), 7)],
}))
"""

# What the first command leaves, by what it touches.
LEAVES = {
    "workspace": "echo secret > /workspace/a; mkdir -p /workspace/d/e; "
                 "echo x > /workspace/d/e/f; chmod 000 /workspace/d; "
                 "echo y > /workspace/.hidden; chmod 777 /workspace",
    "tmp": "echo secret > /tmp/a; mkdir /tmp/d; chmod 500 /tmp/d",
    "dev_shm": "echo secret > /dev/shm/a; python3 -c \"import multiprocessing.shared_memory "
               "as m; m.SharedMemory(name='seg', create=True, size=4096)._mmap.close()\"",
    "processes": "(setsid sh -c 'sleep 300' </dev/null >/dev/null 2>&1 &); "
                 "(nohup sleep 300 </dev/null >/dev/null 2>&1 &); sleep 0.3",
    "environment": "export LEAKED=1; echo LEAKED=1 >> /workspace/.profile",
}


def _config():
    return sandboxed_config(sandbox={"gvisor_warm": 0})


async def _run(d: Dispatcher, request: dict, by: str) -> dict:
    """Run ``request`` trajectory-less, or (``by`` "trajectory") in a trajectory of
    its own, closed after it."""
    if by == "trajectory":
        request = {**request, "trajectory": f"t-{uuid.uuid4().hex}"}
    r = await d.submit(request)
    if by == "trajectory":
        d.close_trajectory(request["trajectory"])
    assert r.ok, r
    return r


async def _look(d: Dispatcher, by: str) -> dict:
    return json.loads((await _run(d, cpu("/usr/bin/python3", "-c", LOOK), by)).stdout)


def _clean(seen: dict) -> None:
    assert seen["files"] == {"/workspace": [], "/tmp": [], "/dev/shm": []}, seen
    assert seen["workspace_mode"] == "0o700", seen
    assert seen["processes"] == [], seen
    assert "LEAKED" not in seen["env"] and "SECRET" not in seen["env"], seen
    assert seen["ipc"] == [0, 0, 0], seen


@pytest.mark.parametrize("by", ["trajectory-less", "trajectory"])
@pytest.mark.parametrize("leaves", sorted(LEAVES))
async def test_a_reused_sandbox_shows_nothing_of_the_command_before(gvisor_mode, leaves, by):
    async with Dispatcher(_config()) as d:
        before = await _look(d, by)
        await _run(d, cpu("/bin/sh", "-c", LEAVES[leaves], env={"SECRET": "1"}), by)
        seen = await _look(d, by)
    assert seen["boot"] == before["boot"]  # the same container, reused
    _clean(seen)


async def test_a_sysv_ipc_object_left_replaces_the_container(gvisor_mode):
    """gVisor keeps System V IPC objects in its kernel, beyond the wiped paths: the
    wipe fails and the next command gets a new container."""
    make = ("import ctypes; libc = ctypes.CDLL(None); "
            "assert libc.shmget(0, 4096, 0o1600) >= 0 and libc.msgget(0, 0o1600) >= 0")
    async with Dispatcher(_config()) as d:
        before = await _look(d, "trajectory-less")
        await _run(d, cpu("/usr/bin/python3", "-c", make), "trajectory-less")
        seen = await _look(d, "trajectory-less")
    assert seen["boot"] != before["boot"]
    _clean(seen)
