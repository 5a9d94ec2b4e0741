"""CPU executor: runs one sandbox action as a subprocess pinned to its granted cores.

:func:`run_process` starts ``argv`` (never through a shell) in a fresh temporary working
directory and a new session (so it leads its own process group), pinned to exactly the
granted CPU ids, with the usual thread-count variables set to the number of cores and
optional address-space and CPU-time rlimits. It keeps the last ``tail_bytes`` of stdout
and stderr, kills the whole group after ``timeout_s`` or on cancellation, and reports an
:class:`~metasched.runtime.outcome.Outcome`; failures to start come back as an Outcome
too, never as an exception (only misuse of the API raises). No zombie, temporary
directory or file descriptor outlives a call, whichever way it ends.

How a child is started (spawn overhead is what limits a flood of short actions; rates
from ``benchmarks/spawn_methods.py``, 2,000 × ``/bin/true``, 2 in flight, 2 cores):

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
  directory on ext4, 0.9-1.0x with ``cwd_root`` on a tmpfs such as ``/dev/shm``
  (creating and removing a directory costs ~100 us on ext4, ~10 us on tmpfs; but files
  an action writes there use RAM); a spawner thread reaches ~0.45x,
  ``asyncio.create_subprocess_exec`` ~0.55x even without pinning, and with a pinning
  ``preexec_fn`` ~0.15x (0.02x with a 1 GB parent).
- rlimits must be in place before user code runs. ``prlimit(pid, ...)`` after the spawn
  would let its first instructions (and any child forked then) run unlimited, and a
  ``preexec_fn`` forces ``fork`` of the whole parent (~25 spawns/s with a 1 GB parent,
  and Python code in a forked child of a threaded process). So the command is run
  through util-linux ``prlimit(1)`` (``prlimit --as=.. --cpu=.. --core=0:0 -- argv``),
  which sets the limits on itself and execs the command: a second exec (~0.45x of
  xargs), independent of the parent's size. Since the launcher would report a missing
  program as its own exit status, the program is looked up first (as ``execvp`` does)
  and "cannot start" reported. Where ``prlimit(1)`` is missing, a ``preexec_fn`` that
  only calls ``setrlimit`` is the fallback.
- Exit is awaited on a pidfd watched by the event loop (no thread per child; pidfds and
  output pipes share one epoll set that the loop watches as one reader: ``_FdWatch``);
  without pidfds (Linux < 5.3) a thread waits with ``waitid(WNOWAIT)``.
  Either way the child stays a zombie until this module reaps it, so its pid, which is
  also its process-group id, cannot be reused while the group is being killed.
- When the main process exits, whatever is left of its group is killed: those processes
  would go on using cores the scheduler has handed back, and hold the output pipes. A
  process that left the group (``setsid``) escapes this; only the cgroup option below
  catches it, and its hold on the pipes is cut after 0.5 s.

Limits and how failures are named:

- ``mem_limit_mb`` sets ``RLIMIT_AS`` (address space, per process). Note that the address
  space of a program is larger than its resident memory: glibc reserves 64 MB arenas per
  thread and runtimes such as the JVM or Go reserve heaps up front, so threaded programs
  need a generous limit. A failure is named "memory limit exceeded (N MB)" when a limit
  was set and (a) the group watchdog killed it, (b) it died of SIGKILL that this module
  did not send (the kernel's OOM killer is the usual sender), (c) its peak resident set
  (``ru_maxrss`` from ``wait4``) reached 80% of the limit, or (d) the tail of its stderr
  carries an allocation-failure message (Python's ``MemoryError``, ``ENOMEM``'s "Cannot
  allocate memory", C++ ``bad_alloc``, "out of memory", ...). (c) catches a C program
  whose ``malloc`` failed after growing, (d) one whose first huge allocation failed.
- The watchdog: ``RLIMIT_AS`` is per process, so a command that forks N workers may use N
  times the limit. While memory-limited actions run, one pass over ``/proc/*/stat``
  every 50 ms, shared by every action of the event loop (~10 us per process on the
  machine; on a node with thousands of processes the passes are spaced out to take at
  most ~5% of the loop thread), sums the anonymous resident memory of each action's
  process group (``/proc/<pid>/statm``: resident minus file-backed, so shared libraries
  are not counted once per process) and kills a group above its limit, which makes the
  reason definitive. psutil was considered, but it has no process-group accessor, so it
  would cost a ``getpgid`` call per process on top of its own reads. Pages shared
  copy-on-write after ``fork`` are counted once per process, an overestimate the limit
  errs on the safe side of. The rlimit stays the first line: a single process's
  resident memory cannot outgrow its address space, so the watchdog only ever fires for
  groups, and allocations between two passes are not seen.
- ``cpu_time_s`` sets ``RLIMIT_CPU`` rounded up to whole seconds, with the hard limit one
  second higher so that SIGXCPU (the soft limit) arrives before SIGKILL (the hard one);
  either is named "cpu time limit exceeded" (SIGKILL only if the CPU time used reached
  the limit).

Optional cgroup v2 confinement (:class:`CpusetCgroup`): affinity set by
``sched_setaffinity`` can be widened again by the child itself; a cpuset cgroup cannot.
Where ``/sys/fs/cgroup`` is cgroup v2 and the operator has delegated a writable parent
cgroup with the ``cpuset`` controller, ``run_process(..., cgroup=CpusetCgroup(parent))``
moves each action into its own child cgroup whose ``cpuset.cpus`` are the granted cores,
and removes it afterwards (``cgroup.kill`` first, which also ends processes that escaped
the group with ``setsid``). The child is pinned by affinity before it runs, so the short
time before it is moved in is covered. Anywhere else (cgroup v1, no delegation) it is a
no-op whose :meth:`CpusetCgroup.available` says why; it never fails an action.
"""

