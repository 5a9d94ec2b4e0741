"""The few Linux calls the sandbox needs that the standard library lacks before Python
3.12 (``setns``, ``unshare``, ``mount``, ``umount2``, ``prctl``) and the mount API's
``open_tree`` and ``move_mount`` (Linux >= 5.2), through ctypes.

Each raises ``OSError`` with the call's errno, as ``os`` functions do.
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["CLONE_NEWIPC", "CLONE_NEWNET", "CLONE_NEWNS", "CLONE_NEWPID", "CLONE_NEWUTS",
           "MNT_DETACH", "MS_BIND", "MS_NODEV", "MS_NOSUID", "MS_PRIVATE", "MS_RDONLY",
           "MS_REC", "MS_REMOUNT", "clone_mount", "mount", "move_mount", "no_new_privs",
           "parent_death_signal", "setns", "umount", "unshare"]

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
MNT_DETACH = 0x2

# open_tree(2) and move_mount(2): one syscall number on every architecture (since 5.1).
_SYS_OPEN_TREE = 428
_SYS_MOVE_MOUNT = 429
_AT_FDCWD = -100
_OPEN_TREE_CLONE = 1
_OPEN_TREE_CLOEXEC = os.O_CLOEXEC
_MOVE_MOUNT_F_EMPTY_PATH = 0x4

_PR_SET_PDEATHSIG = 1
_PR_SET_NO_NEW_PRIVS = 38

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
_libc.unshare.argtypes = [ctypes.c_int]
_libc.syscall.restype = ctypes.c_long
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                        ctypes.c_ulong]


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def setns(fd: int, nstype: int) -> None:
    """Move this thread into the namespace ``fd`` refers to (``/proc/PID/ns/*``)."""
    _check(_libc.setns(fd, nstype), "setns")


def unshare(flags: int) -> None:
    """Leave the given namespaces for new ones (``CLONE_NEW*`` flags)."""
    _check(_libc.unshare(flags), "unshare")


def mount(source: str, target: str, fstype: str | None, flags: int = 0,
          data: str | None = None) -> None:
    """mount(2); ``fstype`` None for binds, remounts and propagation changes."""
    _check(_libc.mount(source.encode(), target.encode(),
                       fstype.encode() if fstype is not None else None, flags,
                       data.encode() if data is not None else None), f"mount {target}")


def umount(target: str, flags: int = 0) -> None:
    """umount2(2)."""
    _check(_libc.umount2(target.encode(), flags), f"umount {target}")


def no_new_privs() -> None:
    """Set ``PR_SET_NO_NEW_PRIVS``: no exec from here on (inherited by every descendant)
    can gain privileges, through setuid binaries or file capabilities alike."""
    _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")


def parent_death_signal(sig: int) -> None:
    """Ask for ``sig`` when the parent thread exits (``PR_SET_PDEATHSIG``)."""
    _check(_libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0), "prctl(PDEATHSIG)")


def clone_mount(path: str) -> int:
    """A detached copy of the mount at ``path`` (``open_tree(OPEN_TREE_CLONE)``), as an
    fd: :func:`move_mount` attaches it, in this or another mount namespace; the same
    filesystem (a tmpfs's files are shared by both mounts)."""
    fd = _libc.syscall(ctypes.c_long(_SYS_OPEN_TREE), ctypes.c_int(_AT_FDCWD), path.encode(),
                       ctypes.c_uint(_OPEN_TREE_CLONE | _OPEN_TREE_CLOEXEC))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"open_tree {path}: {os.strerror(err)}")
    return int(fd)


def move_mount(fd: int, target: str) -> None:
    """Attach the detached mount ``fd`` (from :func:`clone_mount`) at ``target`` in this
    thread's mount namespace."""
    rc = _libc.syscall(ctypes.c_long(_SYS_MOVE_MOUNT), ctypes.c_int(fd), b"",
                       ctypes.c_int(_AT_FDCWD), target.encode(),
                       ctypes.c_uint(_MOVE_MOUNT_F_EMPTY_PATH))
    _check(int(rc), f"move_mount {target}")
