"""Live dispatcher throughput on no-op actions, side by side with ``xargs -P<cores>``.

Runs N ``/bin/true`` actions (one core each) through ``seq N | xargs -P<cores> -I{}
/bin/true``, through the bare CPU executor (``run_process``, <cores> at a time, no
dispatcher: the floor), and through the dispatcher with each scheduler (journal on and
commands isolated in sandboxes, as in production; for the first scheduler once more
without the journal, and once per other ``--isolation`` mode), alternating, R rounds;
prints each rate, the ratio to xargs per round, the live scheduler's decision latency
(the ``decide`` call in the dispatcher's loop) and where the CPU went: this process's
own CPU per action (the runner; xargs runs in a child, so its row has none) and its
children's (the commands; for xargs, xargs itself too), from ``getrusage``, and how
many cores were busy on average.

    python benchmarks/dispatch_throughput.py [--n 2000] [--rounds 3]
        [--schedulers elastic_greedy,checkpoints/default] [--isolation bwrap,none,off]

Commands started by the sandbox server are its children: their CPU counts among this
process's children once the server has exited (each dispatcher run ends with it).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import subprocess
import tempfile
import time

from metasched.runtime.dispatch import Dispatcher, DispatcherConfig
from metasched.runtime.sandbox.config import SandboxConfig


def _cpu_s() -> tuple[float, float]:
    """CPU seconds (user + system) of this process and of its reaped children."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def xargs_rate(n: int, procs: int) -> float:
    """Actions per second of ``seq n | xargs -P procs -I{} /bin/true``."""
    t0 = time.perf_counter()
    subprocess.run(f"seq {n} | xargs -P{procs} -I{{}} /bin/true", shell=True, check=True)
    return n / (time.perf_counter() - t0)


async def _bare(n: int, cores: list[int]) -> float:
    """Actions per second of ``run_process`` alone, one per core at a time."""
    from metasched.runtime.machine import default_workdir
    from metasched.runtime.process import run_process

    todo = iter(range(n))
    workdir = default_workdir()

    async def lane(core: int) -> None:
        for _ in todo:
            out = await run_process(["/bin/true"], cores=[core], timeout_s=60, cwd_root=workdir)
            if not out.ok:
                raise SystemExit(f"run_process failed: {out.reason}")

    t0 = time.perf_counter()
    await asyncio.gather(*(lane(c) for c in cores))
    return n / (time.perf_counter() - t0)


async def _dispatch(n: int, scheduler: str, journal: str | None,
                    isolation: str) -> tuple[float, dict]:
    # "off": no isolation and no cgroups (affinity and rlimits only)
    sandbox = (SandboxConfig(isolation="none", cgroups="none") if isolation == "off"
               else SandboxConfig(isolation=isolation))
    cfg = DispatcherConfig(scheduler=scheduler, journal=journal, sandbox=sandbox)
    async with Dispatcher(cfg) as d:
        t0 = time.perf_counter()
        futs = [d.accept({"kind": "cpu", "argv": ["/bin/true"], "timeout_s": 60})
                for _ in range(n)]
        results = await asyncio.gather(*futs)
        rate = n / (time.perf_counter() - t0)
        bad = [r for r in results if not r.ok]
        if bad:
            raise SystemExit(f"{len(bad)} actions failed, e.g. {bad[0].reason}")
        if isolation not in ("none", "off") and not d.sandboxes.isolated:
            raise SystemExit(f"isolation {isolation} is not available here: "
                             f"{'; '.join(d.sandboxes.warnings)}")
        return rate, d.stats()