from __future__ import annotations

import _posixsubprocess
import asyncio
import errno
import itertools
import math
import os
import resource
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from metasched.runtime.outcome import Outcome

__all__ = ["THREAD_ENV_VARS", "CpusetCgroup", "Process", "kill_group", "run_process",
           "start_process"]

# Set to the number of granted cores: the thread pools of OpenMP, BLAS libraries, numexpr,
# torch, Rayon, Go, Julia and TensorFlow would otherwise size themselves to the whole
# machine (they read the cpu count, not the affinity mask) and oversubscribe the cores.
THREAD_ENV_VARS = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "NUMEXPR_MAX_THREADS",
    "TORCH_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "BLIS_NUM_THREADS",
    "RAYON_NUM_THREADS",
    "GOMAXPROCS",
    "JULIA_NUM_THREADS",
    "TF_NUM_INTRAOP_THREADS",
    "TF_NUM_INTEROP_THREADS",
)

_THREAD_ENV_VARS_B = tuple(name.encode() for name in THREAD_ENV_VARS)

_READ_CHUNK = 65536  # a Linux pipe holds 64 KiB by default: one read empties it
_DRAIN_GRACE_S = 0.5  # after the group is killed, how long to wait for EOF on the pipes
_REAP_AFTER_CANCEL_S = 2.0  # how long a cancelled call waits for SIGKILL to take effect
_WATCH_INTERVAL_S = 0.05  # memory watchdog period
_MAXRSS_FRACTION = 0.8  # peak RSS at this fraction of RLIMIT_AS counts as "hit the limit"
_CPU_HARD_MARGIN_S = 1  # RLIMIT_CPU hard limit above the soft one: SIGXCPU comes first

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


