"""What ``sandbox.isolation: gvisor`` costs against bubblewrap: a command's latency in a
live sandbox, and making a sandbox.

Designs, each running ``/bin/true`` N times in blocks of ``--block`` interleaved with
the other designs' blocks (so that a shared machine's load falls on all alike):

- ``bwrap``: the dispatcher's bubblewrap design (the sandbox server enters a trajectory's
  live namespaces and spawns the command in a cgroup slot configured for it);
- ``gvisor``: the dispatcher's gVisor design: a request to the trajectory's exec server
  (one long-lived ``runsc exec`` in its runsc container, :mod:`.gvisor_exec`), which
  forks the command inside gVisor with its user, affinity and seccomp filter, relays its
  output and reports its exit once what is left of it is killed;
- ``runsc-exec``: ``runsc exec`` of ``/bin/true`` into a live container and nothing
  else (the bound of the former design, a ``runsc exec`` per command).

Each time is from the request to the observed exit. It also times making a trajectory's
sandbox (``--opens`` of each mode, alternately; from the request to "ready"): for
gVisor, the bundle written, ``runsc run --detach`` of a container, its init agent and
its exec server up (``gvisor``, ``sandbox.gvisor_warm=0``), or a container started
ahead taken
(``gvisor-warm``, ``sandbox.gvisor_warm=1``: the next one has started by then, as when
trajectories do not all start at once). ``--net-opens`` times making a sandbox granted
network (``bwrap-net``, ``gvisor-net``: its network namespace, nftables rules and
slirp4netns up, and for gVisor the container started in that namespace after them;
never taken from the warm pool).

    python benchmarks/gvisor_latency.py [--n 200] [--block 10] [--opens 20] [--net-opens 10]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from metasched.runtime.sandbox import bwrap, gvisor  # noqa: E402
from metasched.runtime.sandbox.config import SandboxConfig  # noqa: E402
from metasched.runtime.sandbox.manager import Sandboxes  # noqa: E402

TRUE = "/bin/true"
ENV = {b"PATH": b"/usr/bin:/bin", b"HOME": b"/workspace"}


class Mode:
    """One isolation mode's dispatcher sandboxes and one live trajectory sandbox."""

    def __init__(self, isolation: str, warm: int = 0) -> None:
        self.sandboxes = Sandboxes(SandboxConfig(isolation=isolation, gvisor_warm=warm,
                                             workspace_mb=64))
        self.loop = asyncio.get_running_loop()
        self.sandboxes.attach(self.loop)
        self.traj = self.sandboxes.open("bench", size_mb=64, template=None, network=False)

    async def command(self) -> None:
        await self.traj.ready
        done = self.loop.create_future()
        r, w = os.pipe()
        try:
            started = self.sandboxes.start(self.traj, argv=[TRUE], env=ENV, cores=[0],
                                       mem_limit_mb=256, pids_max=64, out_w=w, err_w=w)
        finally:
            os.close(w)
        self.sandboxes.on_exit(started, done.set_result)
        ev = await done
        os.close(r)
        self.sandboxes.finished(self.traj, started)
        if ev["status"] != 0:
            raise SystemExit(f"sandboxed /bin/true failed: {ev}")

    async def opens(self, key: str, network: bool = False) -> float:
        t0 = time.perf_counter()
        sb = self.sandboxes.open(key, size_mb=64, template=None, network=network)
        await sb.ready
        took = (time.perf_counter() - t0) * 1e3
        self.sandboxes.close_sandbox(sb)
        return took

    def runsc_exec(self, argv: list[str]) -> None:
        """``runsc exec`` alone, into the live container (gVisor only)."""
        gv = self.sandboxes.gvisor
        cid = f"{gv.prefix}{self.traj.sid}"
        subprocess.run([*gv.argv, "exec", "--user", f"{self.traj.uid}:{self.traj.uid}",
                        "--cwd", "/workspace", cid, *argv], check=True,
                       stdout=subprocess.DEVNULL)

    def close(self) -> None:
        self.sandboxes.close()


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1]


async def measure(n: int, block: int, opens: int,
                  net_opens: int = 0) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    modes = {"bwrap": Mode("bwrap"), "gvisor": Mode("gvisor"),
             "gvisor-warm": Mode("gvisor", warm=1)}
    try:
        for m in modes.values():
            await m.traj.ready
        gv = modes["gvisor"]
        runs = {"bwrap": modes["bwrap"].command, "gvisor": gv.command,
                "runsc-exec": lambda: asyncio.to_thread(gv.runsc_exec, [TRUE])}
        for run in runs.values():  # warm up
            for _ in range(3):
                await run()
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(0, n, block):
            for name, run in runs.items():
                for _ in range(block):
                    t0 = time.perf_counter()
                    await run()
                    times[name].append((time.perf_counter() - t0) * 1e3)
        open_ms: dict[str, list[float]] = {name: [] for name in modes}
        for i in range(opens):
            for name, m in modes.items():
                if name == "gvisor-warm":  # the next one started (as between trajectories)
                    await asyncio.gather(*(b.ready for p in m.sandboxes._warm.values() for b in p))
                open_ms[name].append(await m.opens(f"open-{i}"))
        for name in ("bwrap", "gvisor"):
            open_ms[f"{name}-net"] = []
        for i in range(net_opens):
            for name in ("bwrap", "gvisor"):
                open_ms[f"{name}-net"].append(await modes[name].opens(f"net-{i}", True))
        return times, open_ms
    finally:
        for m in modes.values():
            m.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=200, help="commands per design")
    ap.add_argument("--block", type=int, default=10, help="commands per design in a row")
    ap.add_argument("--opens", type=int, default=20, help="sandboxes made per mode, timed")
    ap.add_argument("--net-opens", type=int, default=10,
                    help="sandboxes granted network made per mode, timed")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("SKIPPED: the sandboxes need root")
    for find in (bwrap.find_bwrap, gvisor.find_runsc):
        path, why = find()
        if path is None:
            raise SystemExit(f"SKIPPED: {why}")
    times, open_ms = asyncio.run(measure(args.n, max(1, args.block), args.opens,
                                         args.net_opens))
    base50, base99 = pct(times["bwrap"], 50), pct(times["bwrap"], 99)
    print(f"{args.n} × /bin/true per design, in interleaved blocks of {args.block}; latency "
          f"from request to observed exit, ms (load average {os.getloadavg()[0]:.2f}, "
          f"{os.cpu_count()} cores)")
    print("| design | p50 ms | p99 ms | over bwrap p50 ms | over bwrap p99 ms |")
    print("|---|---|---|---|---|")
    for name, xs in times.items():
        p50, p99 = pct(xs, 50), pct(xs, 99)
        print(f"| {name} | {p50:.1f} | {p99:.1f} | {p50 - base50:+.1f} | {p99 - base99:+.1f} |")
    if args.opens or args.net_opens:
        print(f"\nmaking a trajectory's sandbox ({args.opens} per mode, {args.net_opens} "
              "granted network; alternately), ms")
        print("| mode | p50 ms | p99 ms |")
        print("|---|---|---|")
        for name, xs in open_ms.items():
            if len(xs) > 1:
                print(f"| {name} | {pct(xs, 50):.1f} | {pct(xs, 99):.1f} |")


if __name__ == "__main__":
    main()
