"""Naming how a command ended: the :class:`~metasched.runtime.outcome.Outcome`.

The reason is one of "exit code N", "killed by SIGNAME", "timeout after T s", "cpu time
limit exceeded", "memory limit exceeded (N MB)", "process limit exceeded (N)",
"cannot start: <error>" or, for a child reaped by someone else, "exit status lost
(reaped elsewhere)".

A command that failed after its cgroup refused it a fork (``pids.max``) is named
"process limit exceeded (N)" unless a timeout or a memory limit explains it first.

A failure is named "memory limit exceeded (N MB)" when a limit was set and (a) the
group watchdog killed it, (b) it died of SIGKILL that this package did not send (the
kernel's OOM killer is the usual sender), (c) its peak resident set (``ru_maxrss`` from
``wait4``) reached 80% of the limit, or (d) the tail of its stderr carries an
allocation-failure message (Python's ``MemoryError``, ``ENOMEM``'s "Cannot allocate
memory", C++ ``bad_alloc``, "out of memory", ...). (c) catches a C program whose
``malloc`` failed after growing, (d) one whose first huge allocation failed.

SIGXCPU (the soft ``RLIMIT_CPU``) or SIGKILL once the CPU time used reached the limit
(the hard one) is named "cpu time limit exceeded".
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING, Any

from metasched.runtime.outcome import Outcome

if TYPE_CHECKING:
    from metasched.runtime.process.child import Child

__all__ = ["cannot_start", "outcome_of"]

_MAXRSS_FRACTION = 0.8  # peak RSS at this fraction of RLIMIT_AS counts as "hit the limit"

# Lower-cased fragments of the messages programs print when an allocation fails.
_MEMORY_MARKERS = (
    "memoryerror",  # Python (and numpy's _ArrayMemoryError)
    "cannot allocate memory",  # strerror(ENOMEM)
    "out of memory",  # Go, node, many C programs
    "outofmemory",  # Java
    "bad_alloc",  # C++
    "memory exhausted",  # bison, gcc ("virtual memory exhausted")
    "memory allocation of",  # Rust ("memory allocation of N bytes failed")
    "failed to allocate",
    "unable to allocate",
    "can't start new thread",  # Python: a thread stack did not fit in RLIMIT_AS
)


def cannot_start(exc: BaseException, detail: dict[str, Any]) -> Outcome:
    """The Outcome of a command that could not start because of ``exc``."""
    why = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return Outcome(ok=False, reason=f"cannot start: {why}", detail=detail)


def command_not_found(out: Outcome, program: str | None) -> Outcome:
    """A start that failed because ``program`` (a name looked up in ``PATH``) is not
    there, said so: ``cannot start: pytest: command not found`` rather than the errno's
    words (a program named by its path keeps them)."""
    if (program and "/" not in program and out.reason in _NOT_FOUND):
        out.reason = f"cannot start: {program}: command not found"
    return out


_NOT_FOUND = ("cannot start: No such file or directory",)


def outcome_of(child: Child, timeout_s: float, mem_limit_mb: float | None,
               cpu_time_s: float | None, launched: bool, detail: dict[str, Any], *,
               pids_max: int | None = None) -> Outcome:
    """How the reaped ``child`` ended; ``launched``: it ran under the prlimit(1) launcher;
    ``pids_max``: its process limit (named when ``child.pids_limited``)."""
    stdout, stderr = child.out.text(), child.err.text()
    rc = child.returncode
    if launched and rc in (126, 127) and stderr.startswith("prlimit: failed to execute"):
        # The program vanished or changed between the check and the exec.
        why = stderr.strip().rsplit(": ", 1)[-1]
        return Outcome(ok=False, reason=f"cannot start: {why}", exit_code=rc, detail=detail)
    if rc is None:  # reaped by someone else (e.g. a waitpid(-1) child watcher)
        return Outcome(ok=False, reason="exit status lost (reaped elsewhere)", stdout=stdout,
                       stderr=stderr, detail=detail)
    sig = -rc if rc < 0 else 0
    reason = ""
    if child.killed_by == "cancelled" and sig == signal.SIGKILL:
        reason = "cancelled"  # its caller cancelled it (Process.cancel)
    elif child.killed_by == "memory" and mem_limit_mb is not None:
        reason = _memory_reason(mem_limit_mb)  # the watchdog saw it: definitive
    elif child.killed_by == "timeout" and sig == signal.SIGKILL:
        reason = f"timeout after {timeout_s:g} s"
    elif rc == 0:
        reason = ""
    elif cpu_time_s is not None and (
            sig == signal.SIGXCPU or (sig == signal.SIGKILL and child.cpu_s >= cpu_time_s)):
        reason = "cpu time limit exceeded"
    elif mem_limit_mb is not None and _looks_like_memory(sig, child.maxrss_bytes,
                                                         mem_limit_mb, stderr):
        reason = _memory_reason(mem_limit_mb)
    elif getattr(child, "pids_limited", False) and pids_max is not None:
        reason = f"process limit exceeded ({pids_max})"
    elif sig:
        reason = f"killed by {_signal_name(sig)}"
    else:
        reason = f"exit code {rc}"
    return Outcome(ok=not reason, reason=reason, exit_code=rc, stdout=stdout, stderr=stderr,
                   detail=detail)


def _memory_reason(mem_limit_mb: float) -> str:
    return f"memory limit exceeded ({mem_limit_mb:g} MB)"


def _looks_like_memory(sig: int, maxrss_bytes: int, mem_limit_mb: float, stderr: str) -> bool:
    """Whether a failure under a memory limit was caused by it (see the module docstring)."""
    if sig == signal.SIGKILL:
        return True  # not sent by us (timeouts are classified earlier): the OOM killer
    if maxrss_bytes >= _MAXRSS_FRACTION * mem_limit_mb * 1024 * 1024:
        return True
    text = stderr.lower()
    return any(marker in text for marker in _MEMORY_MARKERS)


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"
