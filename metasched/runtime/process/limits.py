"""rlimits of a command, and how they are put in place before its first instruction.

- ``mem_limit_mb`` sets ``RLIMIT_AS`` (address space, per process). The address space
  of a program is larger than its resident memory: glibc reserves 64 MB arenas per
  thread and runtimes such as the JVM or Go reserve heaps up front, so threaded
  programs need a generous limit. A group of processes is watched as a whole by
  :mod:`.memory_watch`.
- ``cpu_time_s`` sets ``RLIMIT_CPU`` rounded up to whole seconds, with the hard limit
  one second higher so that SIGXCPU (the soft limit) arrives before SIGKILL (the hard
  one); ``RLIMIT_CORE`` is set to 0 with it.
- ``nproc`` sets ``RLIMIT_NPROC``: processes of the command's *user*, which bounds the
  command only where the user is its own (a sandbox's, without a pids cgroup).

The limits must be in place before user code runs. ``prlimit(pid, ...)`` after the
spawn would let its first instructions (and any child forked then) run unlimited, and a
``preexec_fn`` forces ``fork`` of the whole parent (~25 spawns/s with a 1 GB parent,
and Python code in a forked child of a threaded process). So the command is run through
util-linux ``prlimit(1)`` (``prlimit --as=.. --cpu=.. --core=0:0 -- argv``), which sets
the limits on itself and execs the command: a second exec (~0.45x of xargs), independent
of the parent's size. Since the launcher would report a missing program as its own exit
status, the program is looked up first (as ``execvp`` does) and "cannot start" reported
(:func:`check_executable`). Where ``prlimit(1)`` is missing, a ``preexec_fn`` that only
calls ``setrlimit`` is the fallback (:func:`rlimit_preexec`).
"""

from __future__ import annotations

import errno
import math
import os
import resource
import shutil
import subprocess
from collections.abc import Callable

__all__ = ["check_executable", "prlimit_launcher", "rlimit_preexec", "rlimits"]

_CPU_HARD_MARGIN_S = 1  # RLIMIT_CPU hard limit above the soft one: SIGXCPU comes first

# (resource, prlimit(1) option name, soft, hard)
Limit = tuple[int, str, int, int]


def rlimits(mem_limit_mb: float | None, cpu_time_s: float | None,
            nproc: int | None = None) -> list[Limit]:
    """The rlimits to set: (resource, prlimit(1) option name, soft, hard).

    Each limit is clamped to this process's hard limit (an unprivileged process cannot
    raise it, and the child would fail to start).
    """
    limits: list[Limit] = []
    if mem_limit_mb is not None:
        nbytes = int(mem_limit_mb * 1024 * 1024)
        limits.append((resource.RLIMIT_AS, "as", *_clamp(resource.RLIMIT_AS, nbytes, nbytes)))
    if cpu_time_s is not None:
        soft = max(1, math.ceil(cpu_time_s))
        limits.append((resource.RLIMIT_CPU, "cpu",
                       *_clamp(resource.RLIMIT_CPU, soft, soft + _CPU_HARD_MARGIN_S)))
        # SIGXCPU's default action dumps core: a core file of a large process is slow
        # to write and lands in a directory that is about to be removed.
        limits.append((resource.RLIMIT_CORE, "core", 0, 0))
    if nproc is not None:
        limits.append((resource.RLIMIT_NPROC, "nproc", *_clamp(resource.RLIMIT_NPROC, nproc,
                                                                nproc)))
    return limits


def _clamp(which: int, soft: int, hard: int) -> tuple[int, int]:
    _, cur_hard = resource.getrlimit(which)
    if cur_hard != resource.RLIM_INFINITY:
        soft, hard = min(soft, cur_hard), min(hard, cur_hard)
    return soft, hard


def rlimit_preexec(limits: list[Limit]) -> Callable[[], None]:
    """A function setting ``limits`` in the child (computed here: it only makes calls)."""
    setrlimit = resource.setrlimit
    values = [(which, (soft, hard)) for which, _, soft, hard in limits]

    def preexec() -> None:
        for which, value in values:
            setrlimit(which, value)

    return preexec


# util-linux prlimit(1), found on first use: None where absent (then preexec_fn).
_prlimit_checked = False
_prlimit_path: str | None = None


def prlimit_launcher() -> str | None:
    """The path of util-linux ``prlimit(1)``, or None where there is none, or where the
    program of that name is not util-linux's (whose options the launch relies on)."""
    global _prlimit_checked, _prlimit_path
    if not _prlimit_checked:
        _prlimit_checked = True
        path = shutil.which("prlimit", path="/usr/bin:/bin:/usr/sbin:/sbin:/usr/local/bin")
        if path is not None:
            try:
                probe = subprocess.run([path, "--version"], capture_output=True, text=True,
                                       timeout=5)
            except (OSError, subprocess.SubprocessError):
                probe = None
            if probe is not None and probe.returncode == 0 and "util-linux" in probe.stdout:
                _prlimit_path = path
    return _prlimit_path


def check_executable(name: str, path: bytes) -> None:
    """Raise the error ``execvp`` would fail with when ``name`` cannot be executed.

    Like ``execvp``: a name with a slash is taken as is, else every ``PATH`` entry is
    tried; "Permission denied" if some candidate exists but is not executable, else
    "No such file or directory".
    """
    if "/" in name:
        candidates = [name]
    else:
        candidates = [os.path.join(os.fsdecode(d), name) for d in path.split(b":")]
    denied = False
    for candidate in candidates:
        if os.path.isfile(candidate):
            if os.access(candidate, os.X_OK):
                return
            denied = True
        elif os.path.isdir(candidate):
            denied = True
    code = errno.EACCES if denied else errno.ENOENT
    raise OSError(code, os.strerror(code))
