"""The entry points: :func:`run_process`, :func:`start_process` and :class:`Process`.

They tie the parts together: check the arguments, build the environment and limits
(:mod:`.environment`, :mod:`.limits`), make the scratch directory (:mod:`.workdir`),
spawn (:mod:`.spawn`, or the sandbox server for a command that runs in a sandbox:
:mod:`metasched.runtime.sandbox`), watch the child (:mod:`.child`, :mod:`.memory_watch`,
the timeout), and name how it ended (:mod:`.failures`).

When the command's main process exits, whatever is left of it is killed: those
processes would go on using cores the scheduler has handed back, and hold the output
pipes. With cgroups (``sandboxes``) that is everything in its cgroup slot, processes
that left its session (``setsid``) included; without, its process group, and the hold
of a process that left it on the pipes is cut after 0.5 s.

Sandboxes (``sandboxes``, the dispatcher's
:class:`~metasched.runtime.sandbox.manager.Sandboxes`): a command given a ``sandbox``
is started there by the sandbox server, inside a cgroup slot from its first instruction;
a command without one is spawned here and moved into a slot just after its start (it is
pinned by affinity before). Limits the slot's controllers enforce (memory, processes)
are not set as rlimits too; those it lacks fall back to rlimits.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from metasched.runtime.outcome import Outcome
from metasched.runtime.process.child import Child, close_fds, kill_group
from metasched.runtime.process.environment import child_env
from metasched.runtime.process.failures import cannot_start, command_not_found, outcome_of
from metasched.runtime.process.limits import (
    check_executable,
    prlimit_launcher,
    rlimit_preexec,
    rlimits,
)
from metasched.runtime.process.memory_watch import MemoryWatch
from metasched.runtime.process.spawn import spawn
from metasched.runtime.process.workdir import make_workdir, remove_tree

if TYPE_CHECKING:
    from metasched.runtime.sandbox.cgroups import Slot
    from metasched.runtime.sandbox.manager import Sandbox, Sandboxes

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
    pids_max: int | None = None,
    sandboxes: Sandboxes | None = None,
    sandbox: Sandbox | None = None,
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
        mem_limit_mb: the memory limit of all the action's processes together (and the
            files they write to a tmpfs), in MiB: a cgroup's, where ``sandboxes`` has
            the memory controller; else ``RLIMIT_AS`` of every process, with the group's
            resident memory watched against it.
        cpu_time_s: ``RLIMIT_CPU`` of every process, rounded up to whole seconds.
        tail_bytes: how many trailing bytes of stdout and of stderr to keep.
        extra_env: added to the environment (after ``env``, before the thread variables).
        cwd_root: where the temporary working directory is created (default: the system
            temporary directory). It is removed when the call returns. A tmpfs makes
            short actions cheaper (see :mod:`.workdir`). Not used in a sandbox (the
            command runs in the sandbox's workspace).
        pids_max: processes and threads the action may have at once (a cgroup's
            ``pids.max``; in a sandbox without the pids controller, ``RLIMIT_NPROC`` of
            its user); None: no limit.
        sandboxes: the dispatcher's sandboxes and cgroups (None: affinity and rlimits
            only).
        sandbox: run the command in this sandbox of ``sandboxes`` (ready).
        on_start: called with the child's pid (= its process group id) once it runs, so
            a caller can record it (the dispatcher journals it: after a crash, the next
            dispatcher kills the groups left behind).

    Returns:
        An Outcome: ``ok`` iff the exit status was 0; else ``reason`` is one of "exit code
        N", "killed by SIGNAME", "timeout after T s", "cpu time limit exceeded", "memory
        limit exceeded (N MB)", "process limit exceeded (N)" or "cannot start:
        <error>". ``exit_code`` is the return
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
        cwd_root=cwd_root, pids_max=pids_max, sandboxes=sandboxes, sandbox=sandbox,
        on_start=on_start).wait()


def start_process(argv: Sequence[str], **kwargs: Any) -> Process:
    """:func:`run_process` in two halves (see :func:`_start_process` for the arguments):
    start the command now and return its :class:`Process`. A program named without a
    path that is not in ``PATH`` fails with ``cannot start: <name>: command not
    found``."""
    proc = _start_process(argv, **kwargs)
    if not isinstance(argv, (str, bytes)) and argv:
        proc.program = os.fspath(argv[0])
    if proc._outcome is not None:
        command_not_found(proc._outcome, proc.program)
    return proc


def _start_process(
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
    pids_max: int | None = None,
    sandboxes: Sandboxes | None = None,
    sandbox: Sandbox | None = None,
    on_start: Callable[[int], None] | None = None,
) -> Process:
    """:func:`run_process` in two halves: start the command now, before returning (no
    event-loop turn between the call and the spawn), and ``await`` the returned
    :class:`Process`'s ``wait()`` for the Outcome. Must be called from the thread that
    runs the event loop. Arguments, errors and the Outcome are those of
    :func:`run_process`; a command that cannot start gives a Process whose ``wait()``
    returns the failure at once. A command the sandbox server starts has its request
    sent before this returns, and its ``pid`` (and ``on_start``) once the server has
    started it; if the server cannot, ``wait()`` returns why.

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
    controllers = sandboxes.controllers if sandboxes is not None else set()
    in_cgroup = {"mem": mem_limit_mb if "memory" in controllers else None,
                 "pids": pids_max if "pids" in controllers else None}
    limits = rlimits(None if "memory" in controllers else mem_limit_mb, cpu_time_s,
                     # per user: only meaningful for a sandbox's own user
                     nproc=pids_max if sandbox is not None and "pids" not in controllers
                     else None)
    watch_memory = mem_limit_mb is not None and "memory" not in controllers
    preexec = None
    launcher = prlimit_launcher() if limits else None
    loop = asyncio.get_running_loop()
    if sandbox is not None:
        if limits and launcher is None:
            return Process.failed(Outcome(ok=False, reason="cannot start: rlimits in a "
                                          "sandbox need util-linux prlimit(1)", detail=detail))
        if launcher is not None:  # the program is looked up inside the sandbox
            args = [launcher, *(f"--{name}={soft}:{hard}" for _, name, soft, hard in limits),
                    "--", *args]
        return Process._start_sandboxed(
            loop, sandboxes, sandbox, args, core_list, environ, timeout_s, mem_limit_mb,
            cpu_time_s, pids_max, in_cgroup, watch_memory, tail_bytes, detail,
            launched=launcher is not None, on_start=on_start)
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
    try:
        cwd = make_workdir(cwd_root)
    except OSError as exc:
        return Process.failed(cannot_start(exc, detail))
    if sandboxes is not None and sandboxes.spawns_on_host and preexec is None:
        # Started by the sandbox server, inside its cgroup slot from the start.
        proc = Process._start_sandboxed(
            loop, sandboxes, None, args, core_list, environ, timeout_s, mem_limit_mb,
            cpu_time_s, pids_max, in_cgroup, watch_memory, tail_bytes, detail,
            launched=launcher is not None, on_start=on_start, cwd=cwd)
        if proc.not_started:
            remove_tree(cwd)
        return proc
    try:
        slot = (sandboxes.host_slot(core_list, in_cgroup["mem"], in_cgroup["pids"])
                if sandboxes is not None else None)
    except OSError as exc:
        remove_tree(cwd)
        return Process.failed(cannot_start(exc, detail))
    try:
        proc = Process._start(loop, args, core_list, environ, preexec, cwd, timeout_s,
                              mem_limit_mb, cpu_time_s, pids_max, watch_memory, tail_bytes,
                              sandboxes, slot, detail, launched=launcher is not None,
                              on_start=on_start)
    except BaseException:
        remove_tree(cwd)
        if slot is not None:
            sandboxes.release_host_slot(slot)
        raise
    if proc.not_started:  # nothing will use or remove the directory
        remove_tree(cwd)
        if slot is not None:
            sandboxes.release_host_slot(slot)
    return proc