def kill_group(pgid: int) -> None:
    """SIGKILL every process in process group ``pgid``; a group that is gone is fine.

    Raises:
        ValueError: ``pgid`` is 0, 1 or negative (``killpg(0)`` would kill the caller's
            own group).
    """
    if pgid <= 1:
        raise ValueError(f"refusing to kill process group {pgid}")
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


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
            short actions cheaper (see the module docstring).
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
        child_env = _child_env(env, extra_env, len(core_list))
    except ValueError as exc:  # a '=' in a variable name
        return Process.failed(_cannot_start(exc, detail))
    limits = _rlimits(mem_limit_mb, cpu_time_s)
    preexec = None
    launcher = _prlimit_launcher() if limits else None
    if launcher is not None:
        try:
            # The launcher would report a missing program as its own exit status.
            _check_executable(args[0], child_env.get(b"PATH", os.defpath.encode()))
        except OSError as exc:
            return Process.failed(_cannot_start(exc, detail))
        args = [launcher, *(f"--{name}={soft}:{hard}" for _, name, soft, hard in limits),
                "--", *args]
    elif limits:
        preexec = _rlimit_preexec(limits)
    loop = asyncio.get_running_loop()
    try:
        cwd = _make_workdir(cwd_root)
    except OSError as exc:
        return Process.failed(_cannot_start(exc, detail))
    try:
        proc = Process._start(loop, args, core_list, child_env, preexec, cwd, timeout_s,
                              mem_limit_mb, cpu_time_s, tail_bytes, cgroup, detail,
                              launched=launcher is not None, on_start=on_start)
    except BaseException:
        _remove_tree(cwd)
        raise
    if proc.pid is None:  # it did not start: nothing will use or remove the directory
        _remove_tree(cwd)
    return proc


_workdir_numbers = itertools.count()


def _make_workdir(root: str | None) -> str:
    """A new directory for one action under ``root`` (default: the system temporary
    directory), as ``tempfile.mkdtemp`` makes one (created here, never an existing one,
    mode 0700) at half its cost: named by this process's id and a counter instead of
    random letters. A name left by an earlier process with the same pid is skipped."""
    base = root if root is not None else tempfile.gettempdir()
    pid = os.getpid()
    while True:
        path = os.path.join(base, f"metasched-{pid}-{next(_workdir_numbers)}")
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            continue
        return path


def _child_env(env: Mapping[str, str] | None, extra_env: Mapping[str, str] | None,
               n_cores: int) -> dict[bytes, bytes]:
    """The child's environment: ``env`` (or ours), PATH if missing, extras, thread vars.

    Built as bytes, the form ``execve`` takes: ``Popen`` would encode every key and
    value on every spawn, which cost more than the rest of this module's Python work.

    Raises:
        ValueError: a given variable name contains "=".
    """
    if env is None:
        # os.environ keeps its bytes form in ``_data`` on POSIX; copying that dict is
        # ~100x faster than iterating the mapping, which decodes every item.
        data = getattr(os.environ, "_data", None)
        out = dict(data) if isinstance(data, dict) else dict(os.environb)
    else:
        out = _encode_env(env)
        # Without PATH, execvpe falls back to a confstr default that may not match this
        # machine, and the child's own subprocesses could not find anything.
        if b"PATH" not in out and b"PATH" in os.environb:
            out[b"PATH"] = os.environb[b"PATH"]
    if extra_env:
        out.update(_encode_env(extra_env))
    n = str(n_cores).encode()
    for name in _THREAD_ENV_VARS_B:
        out[name] = n
    return out


def _encode_env(env: Mapping[str, str]) -> dict[bytes, bytes]:
    out = {os.fsencode(k): os.fsencode(v) for k, v in env.items()}
    if any(b"=" in k for k in out):
        raise ValueError("illegal environment variable name")
    return out


def _rlimits(mem_limit_mb: float | None,
             cpu_time_s: float | None) -> list[tuple[int, str, int, int]]:
    """The rlimits to set: (resource, prlimit(1) option name, soft, hard).

    Each limit is clamped to this process's hard limit (an unprivileged process cannot
    raise it, and the child would fail to start).
    """
    limits: list[tuple[int, str, int, int]] = []
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
    return limits


def _rlimit_preexec(limits: list[tuple[int, str, int, int]]) -> Callable[[], None]:
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


def _prlimit_launcher() -> str | None:
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


def _check_executable(name: str, path: bytes) -> None:
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


def _clamp(which: int, soft: int, hard: int) -> tuple[int, int]:
    _, cur_hard = resource.getrlimit(which)
    if cur_hard != resource.RLIM_INFINITY:
        soft, hard = min(soft, cur_hard), min(hard, cur_hard)
    return soft, hard


def _cannot_start(exc: BaseException, detail: dict[str, Any]) -> Outcome:
    why = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return Outcome(ok=False, reason=f"cannot start: {why}", detail=detail)


