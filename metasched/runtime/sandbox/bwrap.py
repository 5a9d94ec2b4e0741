"""The ``bwrap`` (bubblewrap) command line that makes a sandbox's namespaces, and the
check that bubblewrap is here and works.

The sandbox's root is bwrap's own tmpfs holding read-only binds of every top-level entry
of the host's ``/`` (symlinks such as ``/bin -> usr/bin`` recreated), except ``/proc``
(a new one, for the sandbox's pid namespace), ``/dev`` (a minimal new one) and ``/tmp``;
and the mount points the server fills in: ``/workspace``, ``/tmp``, and ``/.sandbox``
(staging). Hidden paths (the journal's files, configured ones) get an empty tmpfs over
them (directories) or ``/dev/null`` (files). Binding the top level one entry at a time,
instead of ``/`` whole, is what makes room for ``/workspace`` at the root.

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

import os
import shutil
import subprocess
from collections.abc import Sequence

from metasched.runtime.sandbox.egress import RESOLV_CONF

__all__ = ["STUB", "find_bwrap", "sandbox_argv"]

STUB = ("/bin/sh", "-c", "echo; exec cat")
_OWN = ("proc", "dev", "tmp")  # made new inside the sandbox, never bound from the host
_MOUNT_POINTS = ("/workspace", "/tmp", "/.sandbox")


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


def sandbox_argv(bwrap: str, *, network: bool, hide: Sequence[str],
                 extra: Sequence[str] = (), root: str = "/") -> list[str]:
    """The bwrap command for one sandbox (its stub last).

    Args:
        bwrap: the bwrap executable.
        network: granted network (its resolver is :mod:`.egress`'s); the sandbox has a
            network namespace of its own either way.
        hide: host paths to make invisible (an existing directory gets an empty tmpfs
            over it, an existing file ``/dev/null``).
        extra: more bwrap options, after the hiding ones (e.g. a template's bind).
        root: the host directory whose entries are bound (``/``; tests may differ).
    """
    args = [bwrap, "--die-with-parent", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
            "--unshare-net", "--hostname", "sandbox"]
    for name in sorted(os.listdir(root)):
        if name in _OWN or name.startswith("."):
            continue
        path = os.path.join(root, name)
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), "/" + name]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, "/" + name]
        elif os.path.isfile(path):
            args += ["--ro-bind", path, "/" + name]
    args += ["--dev", "/dev", "--proc", "/proc"]
    for point in _MOUNT_POINTS:
        args += ["--dir", point]
    for path in hide:
        if os.path.isdir(path):
            args += ["--tmpfs", os.path.realpath(path)]
        elif os.path.exists(path):
            args += ["--ro-bind", "/dev/null", os.path.realpath(path)]
    if network and os.path.isfile(os.path.join(root, "etc/resolv.conf")):
        args += ["--ro-bind", RESOLV_CONF, "/etc/resolv.conf"]
    args += [*extra, "--chdir", "/", "--", *STUB]
    return args