class Process:
    """A command started by :func:`start_process`: ``await wait()`` for its Outcome
    (one waiter; once it has returned, ``wait()`` returns the same Outcome again), or
    :meth:`abandon` it."""

    def __init__(self, outcome: Outcome | None = None) -> None:
        self.pid: int | None = None  # also its process group id
        self.program: str | None = None  # argv[0], as given
        self._outcome = outcome
        self._child: Child | None = None
        self._claimed = False  # wait() or abandon() has taken over the child

    @classmethod
    def failed(cls, outcome: Outcome) -> Process:
        """A command that could not start: ``wait()`` returns ``outcome``."""
        return cls(outcome)

    @property
    def not_started(self) -> bool:
        """It failed before anything was started (``wait()`` returns why). A command the
        sandbox server starts may still fail to (its ``pid`` is None until it has)."""
        return self._child is None

    @classmethod
    def _start(cls, loop: asyncio.AbstractEventLoop, args: list[str], cores: list[int],
               env: dict[bytes, bytes], preexec: Callable[[], None] | None, cwd: str,
               timeout_s: float, mem_limit_mb: float | None, cpu_time_s: float | None,
               pids_max: int | None, watch_memory: bool, tail_bytes: int,
               sandboxes: Sandboxes | None, slot: Slot | None, detail: dict[str, Any], *,
               launched: bool, on_start: Callable[[int], None] | None = None) -> Process:
        started = _with_pipes(detail, lambda out_w, err_w: spawn(args, cores, env, cwd, out_w,
                                                                 err_w, preexec))
        if isinstance(started, Process):
            return started
        proc, out_r, err_r = started
        pid = proc.pid
        # Killed with its group if this process dies (withdrawn before the reap).
        lifeline = sandboxes.lifeline if sandboxes is not None else None
        if lifeline is not None:
            lifeline.track(pid)
        try:
            child = Child(loop, proc, out_r, err_r, tail_bytes, lifeline=lifeline)
        except BaseException:  # e.g. the loop is closing: do not leave the child behind
            kill_group(pid)
            if lifeline is not None:
                lifeline.forget(pid)
            proc.wait()
            close_fds(out_r, err_r)
            raise
        if slot is not None:
            try:  # pinned by affinity until now: the cgroup makes it binding
                for fd in slot.procs_fds:
                    os.write(fd, str(pid).encode())
            except OSError:
                pass  # it already exited
        return cls._watch(loop, pid, child, cwd, timeout_s, mem_limit_mb, cpu_time_s,
                          pids_max, watch_memory, sandboxes, slot, cores, launched, on_start)

    @classmethod
    def _start_sandboxed(cls, loop: asyncio.AbstractEventLoop, sandboxes: Sandboxes,
                         sandbox: Sandbox | None, args: list[str], cores: list[int],
                         env: dict[bytes, bytes], timeout_s: float,
                         mem_limit_mb: float | None, cpu_time_s: float | None,
                         pids_max: int | None, in_cgroup: dict[str, Any], watch_memory: bool,
                         tail_bytes: int, detail: dict[str, Any], *, launched: bool,
                         on_start: Callable[[int], None] | None = None,
                         cwd: str | None = None) -> Process:
        """Start the command through the sandbox server: in ``sandbox``, or on the host
        in ``cwd`` (``sandbox`` None); either way inside its cgroup slot. The request is
        sent and this returns (pipelined: the loop goes on while the server starts it);
        ``pid`` is set, and ``on_start`` called, when the server has started it, and a
        command that fails to start ends with that reason."""
        from metasched.runtime.process.sandboxed import SandboxedChild

        result = _with_pipes(detail, lambda out_w, err_w: sandboxes.start(
            sandbox, argv=args, env=env, cores=cores, mem_limit_mb=in_cgroup["mem"],
            pids_max=in_cgroup["pids"], out_w=out_w, err_w=err_w, cwd=cwd, wait=False))
        if isinstance(result, Process):
            return result
        started, out_r, err_r = result
        child = SandboxedChild(loop, sandboxes, sandbox, started, out_r, err_r, tail_bytes)
        self = cls._watch(loop, started.pid, child, cwd, timeout_s, mem_limit_mb, cpu_time_s,
                          pids_max, watch_memory, None, None, cores, launched, on_start)
        if started.spawned is not None and started.pid is None:
            started.spawned.add_done_callback(
                lambda f: f.exception() is not None or self._started(f.result()))
        return self

    @classmethod
    def _watch(cls, loop: asyncio.AbstractEventLoop, pid: int, child: Any, cwd: str | None,
               timeout_s: float, mem_limit_mb: float | None, cpu_time_s: float | None,
               pids_max: int | None, watch_memory: bool, sandboxes: Sandboxes | None,
               slot: Slot | None, cores: list[int], launched: bool,
               on_start: Callable[[int], None] | None) -> Process:
        """The started command's Process: its timeout and memory watch armed."""
        self = cls()
        self._child, self._loop, self._cwd = child, loop, cwd
        self._limits = (timeout_s, mem_limit_mb, cpu_time_s, launched)
        self._pids_max = pids_max
        self._detail = {"cores": cores}
        self._sandboxes, self._slot = sandboxes, slot
        self._on_start = on_start
        self._mem_limit = int(mem_limit_mb * 1024 * 1024) if watch_memory else None
        self._watch = None
        self._timer = loop.call_later(timeout_s, self._kill, "timeout")
        if pid is not None:
            self._started(pid)
        return self

    def _started(self, pid: int) -> None:
        """The command runs as ``pid``: what needs its pid (at its start, or once the
        sandbox server says it has started it)."""
        self.pid = pid
        self._detail = {"pid": pid, **self._detail}
        if self._on_start is not None:
            self._on_start(pid)
        if self._mem_limit is not None and not self._child.reaped:
            child = self._child
            self._watch = MemoryWatch.for_loop(self._loop)
            self._watch.add(pid, self._mem_limit, lambda: child.kill("memory"))

    def _kill(self, why: str) -> None:
        self._child.kill(why)
        if self._slot is not None and not self._child.reaped:
            self._slot.kill()  # processes that left the group too

    def cancel(self) -> None:
        """Kill the command's every process now (its group, its cgroup slot: daemons
        too) at its caller's word; ``wait()`` then returns the reason ``cancelled``. A
        no-op once it has ended."""
        if self._outcome is None and self._child is not None and not self._child.reaped:
            self._kill("cancelled")

    async def wait(self) -> Outcome:
        """How the command ended (see :func:`run_process`). Cancelling the wait kills
        the group; the cancellation is re-raised once it is dead (or after a bound)."""
        if self._outcome is not None:
            return self._outcome
        if self._claimed:
            raise RuntimeError("this Process already has a waiter")
        self._claimed = True
        child = self._child
        try:
            try:
                try:
                    await child.exited
                finally:
                    self._stop_watching()
                start_error = getattr(child, "start_error", None)
                if start_error is not None:  # the sandbox server could not start it
                    self._outcome = command_not_found(
                        cannot_start(start_error, self._detail), self.program)
                    return self._outcome
                # The leader is a zombie (or, in a sandbox, reaped by the server, which
                # ended its group first): end what is left of it (those processes hold
                # the granted cores and the pipes), then reap.
                child.kill_rest()
                self._read_slot()
                if self._slot is not None:
                    self._slot.kill()
                child.reap()
                await child.drained(_DRAIN_GRACE_S)
            except asyncio.CancelledError:
                if not child.reaped:
                    self._kill("cancelled")
                    await child.reap_after_kill()
                raise
            finally:
                self._release(child)
        finally:
            if self._cwd is not None:
                remove_tree(self._cwd)
        self._outcome = command_not_found(
            outcome_of(child, *self._limits, self._detail, pids_max=self._pids_max),
            self.program)
        child.out.release()
        child.err.release()
        return self._outcome

    def _read_slot(self) -> None:
        """A host command's slot says whether it hit its memory or process limit."""
        if self._slot is None:
            return
        memory, pids = self._slot.exceeded()
        if memory and self._child.killed_by is None:
            self._child.killed_by = "memory"  # the kernel killed in the slot: definitive
        self._child.pids_limited = pids

    def cpu_seconds(self) -> float | None:
        """CPU time its cgroup slot has used so far (see ``Slot.cpu_seconds``: the
        slot's earlier commands included, so compare readings); None without a slot or
        without cgroup v2 accounting."""
        slot = getattr(self, "_slot", None)  # (a command that never started has none)
        if slot is None:
            started = getattr(self._child, "started", None)
            slot = getattr(started, "slot", None)
        return None if slot is None else slot.cpu_seconds()

    def abandon(self) -> None:
        """For a caller that will not await :meth:`wait`: kill the group, reap it when
        it exits, close its pipes, remove its directory. A no-op once ``wait()`` has
        begun (cancel that instead) and for a command that did not start."""
        if self._claimed or self._child is None:
            return
        self._claimed = True
        self._stop_watching()
        self._release(self._child)
        if self._cwd is not None:
            remove_tree(self._cwd)
        self._outcome = Outcome(ok=False, reason="cancelled", detail=self._detail)

    def _stop_watching(self) -> None:
        self._timer.cancel()
        if self._watch is not None:
            self._watch.remove(self.pid)

    def _release(self, child: Any) -> None:
        if not child.reaped:  # cancelled twice, abandoned, or it outlived SIGKILL so far
            self._kill("cancelled")
            child.reap_in_background()
        child.close()
        if self._slot is not None:
            slot, self._slot = self._slot, None
            self._sandboxes.release_host_slot(slot)


def _with_pipes(detail: dict[str, Any], start: Callable[[int, int], Any]
                ) -> tuple[Any, int, int] | Process:
    """``start(out_w, err_w)`` with two new pipes for the child's stdout and stderr:
    ``(what it returned, out_r, err_r)``, or a failed Process if the pipes or the start
    failed (``OSError`` from exec, ``SubprocessError`` from a preexec, ``ValueError``)."""
    try:
        out_r, out_w = os.pipe()
    except OSError as exc:
        return Process.failed(cannot_start(exc, detail))
    try:
        err_r, err_w = os.pipe()
    except OSError as exc:
        close_fds(out_r, out_w)
        return Process.failed(cannot_start(exc, detail))
    try:
        try:
            started = start(out_w, err_w)
        finally:
            close_fds(out_w, err_w)  # the child has its copies; EOF needs ours closed
    except Exception as exc:  # noqa: BLE001 - every way a start fails is its Outcome
        close_fds(out_r, err_r)
        return Process.failed(cannot_start(exc, detail))
    return started, out_r, err_r
