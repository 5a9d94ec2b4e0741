"""What the sandbox server (:mod:`.server`) keeps of each sandbox and command, the
namespaces it enters, and its file-descriptor helpers. Only the standard library and
:mod:`.syscalls` are imported (the server's start-up stays light)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from metasched.runtime.sandbox.syscalls import (
    CLONE_NEWIPC,
    CLONE_NEWNET,
    CLONE_NEWNS,
    CLONE_NEWPID,
    CLONE_NEWUTS,
)

STAGE = "/.sandbox"  # where a sandbox's tmpfs is mounted while its parts are bound out
WORKSPACE = "/workspace"
HOME = "/home/user"  # the workspace again, where E2B's programs expect their home
_NS = (("mnt", CLONE_NEWNS), ("net", CLONE_NEWNET), ("ipc", CLONE_NEWIPC),
       ("uts", CLONE_NEWUTS), ("pid", CLONE_NEWPID))
_SHARED_MOUNTS = (WORKSPACE, HOME, "/tmp", "/dev/shm")  # what a sandbox's tmpfs holds
_TAIL = 2048  # bytes of a seeding command's stderr kept for its error message
_DATA_MAX = 60_000  # bytes of a file given to bwrap through a pipe (its buffer: 64 KiB)


@dataclass
class _Sandbox:
    sid: int
    uid: int
    gid: int
    bwrap_pid: int = -1
    bwrap_fd: int = -1  # pidfd
    ready_fd: int = -1  # the stub's stdout: a newline once it runs
    info_fd: int = -1  # bwrap's --info-fd: the pid of the namespaces' init
    block_fd: int = -1  # the stub's stdin: closing it ends the sandbox
    ns: dict[str, int] = field(default_factory=dict)
    workspace: dict[str, Any] = field(default_factory=dict)
    seeding: int = -1  # command id of the template copy running, if any
    seed_err: bytearray = field(default_factory=bytearray)
    seed_err_fd: int = -1
    method: str = ""  # how the workspace was seeded: "", "overlay", "copy" or "tar"
    init_pid: int = -1  # the namespaces' init (bwrap's pid 1), in this server's pid space
    ready: bool = False
    net: dict[str, Any] | None = None  # granted network: {"slirp": argv, "nft": path, ...}
    net_pending: set[str] = field(default_factory=set)  # "rules", "slirp" still starting
    mounted: bool = False  # workspace mounted and seeded (ready once net_pending is empty)
    nft_err_fd: int = -1
    slirp_pid: int = -1
    slirp_fd: int = -1  # pidfd
    slirp_ready_fd: int = -1
    slirp_exit_fd: int = -1  # closing it ends slirp4netns
    # gVisor (:mod:`.server_gvisor`): {"runsc": argv, "bundle": dir, "cid": id}, or None
    gvisor: dict[str, Any] | None = None
    runsc_status: int | None = None
    cgroup_fds: list[int] = field(default_factory=list)  # its slot's, until runsc runs
    exec_pid: int = -1  # the runsc exec of its exec server (.server_gvisor_exec)
    exec_fd: int = -1  # its stdin: requests
    events_fd: int = -1  # its stdout: events
    events: bytearray = field(default_factory=bytearray)  # a frame not yet whole


@dataclass
class _Command:
    cmd: int
    pid: int
    pidfd: int
    sid: int | None = None


def _read_all(fd: int, limit: int = 1 << 16) -> bytes:
    out = bytearray()
    os.set_blocking(fd, False)
    while len(out) < limit:
        try:
            data = os.read(fd, 4096)
        except BlockingIOError:
            break
        if not data:
            break
        out += data
    return bytes(out[-limit:])


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass

