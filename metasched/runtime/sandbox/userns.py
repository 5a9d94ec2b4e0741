"""No new user namespaces for sandboxed commands: a seccomp filter, made with libseccomp
(through ``ctypes``), that the sandbox server loads into itself at start, so that every
process it starts (bwrap, the stubs, every command) inherits it and none can drop it.

A user namespace gives an unprivileged process a full set of capabilities over the
namespaces it then makes (mounts, network devices, ...): kernel attack surface a
sandboxed command has no use for. The filter refuses, with ``EPERM``, ``unshare`` and
``clone`` when their flags hold ``CLONE_NEWUSER``, and answers ``clone3`` (whose flags
are in memory, out of a filter's sight) with ``ENOSYS``, which makes the C libraries
fall back to ``clone``. It also refuses, with ``EPERM``, what a sandboxed command has no
use for and what has been the kernel's most exploited surface (Docker's default profile
refuses them too): ``io_uring_setup``, ``io_uring_enter`` and ``io_uring_register`` (a
program then uses ordinary reads and writes), the key retention calls ``keyctl``,
``add_key`` and ``request_key`` (keys are not namespaced), and ``perf_event_open``. It
covers the machine's native system call ABI and its
compatibility ones (x86-64: i386 and x32; aarch64: arm). Nothing the server does needs
a user namespace: bwrap runs as root and makes none. The filter is checked at every
system call a process makes: a few BPF instructions, no measurable cost.

Only the standard library is imported: the sandbox server imports this module.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from collections.abc import Callable

__all__ = ["bpf", "refuse_user_namespaces"]

CLONE_NEWUSER = 0x10000000
_ALLOW = 0x7FFF0000  # SCMP_ACT_ALLOW
_ERRNO = 0x00050000  # SCMP_ACT_ERRNO(e) = _ERRNO | e
_MASKED_EQ = 7  # SCMP_CMP_MASKED_EQ
_NE = 1  # SCMP_CMP_NE
_CLONE3 = 435  # its number on every architecture
# Refused outright (EPERM); io_uring's numbers are the same on every architecture, for a
# libseccomp older than them.
_REFUSED = {"io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
            "keyctl": None, "add_key": None, "request_key": None, "perf_event_open": None}
_COMPAT = {"x86_64": ("x86", "x32"), "aarch64": ("arm",)}


class _ArgCmp(ctypes.Structure):
    """libseccomp's ``struct scmp_arg_cmp``."""

    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int),
                ("datum_a", ctypes.c_uint64), ("datum_b", ctypes.c_uint64)]


def _libseccomp() -> ctypes.CDLL:
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError:
        raise OSError(errno.ENOENT, "libseccomp is not installed (Debian/Ubuntu: "
                      "apt-get install libseccomp2)") from None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_arch_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    lib.seccomp_arch_resolve_name.restype = ctypes.c_uint32
    lib.seccomp_arch_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int,
                                           ctypes.c_uint, ctypes.POINTER(_ArgCmp)]
    return lib


def _check(rc: int, what: str) -> None:
    if rc < 0:
        raise OSError(-rc, f"libseccomp: {what}: {os.strerror(-rc)}")


def refuse_user_namespaces() -> None:
    """Load the filter (see the module docstring) into this process, for good.

    Raises:
        OSError: libseccomp is missing or the kernel refused the filter (the message
            says which); the process is then unchanged.
    """
    _filter(lambda lib, ctx: _check(lib.seccomp_load(ctx), "load the filter"))


def bpf(*, affinity_owner: int | None = None) -> bytes:
    """The filter as a raw BPF program (``struct sock_filter`` entries), for a process
    that loads it itself (a gVisor sandbox's exec server: :mod:`.gvisor_exec`);
    ``affinity_owner``: ``sched_setaffinity`` of any thread but that one (by its id)
    also answers 0 and does nothing, so the processes started under the filter keep the
    affinity they were started with (the program holds ``affinity_owner`` as a
    constant, ``k``, that a loader may replace with its own id).

    Raises:
        OSError: libseccomp is missing or cannot make it.
    """
    out: list[bytes] = []

    def export(lib: ctypes.CDLL, ctx: int) -> None:
        if affinity_owner is not None:
            nr = lib.seccomp_syscall_resolve_name(b"sched_setaffinity")
            other = _ArgCmp(0, _NE, affinity_owner, 0)
            _check(lib.seccomp_rule_add_array(ctx, _ERRNO | 0, nr, 1, ctypes.byref(other)),
                   "rule for sched_setaffinity")
        r, w = os.pipe()
        try:
            _check(lib.seccomp_export_bpf(ctx, w), "export the filter")
            os.close(w)
            w = -1
            chunks = []
            while chunk := os.read(r, 65536):
                chunks.append(chunk)
            out.append(b"".join(chunks))
        finally:
            os.close(r)
            if w >= 0:
                os.close(w)

    _filter(export, native_only=True)
    return out[0]


def _filter(finish: Callable[[ctypes.CDLL, int], None], *, native_only: bool = False) -> None:
    """Make the filter's rules and pass it to ``finish`` (then release it);
    ``native_only``: the native ABI alone (gVisor runs no other)."""
    lib = _libseccomp()
    ctx = lib.seccomp_init(_ALLOW)
    if not ctx:
        raise OSError(errno.ENOMEM, "libseccomp: cannot make a filter")
    try:
        for arch in () if native_only else _COMPAT.get(os.uname().machine, ()):
            token = lib.seccomp_arch_resolve_name(arch.encode())
            if token:
                rc = lib.seccomp_arch_add(ctx, token)
                if rc != -errno.EEXIST:
                    _check(rc, f"add the {arch} ABI")
        newuser = _ArgCmp(0, _MASKED_EQ, CLONE_NEWUSER, CLONE_NEWUSER)
        for name in ("unshare", "clone"):
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            _check(lib.seccomp_rule_add_array(ctx, _ERRNO | errno.EPERM, nr, 1,
                                              ctypes.byref(newuser)), f"rule for {name}")
        for name, fallback in _REFUSED.items():
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            nr = nr if nr >= 0 else fallback
            if nr is not None:
                _check(lib.seccomp_rule_add_array(ctx, _ERRNO | errno.EPERM, nr, 0, None),
                       f"rule for {name}")
        nr = lib.seccomp_syscall_resolve_name(b"clone3")
        nr = nr if nr >= 0 else _CLONE3  # a libseccomp older than clone3
        _check(lib.seccomp_rule_add_array(ctx, _ERRNO | errno.ENOSYS, nr, 0, None),
               "rule for clone3")
        finish(lib, ctx)
    finally:
        lib.seccomp_release(ctx)
