"""Starting a child pinned to its granted cores from its first instruction.

Spawn overhead is what limits a flood of short actions (rates from
``benchmarks/spawn_methods.py``, 2,000 × ``/bin/true``, 2 in flight, 2 cores):

- The child inherits its CPU affinity from the thread that spawns it, so the event-loop
  thread pins *itself* to the granted cores, starts the child with ``subprocess.Popen``
  and restores its own mask. Nothing awaits in between, so no other coroutine runs with
  the temporary mask, and the child is pinned from its first instruction. Before
  restoring, the thread steps off the granted cores: otherwise it stays on the core it
  just gave the child and competes with it (-15-20% throughput).
- ``Popen`` uses ``vfork`` here, which does not copy the parent's page tables (a
  ``fork`` costs time in proportion to the parent's size). With the arguments given
  here (``cwd``, ``start_new_session=True``) Popen never takes its ``posix_spawn``
  path, not even on 3.13, which allows it with ``close_fds=True``; it goes through
  ``_posixsubprocess``, which on Linux calls ``vfork`` whenever no ``preexec_fn`` and no
  user or group change are asked for (CPython 3.10 to 3.13, seen with strace on
  3.10.13, 3.11.7, 3.12.1 and 3.13.0; ``setsid`` after ``vfork`` is allowed since
  3.10). CPython 3.12.0 alone fell back to ``fork`` by mistake (gh-112334, fixed in
  3.12.1). The rlimit fallback's ``preexec_fn`` (where util-linux ``prlimit(1)`` is
  missing, see :mod:`.limits`) makes it a ``fork``.
- stdin is one shared read-only descriptor of ``/dev/null`` instead of
  ``subprocess.DEVNULL`` (an open and a close per spawn), and the environment comes
  built as bytes (:mod:`.environment`), which Popen passes on without re-encoding.
- Measured against ``seq N | xargs -P2 -I{} /bin/true`` on a quiet machine, with the
  private ``_posixsubprocess.fork_exec`` this package called before: 0.74-0.8x with
  the working directory on ext4, 0.9-1.0x with ``cwd_root`` on a tmpfs; Popen's own
  Python work costs about 7% of the spawn rate (``docs/benchmarks/decisions.md``). A spawner
  thread reaches ~0.45x, ``asyncio.create_subprocess_exec`` ~0.55x even without
  pinning, and with a pinning ``preexec_fn`` ~0.15x (0.02x with a 1 GB parent).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable

__all__ = ["spawn"]


def spawn(args: list[str], cores: list[int], env: dict[bytes, bytes], cwd: str,
          out_w: int, err_w: int, preexec: Callable[[], None] | None) -> subprocess.Popen:
    """Start ``args`` in ``cwd``, in a new session, pinned to ``cores``, with stdout and
    stderr on ``out_w`` and ``err_w``; raises what Popen raises when it cannot start.

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
        # close_fds: the child gets none of this process's descriptors (other actions'
        # pipes would otherwise stay open until it exits); restore_signals (the
        # default) gives it default dispositions of SIGPIPE and SIGXFSZ.
        return subprocess.Popen(
            args, stdin=_devnull(), stdout=out_w, stderr=err_w, cwd=cwd, env=env,
            close_fds=True, start_new_session=True, preexec_fn=preexec,
        )
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

_devnull_fd = -1


def _devnull() -> int:
    """A read-only, close-on-exec descriptor of /dev/null for the children's stdin,
    opened once (an open and a close per spawn otherwise)."""
    global _devnull_fd
    if _devnull_fd < 0:
        _devnull_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    return _devnull_fd
