"""What isolation adds to a command's latency: an isolated no-op (``/bin/true``) against a
bare one, side by side.

Each design runs ``/bin/true`` N times, in blocks of ``--block`` interleaved with the
other designs' blocks (so that the load of a shared machine falls on all alike, while
the kernel's deferred clean-up of one design's fresh namespaces, e.g. a network
namespace's, is mostly over before another design's block); the table gives each one's
p50 and p99 latency from start to observed exit and what it adds to the bare spawn.
Designs:

- ``bare``: ``posix_spawn`` of ``/bin/true`` and ``waitpid`` (no isolation);
- ``unshare``: a fresh ``unshare --pid --fork --mount --net --ipc --uts`` per command;
- ``bwrap``: a fresh bubblewrap per command (own pid and net namespaces, ``/proc``, a
  tmpfs ``/tmp``, the system read-only);
- ``nsenter``: entering a live sandbox's namespaces per command with util-linux
  ``nsenter`` (mount, net, ipc, uts, pid), as the sandbox's user (``-S``/``-G``);
- ``server``: the dispatcher's design: the sandbox server enters a trajectory's live
  namespaces and ``posix_spawn``s the command as the sandbox's user, in a cgroup slot
  configured for it (cpuset, memory, pids) and killed and emptied after it;
- ``server-private``: the same for a trajectory-less command (its own mount namespace
  and a fresh tmpfs workspace each time);
- ``server-net``: ``server`` in a trajectory's sandbox granted network (its own
  network namespace with slirp4netns and the egress rules; before them, the host's);
- ``executor``, ``executor-isolated``: the CPU executor the dispatcher calls
  (``run_process``: pinning, pipes, output tails, timeout) without sandboxes and in a
  trajectory's sandbox with its cgroup slot: the end-to-end figure;
  ``executor-private``: in the trajectory-less sandbox (a private workspace each time).

It also times making a trajectory's sandbox (``--opens`` of them without network and as
many with, alternately: from the request to the server's "ready"; bwrap's namespaces
and mounts, the workspace tmpfs, and for a networked one its stack and rules), and the
executor with and without isolation after an idle spell (``--idle-ms`` before each of
``--idle-n`` commands): entering a cgroup after some idle time can wait for an RCU grace
period where cgroups are mounted without ``favordynmods``.

    python benchmarks/sandbox_cost.py [--n 200] [--block 10] [--opens 20]
        [--idle-ms 200] [--idle-n 20] [--designs bare,server,...]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import time
from collections.abc import Awaitable, Callable

from metasched.runtime.sandbox import bwrap
from metasched.runtime.sandbox.config import SandboxConfig
from metasched.runtime.sandbox.manager import Sandboxes

TRUE = "/bin/true"
ENV = {b"PATH": b"/usr/bin:/bin"}


def _spawn_wait(argv: list[str]) -> None:
    pid = os.posix_spawn(argv[0], argv, ENV)
    _, status = os.waitpid(pid, 0)
    if status != 0:
        raise SystemExit(f"{argv[0]} failed (wait status {status})")


class Bench:
    """The designs, each a coroutine running ``/bin/true`` once."""

    def __init__(self) -> None:
        self.sandboxes = Sandboxes(SandboxConfig(isolation="bwrap"))
        self.loop = asyncio.get_running_loop()
        self.sandboxes.attach(self.loop)
        self.traj = self.sandboxes.open("bench", size_mb=64, template=None, network=False)
        self.traj_net = self.sandboxes.open("bench-net", size_mb=64, template=None, network=True)
        self.shared = self.sandboxes.shared(network=False)
        self.bwrap = self.sandboxes.bwrap_path
        self.unshare = shutil.which("unshare")
        self.nsenter = shutil.which("nsenter")

    async def ready(self) -> None:
        await self.traj.ready
        await self.traj_net.ready
        await self.shared.ready
        self.target = str(self.traj.init_pid)  # nsenter's target

    async def bare(self) -> None:
        _spawn_wait([TRUE])

    async def unshare_fresh(self) -> None:
        _spawn_wait([self.unshare, "--pid", "--fork", "--mount", "--net", "--ipc", "--uts",
                     TRUE])

    async def bwrap_fresh(self) -> None:
        _spawn_wait([self.bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
                     "--tmpfs", "/tmp", "--unshare-pid", "--unshare-net", TRUE])

    async def nsenter_live(self) -> None:
        uid = str(self.traj.uid)
        _spawn_wait([self.nsenter, "-t", self.target, "-m", "-n", "-i", "-u", "-p",
                     "-S", uid, "-G", uid, TRUE])

    async def _server(self, sb) -> None:
        done = self.loop.create_future()
        r, w = os.pipe()
        try:
            started = self.sandboxes.start(sb, argv=[TRUE], env=ENV, cores=[0],
                                       mem_limit_mb=256, pids_max=64, out_w=w, err_w=w)
        finally:
            os.close(w)
        self.sandboxes.on_exit(started, done.set_result)
        ev = await done
        os.close(r)
        self.sandboxes.finished(sb, started)
        if ev["status"] != 0:
            raise SystemExit(f"sandboxed /bin/true failed: {ev}")

    async def server(self) -> None:
        await self._server(self.traj)

    async def server_private(self) -> None:
        await self._server(self.shared)

    async def server_net(self) -> None:
        await self._server(self.traj_net)

    async def executor(self) -> None:
        from metasched.runtime.process import run_process

        out = await run_process([TRUE], cores=[0], timeout_s=60, env={"PATH": "/usr/bin:/bin"})
        if not out.ok:
            raise SystemExit(out.reason)

    async def executor_isolated(self) -> None:
        from metasched.runtime.process import run_process

        out = await run_process([TRUE], cores=[0], timeout_s=60, env={"PATH": "/usr/bin:/bin"},
                                sandboxes=self.sandboxes, sandbox=self.traj, pids_max=1024)
        if not out.ok:
            raise SystemExit(out.reason)

    async def executor_private(self) -> None:
        from metasched.runtime.process import run_process

        out = await run_process([TRUE], cores=[0], timeout_s=60, env={"PATH": "/usr/bin:/bin"},
                                sandboxes=self.sandboxes, sandbox=self.shared, pids_max=1024)
        if not out.ok:
            raise SystemExit(out.reason)

    async def open_times(self, n: int) -> dict[bool, list[float]]:
        """Milliseconds to make ``n`` trajectory sandboxes without network and ``n``
        with, alternately, one after the other (by network granted)."""
        out: dict[bool, list[float]] = {False: [], True: []}
        for i in range(n):
            for network in (False, True):
                t0 = time.perf_counter()
                sb = self.sandboxes.open(f"open-{i}-{network}", size_mb=64, template=None,
                                     network=network)
                await sb.ready
                out[network].append((time.perf_counter() - t0) * 1e3)
                self.sandboxes.close_sandbox(sb)
        return out

    def close(self) -> None:
        self.sandboxes.close()


DESIGNS = {"bare": Bench.bare, "unshare": Bench.unshare_fresh, "bwrap": Bench.bwrap_fresh,
           "nsenter": Bench.nsenter_live, "server": Bench.server,
           "server-private": Bench.server_private, "server-net": Bench.server_net,
           "executor": Bench.executor,
           "executor-isolated": Bench.executor_isolated,
           "executor-private": Bench.executor_private}


async def measure(n: int, block: int, names: list[str], opens: int, idle_ms: float,
                  idle_n: int) -> tuple[dict[str, list[float]], dict[bool, list[float]],
                                        dict[str, list[float]]]:
    bench = Bench()
    try:
        await bench.ready()
        open_ms = await bench.open_times(opens) if opens else {False: [], True: []}
        idle: dict[str, list[float]] = {"executor": [], "executor-isolated": []}
        for _ in range(idle_n if idle_ms > 0 else 0):
            for name in idle:
                await asyncio.sleep(idle_ms / 1e3)
                t0 = time.perf_counter()
                await DESIGNS[name](bench)
                idle[name].append((time.perf_counter() - t0) * 1e3)
        runs: dict[str, Callable[[], Awaitable[None]]] = {
            name: DESIGNS[name].__get__(bench) for name in names}
        for run in runs.values():  # warm up (first spawns page things in)
            for _ in range(5):
                await run()
        times: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(0, n, block):
            for name, run in runs.items():
                for _ in range(block):
                    t0 = time.perf_counter()
                    await run()
                    times[name].append((time.perf_counter() - t0) * 1e3)
        return times, open_ms, idle
    finally:
        bench.close()


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1] if q < 100 else max(xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=200, help="commands per design")
    ap.add_argument("--block", type=int, default=10, help="commands per design in a row")
    ap.add_argument("--opens", type=int, default=20, help="sandboxes made, timed")
    ap.add_argument("--idle-ms", type=float, default=200.0, help="idle spell before each "
                    "command of the after-idle measurement (0: skip it)")
    ap.add_argument("--idle-n", type=int, default=20, help="commands after an idle spell")
    ap.add_argument("--designs", default=",".join(DESIGNS),
                    help=f"comma-separated, from {', '.join(DESIGNS)}")
    args = ap.parse_args()
    names = [x for x in args.designs.split(",") if x]
    unknown = [x for x in names if x not in DESIGNS]
    if unknown:
        raise SystemExit(f"error: designs: unknown {', '.join(unknown)} (known: "
                         f"{', '.join(DESIGNS)})")
    if os.geteuid() != 0:
        raise SystemExit("SKIPPED: the sandbox needs root")
    path, why = bwrap.find_bwrap()
    if path is None:
        raise SystemExit(f"SKIPPED: {why}")
    if "bare" not in names:
        names.insert(0, "bare")
    times, open_ms, idle = asyncio.run(measure(args.n, max(1, args.block), names, args.opens,
                                               args.idle_ms, args.idle_n))
    base50, base99 = pct(times["bare"], 50), pct(times["bare"], 99)
    print(f"{args.n} × /bin/true per design, in interleaved blocks of {args.block}; latency "
          f"from start to observed exit, ms (load average {os.getloadavg()[0]:.2f})")
    print("| design | p50 ms | p99 ms | added p50 ms | added p99 ms |")
    print("|---|---|---|---|---|")
    for name in names:
        p50, p99 = pct(times[name], 50), pct(times[name], 99)
        print(f"| {name} | {p50:.2f} | {p99:.2f} | {p50 - base50:+.2f} | {p99 - base99:+.2f} |")
    if "executor" in times and "executor-isolated" in times:
        add = pct(times["executor-isolated"], 50) - pct(times["executor"], 50)
        add99 = pct(times["executor-isolated"], 99) - pct(times["executor"], 99)
        print(f"\nisolation added to the executor: {add:+.2f} ms p50, {add99:+.2f} ms p99 "
              f"(goal: <= 5 ms p50)")
    if open_ms[False]:
        print(f"making a trajectory's sandbox ({len(open_ms[False])} each, alternately), ms:")
        print("| network | p50 | p99 | max |\n|---|---|---|---|")
        for network, xs in open_ms.items():
            print(f"| {'granted' if network else 'none'} | {pct(xs, 50):.1f} | "
                  f"{pct(xs, 99):.1f} | {max(xs):.1f} |")
    if idle["executor"]:
        print(f"after {args.idle_ms:g} ms idle ({args.idle_n} each): executor p50 "
              f"{pct(idle['executor'], 50):.2f} ms, executor-isolated p50 "
              f"{pct(idle['executor-isolated'], 50):.2f} ms (max "
              f"{max(idle['executor']):.2f} / {max(idle['executor-isolated']):.2f})")


if __name__ == "__main__":
    main()
