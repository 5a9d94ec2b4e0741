"""The entry points: :func:`run_process`, :func:`start_process` and :class:`Process`.

They tie the parts together: check the arguments, build the environment and limits
(:mod:`.environment`, :mod:`.limits`), make the scratch directory (:mod:`.workdir`),
spawn (:mod:`.spawn`), watch the child (:mod:`.child`, :mod:`.memory_watch`, the
timeout), and name how it ended (:mod:`.failures`).

When the command's main process exits, whatever is left of its process group is killed:
those processes would go on using cores the scheduler has handed back, and hold the
output pipes. A process that left the group (``setsid``) escapes this; only the cgroup
option (:mod:`.cgroup`) catches it, and its hold on the pipes is cut after 0.5 s.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from metasched.runtime.outcome import Outcome
from metasched.runtime.process.cgroup import CpusetCgroup, release_cgroup
from metasched.runtime.process.child import Child, close_fds, kill_group
from metasched.runtime.process.environment import child_env
from metasched.runtime.process.failures import cannot_start, outcome_of
from metasched.runtime.process.limits import (
    check_executable,
    prlimit_launcher,
    rlimit_preexec,
    rlimits,
)
from metasched.runtime.process.memory_watch import MemoryWatch
from metasched.runtime.process.spawn import spawn
from metasched.runtime.process.workdir import make_workdir, remove_tree

__all__ = ["Process", "run_process", "start_process"]

_DRAIN_GRACE_S = 0.5  # after the group is killed, how long to wait for EOF on the pipes


async def run_process(
    argv: Sequence[str],
    *,
    cores: Sequence[int],
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    mem_limit_mb: float | None = None,
    cpu_time_s: float | None = None,
    tail_bytes: int = 4096,
    extra_env: Mapping[str, str] | None = None,
    cwd_root: str | None = None,
    cgroup: CpusetCgroup | None = None,
    on_start: Callable[[int], None] | None = None,
) -> Outcome:
    """Run one command pinned to ``cores`` and report how it ended.

    Args:
        argv: the program and its arguments (executed directly, never by a shell; the
            program is looked up on the child's ``PATH`` when it has no slash).
        cores: the CPU ids granted to the action; the child runs on exactly these.
        timeout_s: wall-clock limit; on expiry the whole process group is killed.
        env: the child's environment; None inherits this process's. A given mapping is
            used as is, plus ``PATH`` from this process when it has none.
        mem_limit_mb: ``RLIMIT_AS`` of every process of the action, in MiB; the group's
            resident memory is also watched against it.
        cpu_time_s: ``RLIMIT_CPU`` of every process, rounded up to whole seconds.
        tail_bytes: how many trailing bytes of stdout and of stderr to keep.
        extra_env: added to the environment (after ``env``, before the thread variables).
        cwd_root: where the temporary working directory is created (default: the system
            temporary directory). It is removed when the call returns. A tmpfs makes
            short actions cheaper (see :mod:`.workdir`).
        cgroup: optional cpuset cgroup confinement (a no-op where unavailable).
        on_start: called with the child's pid (= its process group id) once it runs, so
            a caller can record it (the dispatcher journals it: after a crash, the next
            dispatcher kills the groups left behind).

    Returns:
        An Outcome: ``ok`` iff the exit status was 0; else ``reason`` is one of "exit code
        N", "killed by SIGNAME", "timeout after T s", "cpu time limit exceeded", "memory
        limit exceeded (N MB)" or "cannot start: <error>". ``exit_code`` is the return
        code (negative: the signal), ``detail`` is ``{"pid": pid, "cores": [...]}``
        (no pid when it could not start).

    Raises:
        TypeError: ``argv`` is a string rather than a sequence of arguments.
        ValueError: ``cores`` is empty or ``timeout_s`` is not positive.
        asyncio.CancelledError: re-raised after the process group has been killed.
    """
    return await start_process(
        argv, cores=cores, timeout_s=timeout_s, env=env, mem_limit_mb=mem_limit_mb,
        cpu_time_s=cpu_time_s, tail_bytes=tail_bytes, extra_env=extra_env,
        cwd_root=cwd_root, cgroup=cgroup, on_start=on_start).wait()


def start_process(
    argv: Sequence[str],
    *,
    cores: Sequence[int],
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    mem_limit_mb: float | None = None,
    cpu_time_s: float | None = None,
    tail_bytes: int = 4096,
    extra_env: Mapping[str, str] | None = None,
    cwd_root: str | None = None,
    cgroup: CpusetCgroup | None = None,
    on_start: Callable[[int], None] | None = None,
) -> Process:
    """:func:`run_process` in two halves: start the command now, before returning (no
    event-loop turn between the call and the spawn), and ``await`` the returned
    :class:`Process`'s ``wait()`` for the Outcome. Must be called from the thread that
    runs the event loop. Arguments, errors and the Outcome are those of
    :func:`run_process`; a command that cannot start gives a Process whose ``wait()``
    returns the failure at once.

    A caller that may never await ``wait()`` (e.g. it is shutting down) must call
    :meth:`Process.abandon` instead, which kills the group and cleans up.
    """
    if isinstance(argv, (str, bytes)):
        raise TypeError("argv must be a sequence of arguments, not a string (no shell)")
    core_list = [int(c) for c in cores]
    if not core_list:
        raise ValueError("cores must name at least one CPU")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
    args = [os.fspath(a) for a in argv]
    detail: dict[str, Any] = {"cores": core_list}
    if not args:
        return Process.failed(Outcome(ok=False, reason="cannot start: empty argv",
                                      detail=detail))

    try:
        environ = child_env(env, extra_env, len(core_list))
    except ValueError as exc:  # a '=' in a variable name
        return Process.failed(cannot_start(exc, detail))
    limits = rlimits(mem_limit_mb, cpu_time_s)
    preexec = None
    launcher = prlimit_launcher() if limits else None
    if launcher is not None:
        try:
            # The launcher would report a missing program as its own exit status.
            check_executable(args[0], environ.get(b"PATH", os.defpath.encode()))
        except OSError as exc:
            return Process.failed(cannot_start(exc, detail))
        args = [launcher, *(f"--{name}={soft}:{hard}" for _, name, soft, hard in limits),
                "--", *args]
    elif limits:
        preexec = rlimit_preexec(limits)
    loop = asyncio.get_running_loop()
    try:
        cwd = make_workdir(cwd_root)
    except OSError as exc:
        return Process.failed(cannot_start(exc, detail))
    try:
        proc = Process._start(loop, args, core_list, environ, preexec, cwd, timeout_s,
                              mem_limit_mb, cpu_time_s, tail_bytes, cgroup, detail,
                              launched=launcher is not None, on_start=on_start)
    except BaseException:
        remove_tree(cwd)
        raise
    if proc.pid is None:  # it did not start: nothing will use or remove the directory
        remove_tree(cwd)
    return proc


class Process:
    """A command started by :func:`start_process`: ``await wait()`` for its Outcome
    (one waiter; once it has returned, ``wait()`` returns the same Outcome again), or
    :meth:`abandon` it."""

    def __init__(self, outcome: Outcome | None = None) -> None:
        self.pid: int | None = None  # also its process group id
        self._outcome = outcome
        self._child: Child | None = None
        self._claimed = False  # wait() or abandon() has taken over the child

    @classmethod
    def failed(cls, outcome: Outcome) -> Process:
        """A command that could not start: ``wait()`` returns ``outcome``."""
        return cls(outcome)

    @classmethod
    def _start(cls, loop: asyncio.AbstractEventLoop, args: list[str], cores: list[int],
               env: dict[bytes, bytes], preexec: Callable[[], None] | None, cwd: str,
               timeout_s: float, mem_limit_mb: float | None, cpu_time_s: float | None,
               tail_bytes: int, cgroup: CpusetCgroup | None, detail: dict[str, Any], *,
               launched: bool, on_start: Callable[[int], None] | None = None) -> Process:
        try:
            out_r, out_w = os.pipe()
        except OSError as exc:
            return cls.failed(cannot_start(exc, detail))
        try:
            err_r, err_w = os.pipe()
        except OSError as exc:
            close_fds(out_r, out_w)
            return cls.failed(cannot_start(exc, detail))
        try:
            try:
                proc = spawn(args, cores, env, cwd, out_w, err_w, preexec)
            finally:
                close_fds(out_w, err_w)  # the child has its copies; EOF needs ours closed
        except Exception as exc:  # OSError from exec, SubprocessError from preexec, ValueError
            close_fds(out_r, err_r)
            return cls.failed(cannot_start(exc, detail))

        pid = proc.pid
        try:
            child = Child(loop, proc, out_r, err_r, tail_bytes)
        except BaseException:  # e.g. the loop is closing: do not leave the child behind
            kill_group(pid)
            proc.wait()
            close_fds(out_r, err_r)
            raise
        self = cls()
        self.pid, self._child, self._loop, self._cwd = pid, child, loop, cwd
        self._limits = (timeout_s, mem_limit_mb, cpu_time_s, launched)
        self._detail = {"pid": pid, "cores": cores}
        self._cgroup = cgroup
        self._cg_path = cgroup.confine(pid, cores) if cgroup is not None else None
        if on_start is not None:
            on_start(pid)
        self._watch = None
        if mem_limit_mb is not None:
            self._watch = MemoryWatch.for_loop(loop)
            self._watch.add(pid, int(mem_limit_mb * 1024 * 1024), lambda: child.kill("memory"))
        self._timer = loop.call_later(timeout_s, child.kill, "timeout")
        return self

    async def wait(self) -> Outcome:
        """How the command ended (see :func:`run_process`). Cancelling the wait kills
        the group; the cancellation is re-raised once it is dead (or after a bound)."""
        if self._outcome is not None:
            return self._outcome
        if self._claimed:
            raise RuntimeError("this Process already has a waiter")
        self._claimed = True
        child, pid = self._child, self.pid
        try:
            try:
                try:
                    await child.exited
                finally:
                    self._stop_watching()
                # The leader is a zombie, so its pid still names this group: end what
                # is left of it (those processes hold the granted cores and the pipes),
                # then reap.
                kill_group(pid)
                child.reap()
                await child.drained(_DRAIN_GRACE_S)
            except asyncio.CancelledError:
                if not child.reaped:
                    child.kill("cancelled")
                    await child.reap_after_kill()
                raise
            finally:
                self._release(child)
        finally:
            remove_tree(self._cwd)
        self._outcome = outcome_of(child, *self._limits, self._detail)
        return self._outcome

    def abandon(self) -> None:
        """For a caller that will not await :meth:`wait`: kill the group, reap it when
        it exits, close its pipes, remove its directory. A no-op once ``wait()`` has
        begun (cancel that instead) and for a command that did not start."""
        if self._claimed or self._child is None:
            return
        self._claimed = True
        self._stop_watching()
        self._release(self._child)
        remove_tree(self._cwd)
        self._outcome = Outcome(ok=False, reason="cancelled", detail=self._detail)

    def _stop_watching(self) -> None:
        self._timer.cancel()
        if self._watch is not None:
            self._watch.remove(self.pid)

    def _release(self, child: Child) -> None:
        if not child.reaped:  # cancelled twice, abandoned, or it outlived SIGKILL so far
            child.kill("cancelled")
            child.reap_in_background()
        child.close()
        if self._cg_path is not None:
            release_cgroup(self._loop, self._cgroup, self._cg_path)

