"""Spawn rate of ways to start pinned subprocesses from asyncio, against xargs.

    .venv/bin/python benchmarks/spawn_methods.py [--n 2000] [--concurrency 2]
                                                 [--ballast-mb 0] [--repeat 3]

Each method runs ``--n`` × ``/bin/true`` with ``--concurrency`` in flight, each child
pinned to one core (round robin), in its own session, in a fresh temporary directory,
with stdout and stderr captured, and reports spawns per second, best and median of
``--repeat`` rounds (each round runs every method once, so a noisy neighbour hits all
methods alike):

- ``xargs``: ``seq N | xargs -P<concurrency> -I{} /bin/true``, the reference
  (no pinning, no capture, no temporary directory).
- ``run_process``: :func:`metasched.runtime.process.run_process` as shipped: the
  event-loop thread pins itself to the granted core around ``subprocess.Popen`` (vfork,
  no ``preexec_fn``), then steps off that core; exit awaited on a pidfd.
- ``run_process(stay)``: the same without stepping the event-loop thread off the
  granted core after the spawn (it then shares that core with the child for a while).
- ``run_process(shm)``: the same with ``cwd_root="/dev/shm"`` (tmpfs: creating and
  removing the temporary directory is ~10x cheaper than on ext4).
- ``run_process+rlimit``: the same with ``cpu_time_s`` set: the command is run through
  util-linux ``prlimit(1)``, which sets the limits on itself and execs it (a second
  exec, but still vfork).
- ``run_process+rlimit(preexec)``: the fallback where ``prlimit(1)`` is missing: a
  ``preexec_fn`` (setrlimit in the child), which forces ``fork`` of this process.
- ``spawner_thread``: ``Popen`` (vfork) from a dedicated thread that pins itself per
  spawn, handed over with ``run_in_executor``; pidfd wait on the loop.
- ``asyncio_preexec``: ``asyncio.create_subprocess_exec`` with a ``preexec_fn`` calling
  ``sched_setaffinity`` (fork; the child watcher reaps).
- ``asyncio_vfork``: ``asyncio.create_subprocess_exec`` without ``preexec_fn`` and
  without pinning: the floor of asyncio's subprocess machinery, not a valid method.

``--ballast-mb`` makes this process touch that much memory first, to show how ``fork``
(but not ``vfork``) slows down with the size of the parent (a dispatcher that imported
torch holds several hundred MB). ``--methods a,b`` runs only those (xargs always runs);
the fork-based ones take minutes with a large ballast.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable

from metasched.runtime.process import limits, run_process, spawn

ARGV = ["/bin/true"]


def bench_xargs(n: int, concurrency: int) -> float:
    t0 = time.perf_counter()
    subprocess.run(f"seq {n} | xargs -P{concurrency} -I{{}} /bin/true", shell=True, check=True)
    return n / (time.perf_counter() - t0)


async def _drive(n: int, concurrency: int, one: Callable[[int], Awaitable[None]]) -> float:
    cores = sorted(os.sched_getaffinity(0))
    counter = iter(range(n))

    async def worker() -> None:
        for i in counter:
            await one(cores[i % len(cores)])

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return n / (time.perf_counter() - t0)


async def _run_process(core: int) -> None:
    out = await run_process(ARGV, cores=[core], timeout_s=10)
    assert out.ok, out


async def _run_process_stay(core: int) -> None:
    spawn._step_off_granted_cores = False
    try:
        await _run_process(core)
    finally:
        spawn._step_off_granted_cores = True


async def _run_process_shm(core: int) -> None:
    out = await run_process(ARGV, cores=[core], timeout_s=10, cwd_root="/dev/shm")
    assert out.ok, out


async def _run_process_rlimit(core: int) -> None:
    out = await run_process(ARGV, cores=[core], timeout_s=10, cpu_time_s=60)
    assert out.ok, out


async def _run_process_rlimit_preexec(core: int) -> None:
    saved = limits._prlimit_checked, limits._prlimit_path
    limits._prlimit_checked, limits._prlimit_path = True, None  # as if prlimit(1) lacked
    try:
        await _run_process_rlimit(core)
    finally:
        limits._prlimit_checked, limits._prlimit_path = saved


async def _asyncio_exec(core: int, preexec: bool) -> None:
    cwd = tempfile.mkdtemp(prefix="bench-")
    try:
        proc = await asyncio.create_subprocess_exec(
            *ARGV, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            cwd=cwd, start_new_session=True,
            preexec_fn=(lambda: os.sched_setaffinity(0, [core])) if preexec else None)
        await proc.communicate()
        assert proc.returncode == 0
    finally:
        shutil.rmtree(cwd)


_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="spawner")


def _popen_pinned(core: int, cwd: str, out_w: int, err_w: int) -> subprocess.Popen:
    os.sched_setaffinity(0, [core])  # this is the spawner thread's mask
    return subprocess.Popen(ARGV, stdin=subprocess.DEVNULL, stdout=out_w, stderr=err_w,
                            cwd=cwd, start_new_session=True)


async def _spawner_thread(core: int) -> None:
    loop = asyncio.get_running_loop()
    cwd = tempfile.mkdtemp(prefix="bench-")
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        proc = await loop.run_in_executor(_POOL, _popen_pinned, core, cwd, out_w, err_w)
    finally:
        os.close(out_w)
        os.close(err_w)
    done = loop.create_future()
    pidfd = os.pidfd_open(proc.pid)
    loop.add_reader(pidfd, lambda: done.done() or done.set_result(None))
    readers = []
    for fd in (out_r, err_r):
        os.set_blocking(fd, False)
        eof = loop.create_future()

        def on_read(fd: int = fd, eof: asyncio.Future = eof) -> None:
            if not os.read(fd, 65536):
                loop.remove_reader(fd)
                eof.set_result(None)

        loop.add_reader(fd, on_read)
        readers.append(eof)
    await done
    loop.remove_reader(pidfd)
    os.close(pidfd)
    proc.wait()
    await asyncio.gather(*readers)
    os.close(out_r)
    os.close(err_r)
    os.rmdir(cwd)
    assert proc.returncode == 0


METHODS: dict[str, Callable[[int], Awaitable[None]]] = {
    "run_process": _run_process,
    "run_process(stay)": _run_process_stay,
    "run_process(shm)": _run_process_shm,
    "run_process+rlimit": _run_process_rlimit,
    "run_process+rlimit(preexec)": _run_process_rlimit_preexec,
    "spawner_thread": _spawner_thread,
    "asyncio_preexec": lambda core: _asyncio_exec(core, preexec=True),
    "asyncio_vfork": lambda core: _asyncio_exec(core, preexec=False),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--ballast-mb", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--methods", default=",".join(METHODS),
                        help="comma-separated subset of: " + ", ".join(METHODS))
    args = parser.parse_args()
    methods = {name: METHODS[name] for name in args.methods.split(",")}
    ballast = bytearray(args.ballast_mb * 1024 * 1024)
    for i in range(0, len(ballast), 4096):  # touch every page so fork has to copy its PTEs
        ballast[i] = 1
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cpus, affinity "
          f"{sorted(os.sched_getaffinity(0))}, ballast {args.ballast_mb} MB, "
          f"n={args.n}, concurrency={args.concurrency}")
    runs: dict[str, list[float]] = {"xargs": [], **{name: [] for name in methods}}
    for _ in range(args.repeat):
        runs["xargs"].append(bench_xargs(args.n, args.concurrency))
        for name, one in methods.items():
            runs[name].append(asyncio.run(_drive(args.n, args.concurrency, one)))
    ref = statistics.median(runs["xargs"])
    print(f"{'method':28s} {'best':>8s} {'median':>8s}  (spawns/s)  median/xargs median")
    for name, rates in runs.items():
        med = statistics.median(rates)
        print(f"{name:28s} {max(rates):8.0f} {med:8.0f}  {med / ref:5.2f}x")


if __name__ == "__main__":
    main()