def _spawn(args: list[str], cores: list[int], env: dict[bytes, bytes], cwd: str,
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
# module (argument normalisation, re-encoding the environment, its bookkeeping). On the
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
        _close_fds(*low)
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


class Process:
    """A command started by :func:`start_process`: ``await wait()`` for its Outcome
    (one waiter; once it has returned, ``wait()`` returns the same Outcome again), or
    :meth:`abandon` it."""

    def __init__(self, outcome: Outcome | None = None) -> None:
        self.pid: int | None = None  # also its process group id
        self._outcome = outcome
        self._child: _Child | None = None
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
            return cls.failed(_cannot_start(exc, detail))
        try:
            err_r, err_w = os.pipe()
        except OSError as exc:
            _close_fds(out_r, out_w)
            return cls.failed(_cannot_start(exc, detail))
        try:
            try:
                pid, proc = _spawn(args, cores, env, cwd, out_w, err_w, preexec)
            finally:
                _close_fds(out_w, err_w)  # the child has its copies; EOF needs ours closed
        except Exception as exc:  # OSError from exec, SubprocessError from preexec, ValueError
            _close_fds(out_r, err_r)
            return cls.failed(_cannot_start(exc, detail))

        try:
            child = _Child(loop, pid, proc, out_r, err_r, tail_bytes)
        except BaseException:  # e.g. the loop is closing: do not leave the child behind
            kill_group(pid)
            os.waitpid(pid, 0)
            _close_fds(out_r, err_r)
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
            self._watch = _MemoryWatch.for_loop(loop)
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
            _remove_tree(self._cwd)
        self._outcome = _outcome(child, *self._limits, self._detail)
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
        _remove_tree(self._cwd)
        self._outcome = Outcome(ok=False, reason="cancelled", detail=self._detail)

    def _stop_watching(self) -> None:
        self._timer.cancel()
        if self._watch is not None:
            self._watch.remove(self.pid)

    def _release(self, child: _Child) -> None:
        if not child.reaped:  # cancelled twice, abandoned, or it outlived SIGKILL so far
            child.kill("cancelled")
            child.reap_in_background()
        child.close()
        if self._cg_path is not None:
            _release_cgroup(self._loop, self._cgroup, self._cg_path)


def _outcome(child: _Child, timeout_s: float, mem_limit_mb: float | None,
             cpu_time_s: float | None, launched: bool, detail: dict[str, Any]) -> Outcome:
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
    if child.killed_by == "memory" and mem_limit_mb is not None:
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


def _close_fds(*fds: int) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class _Tail:
    """The last ``limit`` bytes of a stream (memory stays bounded whatever is written)."""

    __slots__ = ("buf", "limit")

    def __init__(self, limit: int) -> None:
        self.buf = bytearray()
        self.limit = max(0, int(limit))

    def feed(self, data: bytes) -> None:
        if len(data) >= self.limit:
            self.buf[:] = data[len(data) - self.limit:]
        else:
            self.buf += data
            excess = len(self.buf) - self.limit
            if excess > 0:
                del self.buf[:excess]


class _PerLoop:
    """Base of the helpers kept one per event loop (``for_loop``), in a weak-keyed map
    per subclass, so each goes with its loop; an instance therefore holds its loop only
    weakly (``self.loop()``), or the loop would never be freed."""

    _by_loop: weakref.WeakKeyDictionary

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._by_loop = weakref.WeakKeyDictionary()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = weakref.ref(loop)

    @classmethod
    def for_loop(cls, loop: asyncio.AbstractEventLoop) -> Any:
        helper = cls._by_loop.get(loop)
        if helper is None:
            helper = cls._by_loop[loop] = cls(loop)
        return helper


class _FdWatch(_PerLoop):
    """The children's pipes and pidfds of one event loop, in an epoll set of their own
    that the loop watches as a single reader.

    Each action has three such descriptors; ``loop.add_reader``/``remove_reader`` spend
    ~8.6 µs of Python per descriptor (selector keys, handles, transport checks) against
    ~1.8 µs for registering in a plain ``select.epoll``, and a ready descriptor costs
    the loop a handle of its own instead of a share of one. Level-triggered: what a
    callback leaves unread is reported again on the loop's next turn.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self.epoll = select.epoll()  # close-on-exec
        self.callbacks: dict[int, Callable[[], None]] = {}
        loop.add_reader(self.epoll.fileno(), self._dispatch)

    def add(self, fd: int, callback: Callable[[], None]) -> None:
        self.epoll.register(fd, select.EPOLLIN)
        self.callbacks[fd] = callback

    def remove(self, fd: int) -> None:
        """Stop watching ``fd`` (before it is closed: a closed fd leaves the set by itself
        only once every duplicate of it is closed)."""
        if self.callbacks.pop(fd, None) is not None:
            self.epoll.unregister(fd)

    def _dispatch(self) -> None:
        for fd, _ in self.epoll.poll(0):
            callback = self.callbacks.get(fd)  # None if an earlier callback removed it
            if callback is None:
                continue
            try:
                callback()
            except Exception as exc:  # noqa: BLE001 - as the loop does for its handles
                loop = self.loop()
                if loop is not None:
                    loop.call_exception_handler({"message": "exception in a child fd "
                                                 "callback", "exception": exc})


class _Stream:
    """A child's output pipe, read by the event loop into a bounded tail."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int, tail_bytes: int) -> None:
        self.watch = _FdWatch.for_loop(loop)
        self.fd = fd
        self.tail = _Tail(tail_bytes)
        self.eof = loop.create_future()
        os.set_blocking(fd, False)
        self.watch.add(fd, self._on_readable)

    def _read_once(self) -> bool:
        """One read into the tail; False when nothing more is readable now (closed at
        EOF or on an error)."""
        try:
            data = os.read(self.fd, _READ_CHUNK)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            data = b""
        if not data:
            self.close()
            return False
        self.tail.feed(data)
        return True

    def _on_readable(self) -> None:
        self._read_once()

    def drain_now(self) -> None:
        """Read until the pipe is empty (a bounded number of reads: a writer that
        escaped the group could keep it full); close it at EOF."""
        for _ in range(64):
            if self.fd < 0 or not self._read_once():
                return

    def close(self) -> None:
        if self.fd >= 0:
            self.watch.remove(self.fd)
            _close_fds(self.fd)
            self.fd = -1
        if not self.eof.done():
            self.eof.set_result(None)

    def text(self) -> str:
        return self.tail.buf.decode("utf-8", errors="replace")


class _Child:
    """A started child: exit notification, reaping, killing, and its two output pipes."""

    def __init__(self, loop: asyncio.AbstractEventLoop, pid: int,
                 proc: subprocess.Popen | None, out_fd: int, err_fd: int,
                 tail_bytes: int) -> None:
        self.loop = loop
        self.pid = pid
        self.proc = proc
        self.exited: asyncio.Future[None] = loop.create_future()
        self.killed_by: str | None = None
        self.reaped = False
        self.returncode: int | None = None
        self.maxrss_bytes = 0
        self.cpu_s = 0.0
        self.pidfd = -1
        self.watch = _FdWatch.for_loop(loop)
        self.out = _Stream(loop, out_fd, tail_bytes)
        self.err = _Stream(loop, err_fd, tail_bytes)
        try:
            self.pidfd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            # No pidfds (old kernel, or a sandbox forbidding the call): a thread waits
            # without reaping (WNOWAIT), so the pid stays ours until reap().
            threading.Thread(target=self._wait_in_thread, name=f"wait-{self.pid}",
                             daemon=True).start()
        else:
            self.watch.add(self.pidfd, self._on_exit)

    def _on_exit(self) -> None:
        self._close_pidfd()
        if not self.exited.done():
            self.exited.set_result(None)

    def _wait_in_thread(self) -> None:
        try:
            os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            pass
        try:
            self.loop.call_soon_threadsafe(self._on_exit)
        except RuntimeError:  # the loop is closed; nobody is waiting any more
            pass

    def _close_pidfd(self) -> None:
        if self.pidfd >= 0:
            self.watch.remove(self.pidfd)
            _close_fds(self.pidfd)
            self.pidfd = -1

    def kill(self, why: str) -> None:
        """Kill the group (only while the leader is unreaped: its pid is still ours)."""
        if self.reaped:
            return
        if self.killed_by is None:
            self.killed_by = why
        kill_group(self.pid)

    def reap(self) -> None:
        """Collect the exited leader's status and resource usage (does not block)."""
        try:
            _, status, usage = os.wait4(self.pid, 0)
        except ChildProcessError:
            self.returncode = None
        else:
            self.returncode = os.waitstatus_to_exitcode(status)
            self.maxrss_bytes = usage.ru_maxrss * 1024  # KiB on Linux
            self.cpu_s = usage.ru_utime + usage.ru_stime
        self.reaped = True
        if self.proc is not None:
            # Popen would otherwise warn that the child "is still running" and keep it
            # in its list of processes to poll.
            self.proc.returncode = self.returncode if self.returncode is not None else -1
        self._close_pidfd()

    async def reap_after_kill(self) -> None:
        """After SIGKILL: wait (bounded, even if cancelled again) for the exit, reap."""
        if not self.exited.done():
            try:
                await asyncio.wait([self.exited], timeout=_REAP_AFTER_CANCEL_S)
            except asyncio.CancelledError:
                pass
        if self.exited.done() and not self.reaped:
            self.reap()

    def reap_in_background(self) -> None:
        """The leader outlived SIGKILL (uninterruptible sleep): reap it when it exits."""
        def reap_later(_: asyncio.Future[None]) -> None:
            if not self.reaped:
                self.reap()
        self.exited.add_done_callback(reap_later)

    async def drained(self, grace_s: float) -> None:
        """Wait for EOF on both pipes, at most ``grace_s`` (a process that left the
        group with setsid may still hold them)."""
        # Usually every writer is gone by now (the group was killed): read what is left
        # at once rather than waiting for the loop to report it.
        self.out.drain_now()
        self.err.drain_now()
        pending = [s.eof for s in (self.out, self.err) if not s.eof.done()]
        if pending:
            await asyncio.wait(pending, timeout=grace_s)

    def close(self) -> None:
        self.out.close()
        self.err.close()


class _MemoryWatch(_PerLoop):
    """Kills process groups whose anonymous resident memory exceeds their limit.

    One instance per event loop; it ticks (``call_later``, no task to cancel at
    shutdown) only while some group is watched, and each tick makes a single pass over
    ``/proc`` for all watched groups.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self.groups: dict[int, tuple[int, Callable[[], None]]] = {}
        self.handle: asyncio.TimerHandle | None = None
        self.page = os.sysconf("SC_PAGE_SIZE")

    def add(self, pgid: int, limit_bytes: int, on_exceed: Callable[[], None]) -> None:
        self.groups[pgid] = (limit_bytes, on_exceed)
        loop = self.loop()
        if self.handle is None and loop is not None:
            self.handle = loop.call_later(_WATCH_INTERVAL_S, self._tick)

    def remove(self, pgid: int) -> None:
        self.groups.pop(pgid, None)
        if not self.groups and self.handle is not None:
            self.handle.cancel()
            self.handle = None

    def _tick(self) -> None:
        self.handle = None
        started = time.perf_counter()
        usage = _group_anon_rss(self.groups.keys(), self.page)
        for pgid, used in usage.items():
            entry = self.groups.get(pgid)
            if entry is not None and used > entry[0]:
                entry[1]()
        loop = self.loop()
        if self.groups and loop is not None:
            # A pass costs ~10 us per process on the machine: on a node running
            # thousands, space the passes out so they take at most ~5% of this thread.
            delay = max(_WATCH_INTERVAL_S, 20 * (time.perf_counter() - started))
            self.handle = loop.call_later(delay, self._tick)


def _group_anon_rss(pgids: Iterable[int], page_size: int | None = None) -> dict[int, int]:
    """Anonymous resident bytes of each process group in ``pgids`` (one ``/proc`` pass).

    Processes that vanish during the pass are skipped. Groups with no live member are
    absent from the result.
    """
    wanted = set(pgids)
    page = page_size or os.sysconf("SC_PAGE_SIZE")
    totals: dict[int, int] = {}
    if not wanted:
        return totals
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        stat_bytes = _read_proc(f"/proc/{name}/stat")
        if stat_bytes is None:
            continue
        # The command name (field 2) may contain spaces and ')': split after the last ')'.
        fields = stat_bytes[stat_bytes.rfind(b")") + 2:].split()
        try:
            pgrp = int(fields[2])
        except (IndexError, ValueError):
            continue
        if pgrp not in wanted:
            continue
        statm = _read_proc(f"/proc/{name}/statm")
        if statm is None:
            continue
        parts = statm.split()
        # statm: size resident shared ...; shared = file-backed + shmem resident pages.
        anon = max(0, int(parts[1]) - int(parts[2])) * page
        totals[pgrp] = totals.get(pgrp, 0) + anon
    return totals


def _read_proc(path: str) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)


def _remove_tree(path: str) -> None:
    """Remove the action's directory, even if the command made parts of it read-only."""
    try:
        os.rmdir(path)  # the common case: the command left nothing behind
        return
    except FileNotFoundError:
        return
    except OSError:
        pass
    shutil.rmtree(path, ignore_errors=True)
    if not os.path.lexists(path):
        return
    # A directory without write or search permission stops rmtree: give them back
    # (directories only, never through a symlink) and try again.
    _add_owner_rwx(path)
    for root, dirs, _ in os.walk(path):
        for name in dirs:
            _add_owner_rwx(os.path.join(root, name))
    shutil.rmtree(path, ignore_errors=True)


def _add_owner_rwx(path: str) -> None:
    try:
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode):
            os.chmod(path, st.st_mode | stat.S_IRWXU)
    except OSError:
        pass