def dispatcher_rate(n: int, scheduler: str, journal: bool = True,
                    isolation: str = "bwrap") -> tuple[float, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "journal.db") if journal else None
        return asyncio.run(_dispatch(n, scheduler, path, isolation))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000, help="actions per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--schedulers", default="elastic_greedy,checkpoints/default")
    ap.add_argument("--isolation", default="bwrap,none,off",
                    help="isolation modes (the first for every scheduler, the others for "
                         "the first scheduler; off: no isolation and no cgroups)")
    args = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    procs = len(cores)
    scheds = args.schedulers.split(",")
    modes = args.isolation.split(",")
    # name -> (scheduler, journal, isolation)
    configs = {f"dispatcher, {s}, isolation {modes[0]}": (s, True, modes[0]) for s in scheds}
    configs[f"dispatcher, {scheds[0]}, isolation {modes[0]}, no journal"] = (
        scheds[0], False, modes[0])
    for m in modes[1:]:
        configs[f"dispatcher, {scheds[0]}, isolation {m}"] = (scheds[0], True, m)
    runners = ["run_process alone", *configs]
    rates: dict[str, list[float]] = {r: [] for r in ["xargs", *runners]}
    lat: dict[str, list[dict]] = {r: [] for r in runners}
    # per runner and round: (own CPU µs per action, children's CPU µs per action, cores busy)
    cpu: dict[str, list[tuple[float, float, float]]] = {r: [] for r in rates}

    def measure(name: str, run) -> float:
        (me0, kids0), t0 = _cpu_s(), time.perf_counter()
        rate = run()
        (me1, kids1), wall = _cpu_s(), time.perf_counter() - t0
        per = 1e6 / args.n
        cpu[name].append(((me1 - me0) * per, (kids1 - kids0) * per,
                          (me1 - me0 + kids1 - kids0) / wall))
        rates[name].append(rate)
        return rate

    for r in range(args.rounds):
        x = measure("xargs", lambda: xargs_rate(args.n, procs))
        for name in runners:
            if name == "run_process alone":
                measure(name, lambda: asyncio.run(_bare(args.n, cores)))
            else:
                sched, journal, isolation = configs[name]
                out: dict = {}

                def run(sched=sched, journal=journal, isolation=isolation,
                        out=out) -> float:
                    rate, out["stats"] = dispatcher_rate(args.n, sched, journal=journal,
                                                         isolation=isolation)
                    return rate

                measure(name, run)
                stats = out["stats"]
                if stats["fallback"]:
                    raise SystemExit(f"{sched}: fell back ({stats['fallback']})")
                lat[name].append(stats["decision_latency_us"])
        print(f"round {r + 1}: xargs -P{procs} {x:,.0f}/s; " + "; ".join(
            f"{n} {rates[n][-1]:,.0f}/s ({rates[n][-1] / x:.2f}x)" for n in runners), flush=True)
    print(f"\n{args.n} x /bin/true, {procs} cores, median of {args.rounds} rounds "
          "(ratios: median of the per-round ratios)")
    print("| runner | actions/s | ÷ xargs | decision p50 / p90 / p99 µs "
          "| runner CPU µs/action | children CPU µs/action | cores busy |")
    print("|---|---|---|---|---|---|---|")

    def cpu_cells(name: str) -> str:
        own, kids, busy = (statistics.median(c[i] for c in cpu[name]) for i in range(3))
        return f"{own:,.0f} | {kids:,.0f} | {busy:.2f}"

    print(f"| xargs -P{procs} | {statistics.median(rates['xargs']):,.0f} | 1.00 | — | — "
          f"| {cpu_cells('xargs').split(' | ', 1)[1]} |")
    for name in runners:
        ratio = statistics.median(a / b for a, b in zip(rates[name], rates["xargs"], strict=True))
        if lat[name]:
            p = {k: statistics.median(x[k] for x in lat[name]) for k in ("p50", "p90", "p99")}
            latency = f"{p['p50']:.1f} / {p['p90']:.1f} / {p['p99']:.1f}"
        else:
            latency = "—"
        print(f"| {name} | {statistics.median(rates[name]):,.0f} | {ratio:.2f} | {latency} "
              f"| {cpu_cells(name)} |")


if __name__ == "__main__":
    main()
