"""The ``bwrap`` (bubblewrap) command line that makes a sandbox's namespaces, and the
check that bubblewrap is here and works.

The sandbox's root is bwrap's own tmpfs holding only what programs need of the host,
read-only: the system's programs and libraries (:data:`SYSTEM_PATHS`: ``/usr``, and
``/bin``, ``/sbin``, ``/lib*`` as the symlinks or directories they are here; the CPU and
NUMA topology of ``/sys``, which runtimes read to size their thread pools), the few
files of ``/etc`` that programs read (:data:`ETC_PATHS`: the dynamic linker's cache,
alternatives, certificates, time zone, name service switch, locale and MIME tables,
language runtimes' settings; ``/etc/resolv.conf`` only with network), and the extra host
paths the operator configures (``sandbox.system_paths``, e.g. a toolchain in ``/opt``).
``/etc/passwd``, ``/etc/group`` and ``/etc/hosts`` are made for the sandbox
(:func:`identity_files`: the sandbox's user is ``sandbox``, its host name ``sandbox``).
Nothing else of the host is there: no home directories, ``/root``, ``/var``, ``/run``
(and its sockets), ``/srv``, ``/mnt``, ``/opt``, no run directory, journal or
configuration. ``/proc`` is a new one (the sandbox's pid namespace), ``/dev`` a minimal
new one, and the server fills in ``/workspace``, ``/tmp`` and ``/.sandbox`` (staging).
Hidden paths (the journal's files, configured ones) that lie under a bound path get an
empty tmpfs over them (directories) or ``/dev/null`` (files).

The namespaces' long-lived process is a stub: ``sh -c 'echo; exec cat'`` prints a
newline once the sandbox is fully set up (bwrap's ``--info-fd`` is written earlier,
before its mounts are done), then reads its stdin, a pipe only the sandbox server
writes to, until that closes.

Every sandbox has a network namespace of its own, whatever its network setting: the
host's is never shared. One granted network is connected by the sandbox server (a
user-mode stack and a rule set: :mod:`.egress`) and gets :data:`.egress.RESOLV_CONF`
as its ``/etc/resolv.conf``.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from collections.abc import Sequence

from metasched.runtime.sandbox import egress

__all__ = ["ETC_PATHS", "STUB", "SYSTEM_PATHS", "find_bwrap", "identity_files",
           "sandbox_argv"]

STUB = ("/bin/sh", "-c", "echo; exec cat")
_MOUNT_POINTS = ("/workspace", "/home/user", "/tmp", "/.sandbox")  # /home/user: E2B's home
# Bound read-only where they exist (a symlink is made as the same symlink).
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
                "/sys/devices/system/cpu", "/sys/devices/system/node")  # CPU, NUMA topology
# What of /etc programs read (glob patterns; bound read-only where they exist). No
# credentials: neither shadow files nor package managers' or tools' settings (pip.conf,
# npmrc, gitconfig), which may hold tokens.
ETC_PATHS = (
    "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "ssl/certs",
    "ssl/openssl.cnf", "ca-certificates", "ca-certificates.conf", "localtime", "timezone",
    "nsswitch.conf", "host.conf", "gai.conf", "services", "protocols", "mime.types",
    "magic", "magic.mime", "locale.alias", "locale.conf", "default/locale", "os-release",
    "debian_version", "profile", "bash.bashrc", "inputrc", "terminfo", "fonts",
    "java-*", "python3*", "perl", "R", "ghc", "dotnet", "mono")
# What a configured system path may not be: the whole host, or all of /etc ...
NOT_SYSTEM_PATHS = ("/", "/etc")
# ... or at or under the sandbox's own mount points.
OWN_MOUNTS = ("/proc", "/dev", *_MOUNT_POINTS)


def find_bwrap() -> tuple[str | None, str]:
    """``(path, version)`` of a bubblewrap that can make a sandbox here, or ``(None,
    why not)``: missing, or present but refused (e.g. no permission to make namespaces).
    """
    path = shutil.which("bwrap", path="/usr/bin:/bin:/usr/local/bin:/usr/sbin:/sbin")
    if path is None:
        return None, ("bubblewrap is not installed (Debian/Ubuntu: apt-get install "
                      "bubblewrap; `make install` does it when run as root)")
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True,
                                 timeout=10).stdout.strip()
        probe = subprocess.run(
            [path, *sandbox_argv(path, network=False, hide=())[1:-len(STUB)], "/bin/true"],
            capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{path} cannot run: {e}"
    if probe.returncode != 0:
        why = (probe.stderr.strip().splitlines() or [f"exit status {probe.returncode}"])[-1]
        return None, f"{path} cannot make a sandbox here: {why}"
    return path, version or "bubblewrap"


def identity_files(uid: int, gid: int) -> dict[str, str]:
    """The text of ``/etc/passwd``, ``/etc/group`` and ``/etc/hosts`` of a sandbox whose
    commands run as ``uid``/``gid``: that user is ``sandbox`` (home ``/home/user``, the
    workspace), the host is ``sandbox``; ``root`` and ``nobody`` exist as on every system."""
    users = ["root:x:0:0:root:/root:/usr/sbin/nologin",
             f"sandbox:x:{uid}:{gid}:sandbox:/home/user:/bin/sh"]
    groups = ["root:x:0:", f"sandbox:x:{gid}:"]
    if uid != 65534:
        users.append("nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin")
    if gid != 65534:
        groups.append("nogroup:x:65534:")
    hosts = ["127.0.0.1\tlocalhost", "127.0.1.1\tsandbox",
             "::1\tlocalhost ip6-localhost ip6-loopback"]
    return {"/etc/passwd": "\n".join(users) + "\n", "/etc/group": "\n".join(groups) + "\n",
            "/etc/hosts": "\n".join(hosts) + "\n"}


def _bind(path: str, args: list[str], made: set[str], bound: list[str]) -> None:
    """Bind host ``path`` read-only at the same place (a symlink: the same symlink),
    its missing parents made as directories everyone may search (bwrap would make them
    as its umask allows)."""
    if not os.path.lexists(path):
        return
    parents = []
    parent = os.path.dirname(path)
    while parent not in made and not within(parent, bound):
        parents.append(parent)
        made.add(parent)
        parent = os.path.dirname(parent)
    for parent in reversed(parents):
        args += ["--perms", "0755", "--dir", parent]
    if os.path.islink(path):
        args += ["--symlink", os.readlink(path), path]
    else:
        args += ["--ro-bind", path, path]
        bound.append(path)


def within(path: str, roots: Sequence[str]) -> bool:
    """Whether ``path`` is one of ``roots`` or lies under one."""
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def sandbox_argv(bwrap: str, *, network: bool, hide: Sequence[str],
                 extra: Sequence[str] = (), system_paths: Sequence[str] = ()) -> list[str]:
    """The bwrap command for one sandbox (its stub last).

    Args:
        bwrap: the bwrap executable.
        network: granted network (its resolver is :mod:`.egress`'s); the sandbox has a
            network namespace of its own either way.
        hide: host paths to make invisible where they lie under a bound path (an
            existing directory gets an empty tmpfs over it, an existing file
            ``/dev/null``).
        extra: more bwrap options, after the hiding ones (e.g. a template's bind).
        system_paths: more host paths bound read-only (absolute: see
            :class:`~metasched.runtime.sandbox.config.SandboxConfig`).
    """
    args = [bwrap, "--die-with-parent", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
            "--unshare-net", "--hostname", "sandbox"]
    bound: list[str] = []
    made = {"/", "/etc"}
    for path in SYSTEM_PATHS:
        _bind(path, args, made, bound)
    args += ["--perms", "0755", "--dir", "/etc"]
    etc = sorted({p for pattern in ETC_PATHS for p in glob.glob(os.path.join("/etc", pattern))})
    for path in etc:
        _bind(path, args, made, bound)
    if network:  # names the user-mode stack's resolver (see .egress)
        args += ["--ro-bind", egress.RESOLV_CONF, "/etc/resolv.conf"]
    for path in system_paths:
        _bind(path, args, made, bound)
    args += ["--dev", "/dev", "--proc", "/proc"]
    for point in _MOUNT_POINTS:
        args += ["--dir", point]
    for path in hide:
        real = os.path.realpath(path)
        if not within(real, [os.path.realpath(b) for b in bound]):
            continue  # not in the sandbox at all
        if os.path.isdir(path):
            args += ["--tmpfs", real]
        elif os.path.exists(path):
            args += ["--ro-bind", "/dev/null", real]
    args += [*extra, "--chdir", "/", "--", *STUB]
    return args