def _release_cgroup(loop: asyncio.AbstractEventLoop, cgroup: CpusetCgroup, path: Path) -> None:
    if not cgroup.release(path):
        # Killed processes leave the cgroup asynchronously: rmdir may need a moment.
        loop.call_later(0.5, cgroup.release, path)


class CpusetCgroup:
    """Optional per-action cgroup v2 with ``cpuset.cpus`` = the granted cores.

    ``parent`` is a cgroup v2 directory delegated to this process (writable, listing
    ``cpuset`` in ``cgroup.controllers``). Where that does not hold, every method is a
    no-op and :meth:`available` says why.
    """

    def __init__(self, parent: str | os.PathLike[str]) -> None:
        self.parent = Path(parent)
        self._available = self._probe()

    def available(self) -> tuple[bool, str]:
        """(usable, why not — or "ok")."""
        return self._available

    def _probe(self) -> tuple[bool, str]:
        controllers = self.parent / "cgroup.controllers"
        try:
            names = controllers.read_text().split()
        except OSError:
            return False, f"{self.parent} is not a cgroup v2 directory"
        if "cpuset" not in names:
            return False, f"the cpuset controller is not delegated to {self.parent}"
        if not os.access(self.parent, os.W_OK):
            return False, f"{self.parent} is not writable"
        subtree = self.parent / "cgroup.subtree_control"
        try:
            if "cpuset" not in subtree.read_text().split():
                subtree.write_text("+cpuset")
        except OSError as exc:
            return False, f"cannot enable cpuset below {self.parent}: {exc.strerror or exc}"
        return True, "ok"

    def confine(self, pid: int, cores: Sequence[int]) -> Path | None:
        """Move ``pid`` into a new child cgroup limited to ``cores``; its path, or None
        when unavailable or when any step fails (the action runs unconfined)."""
        if not self._available[0]:
            return None
        path = self.parent / f"action-{pid}"
        try:
            path.mkdir()
        except OSError:
            return None
        try:
            (path / "cpuset.cpus").write_text(",".join(str(c) for c in cores))
            (path / "cgroup.procs").write_text(str(pid))
        except OSError:
            self.release(path)
            return None
        return path

    def release(self, path: Path) -> bool:
        """Kill what is left in the cgroup and remove it; whether it is gone."""
        kill = path / "cgroup.kill"  # Linux >= 5.14
        if kill.exists():
            try:
                kill.write_text("1")
            except OSError:
                pass
        try:
            path.rmdir()
        except FileNotFoundError:
            return True
        except OSError:
            return False
        return True
