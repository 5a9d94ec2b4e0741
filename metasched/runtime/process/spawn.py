"""Starting a child pinned to its granted cores from its first instruction.

Spawn overhead is what limits a flood of short actions (rates from
``benchmarks/spawn_methods.py``, 2,000 × ``/bin/true``, 2 in flight, 2 cores):

- The child inherits its CPU affinity from the thread that spawns it, so the event-loop
  thread pins *itself* to the granted cores, starts the child with ``vfork`` (no
  ``preexec_fn``: no copy of the parent's page tables, whose cost grows with the
  parent's size) and restores its own mask. Nothing awaits in between, so no other
  coroutine runs with the temporary mask, and the child is pinned from its first
  instruction. Before restoring, the thread steps off the granted cores: otherwise it
  stays on the core it just gave the child and competes with it (-15-20% throughput).
- The spawn itself calls ``_posixsubprocess.fork_exec`` directly, with the arguments
  ``subprocess.Popen`` would pass (close_fds, setsid, default signal dispositions), on
  the CPython versions where that private signature is known (3.11-3.13), else
  ``Popen``; Popen's own Python work costs 5-10% of throughput. The environment is built
  as bytes, the form ``execve`` takes.
- Measured against ``seq N | xargs -P2 -I{} /bin/true``: 0.74-0.8x with the working
  directory on ext4, 0.9-1.0x with ``cwd_root`` on a tmpfs such as ``/dev/shm``; a
  spawner thread reaches ~0.45x, ``asyncio.create_subprocess_exec`` ~0.55x even without
  pinning, and with a pinning ``preexec_fn`` ~0.15x (0.02x with a 1 GB parent).
"""

from __future__ import annotations

import _posixsubprocess
import os
import subprocess
import sys
from collections.abc import Callable

from metasched.runtime.process.child import close_fds

__all__ = ["spawn"]


def spawn(args: list[str], cores: list[int], env: dict[bytes, bytes], cwd: str,
          out_w: int, err_w: int,
          preexec: Callable[[], None] | None) -> tuple[int, subprocess.Popen | None]:
    """Start the child pinned to ``cores``; its pid (and the Popen, if one was used).

    Affinity is a per-thread attribute that ``vfork``/``fork`` copy from the calling
    thread, so this thread pins itself to ``cores`` for the spawn and the child is pinned
    before its first instruction. No ``await`` happens before the mask is restored, so
    no other coroutine runs with it. Restoring first steps off the granted cores (one
    more mask change) because otherwise this thread stays on the core it just gave the
    child and competes with it until the scheduler moves one of them: ~20% of the
    throughput of short actions in ``benchmarks/spawn_methods.py``.
    """
    home = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        if _fork_exec_usable:
            try:
                return _fork_exec(args, env, cwd, out_w, err_w, preexec), None
            except TypeError:
                _disable_fork_exec()  # the private signature changed: use Popen from now on
        proc = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=out_w, stderr=err_w, cwd=cwd, env=env,
            close_fds=True, start_new_session=True, preexec_fn=preexec,
        )
        return proc.pid, proc
    finally:
        # Must not raise: a child may be running, and only a return hands it over.
        try:
            away = home.difference(cores) if _step_off_granted_cores else None
            if away:
                os.sched_setaffinity(0, away)
            os.sched_setaffinity(0, home)
        except OSError:  # a CPU of ``home`` went offline; the kernel keeps a valid mask
            pass


# Benchmarks turn this off to measure what stepping off the granted cores gains.
_step_off_granted_cores = True

# ``subprocess.Popen`` spends more Python time per spawn than everything else in this
# package (argument normalisation, re-encoding the environment, its bookkeeping). On the
# CPython versions whose private ``_posixsubprocess.fork_exec`` signature is known (3.11
# to 3.13: the same 23 positional arguments), call it directly, as Popen does; elsewhere,
# or if the call's signature is ever rejected, fall back to Popen. Same child setup
# either way: close_fds, setsid, default signal dispositions, vfork unless preexec_fn.
_fork_exec_usable = (3, 11) <= sys.version_info[:2] <= (3, 13) and hasattr(
    _posixsubprocess, "fork_exec")


_devnull_fd = -1


def _devnull() -> int:
    """A read-only, close-on-exec descriptor of /dev/null for the children's stdin,
    opened once (an open and a close per spawn otherwise)."""
    global _devnull_fd
    if _devnull_fd < 0:
        _devnull_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    return _devnull_fd


def _disable_fork_exec() -> None:
    global _fork_exec_usable
    _fork_exec_usable = False


def _fork_exec(args: list[str], env: dict[bytes, bytes], cwd: str, out_w: int, err_w: int,
               preexec: Callable[[], None] | None) -> int:
    """What ``Popen._execute_child`` does for stdin=/dev/null, given stdout/stderr fds,
    ``start_new_session=True``, ``close_fds=True``; raises OSError / SubprocessError."""
    env_list = [k + b"=" + v for k, v in env.items()]
    executable = os.fsencode(args[0])
    if os.path.dirname(executable):
        executables: tuple[bytes, ...] = (executable,)
    else:  # as os._execvpe: every PATH entry in order ('' is the working directory)
        path = env.get(b"PATH", os.defpath.encode())
        executables = tuple(os.path.join(d, executable) for d in path.split(b":"))
    errpipe_read, errpipe_write = os.pipe()
    try:
        low = []
        while errpipe_write < 3:  # the child dup2s onto 0-2: keep the error pipe above
            low.append(errpipe_write)
            errpipe_write = os.dup(errpipe_write)
        close_fds(*low)
        try:
            pid = _posixsubprocess.fork_exec(
                args, executables, True, (errpipe_write,), cwd, env_list,
                _devnull(), -1, -1, out_w, -1, err_w, errpipe_read, errpipe_write,
                True, True, -1, None, None, None, -1, preexec,
                getattr(subprocess, "_USE_VFORK", True),
            )
        finally:
            os.close(errpipe_write)
        # EOF (exec closed the close-on-exec pipe) means success; else the child wrote
        # "ExceptionName:hex errno:message" and exited.
        data = b""
        while len(data) <= 50000:
            part = os.read(errpipe_read, 50000)
            if not part:
                break
            data += part
    finally:
        os.close(errpipe_read)
    if not data:
        return pid
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
    _, _, rest = data.partition(b":")
    hex_errno, _, message = rest.partition(b":")
    try:
        errno_num = int(hex_errno, 16)
    except ValueError:
        errno_num = 0
    if errno_num:
        raise OSError(errno_num, os.strerror(errno_num))
    raise subprocess.SubprocessError(message.decode(errors="replace") or "exec failed")
