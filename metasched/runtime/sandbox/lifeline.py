"""The lifeline: what ends a dispatcher's host commands the moment the dispatcher dies,
however it dies (kill -9 included), so that none can finish a side effect after it.

Sandboxed commands need none: they die with the dispatcher through the kernel alone.
The sandbox server gets SIGKILL when the dispatcher dies (``PR_SET_PDEATHSIG``), each
sandbox's ``bwrap`` when the server dies and the sandbox's pid-namespace init when its
``bwrap`` dies (``--die-with-parent``), and the end of a pid namespace's init makes the
kernel kill every process in the namespace.

Commands on the host (isolation off) have no pid namespace of their own (they see the
host's pids, as a program run by hand does), and short of a pid namespace's end the
kernel kills no set of processes when another process dies. So a small process started
with the dispatcher (``python -m metasched.runtime.sandbox.lifeline``, in a session of
its own) blocks reading a pipe that only the dispatcher writes to. The kernel closes the
dispatcher's end when the dispatcher exits, whatever the cause; the read returns at that
instant and the lifeline kills, then exits:

- the dispatcher's cgroup subtrees, where commands run in cgroup slots: on v2 one write
  to ``cgroup.kill`` (the kernel kills the subtree, forks included); on v1 forks are
  stopped (``pids.max`` 0) and the members killed until none is left;
- the process groups the dispatcher registered (the commands it spawned itself), with
  every descendant of their leaders (a process that left its group with ``setsid``):
  all stopped first (SIGSTOP, so that none can fork away while the tree is walked,
  through ``/proc/PID/task/TID/children``), then killed.

The dispatcher registers a command's group (``+pgid``) when it spawns it and withdraws
it (``-pgid``) before it reaps the command's leader, after which the id could be
reused; the pipe keeps them in order, so a withdrawn group is never killed. After a
normal close every command has already ended: the lifeline finds nothing left to kill.

Only the standard library is imported on the lifeline's side.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = ["Lifeline"]

_ROUNDS = 200  # kill passes over a v1 subtree (or stop passes over a tree) at most


class Lifeline:
    """The dispatcher's end: starts the lifeline process and tells it the commands'
    process groups (see the module docstring).

    Args:
        cgroup_dirs: the dispatcher's cgroup subtrees (one per hierarchy), killed
            whole when it dies.

    Raises:
        OSError: the process could not be started.
    """

    def __init__(self, cgroup_dirs: Sequence[str] = ()) -> None:
        read, self._fd = os.pipe()  # neither is inherited by anything started later
        package_root = str(Path(__file__).resolve().parents[3])
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": package_root,
               "PYTHONDONTWRITEBYTECODE": "1"}
        # This interpreter; by /proc where its path is out of this user's reach (a
        # dispatcher run unprivileged with an interpreter under another user's home).
        exe = sys.executable if os.access(sys.executable, os.X_OK) else "/proc/self/exe"
        try:
            self.proc = subprocess.Popen(
                [exe, "-m", "metasched.runtime.sandbox.lifeline", str(read),
                 *cgroup_dirs],
                pass_fds=(read,), env=env, cwd="/", stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, start_new_session=True)
        except BaseException:
            os.close(self._fd)
            raise
        finally:
            os.close(read)

    def track(self, pgid: int) -> None:
        """Kill process group ``pgid`` (and its members' descendants) if the dispatcher
        dies before :meth:`forget`."""
        self._send(b"+%d\n" % pgid)

    def forget(self, pgid: int) -> None:
        """Withdraw ``pgid``: call it before reaping the group's leader."""
        self._send(b"-%d\n" % pgid)

    def _send(self, line: bytes) -> None:
        if self._fd < 0:
            return
        try:
            os.write(self._fd, line)  # under PIPE_BUF: one atomic write
        except OSError:  # the lifeline is gone: nothing is listening
            pass

    def close(self) -> None:
        """End the lifeline (it kills whatever is still registered: nothing, after the
        commands have ended) and wait for it."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# --- the lifeline process -----------------------------------------------------------


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _write(path: str, value: str) -> bool:
    try:
        with open(path, "w") as f:
            f.write(value)
        return True
    except OSError:
        return False


def _members(top: str) -> list[int]:
    """Every process in cgroup ``top`` and the cgroups below it."""
    pids: list[int] = []
    for d, _, _ in os.walk(top):
        try:
            with open(os.path.join(d, "cgroup.procs")) as f:
                pids += [int(x) for x in f.read().split()]
        except OSError:
            pass
    return pids


def kill_cgroup(top: str) -> None:
    """Kill everything in the cgroup subtree ``top`` (see the module docstring)."""
    if _write(os.path.join(top, "cgroup.kill"), "1"):
        return
    _write(os.path.join(top, "pids.max"), "0")  # v1 pids: no fork succeeds below it
    for _ in range(_ROUNDS):
        pids = _members(top)
        if not pids:
            return
        for pid in pids:
            _kill(pid, signal.SIGKILL)
        time.sleep(0.001)


def _children(pid: int) -> list[int]:
    """The children of ``pid`` (of each of its threads), from ``/proc``."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                out += [int(x) for x in f.read().split()]
        except OSError:
            pass
    return out


def kill_groups(groups: Iterable[int]) -> None:
    """Stop, then kill, every member of ``groups`` and every descendant of their
    leaders (those that left the group with ``setsid`` too)."""
    groups = {g for g in groups if g > 1}
    if not groups:
        return
    for g in groups:  # from here on no member runs, so none forks
        _signal_group(g, signal.SIGSTOP)
    # Each process found is stopped before its children are read; passes repeat until
    # one finds nothing new (a child forked just before its parent stopped shows then).
    found: set[int] = set(groups)  # the leaders (a group's id is its leader's pid)
    for _ in range(_ROUNDS):
        new = [c for pid in list(found) for c in _children(pid) if c not in found]
        if not new:
            break
        for pid in new:
            _kill(pid, signal.SIGSTOP)
        found.update(new)
    for pid in found:
        _kill(pid, signal.SIGKILL)
    for g in groups:
        _signal_group(g, signal.SIGKILL)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def main(argv: list[str]) -> None:
    """Entry point: ``lifeline FD [CGROUP_DIR...]``."""
    fd, dirs = int(argv[1]), argv[2:]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the dispatcher's to handle
    groups: set[int] = set()
    rest = b""
    while True:
        try:
            data = os.read(fd, 65536)
        except InterruptedError:
            continue
        if not data:
            break  # the dispatcher's end closed: it exited or closed us
        rest += data
        *lines, rest = rest.split(b"\n")
        for line in lines:
            if line[:1] == b"+":
                groups.add(int(line[1:]))
            elif line[:1] == b"-":
                groups.discard(int(line[1:]))
    for top in dirs:
        kill_cgroup(top)
    kill_groups(groups)


if __name__ == "__main__":
    main(sys.argv)
