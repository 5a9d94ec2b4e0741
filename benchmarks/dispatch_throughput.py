"""Live dispatcher throughput on no-op actions, side by side with ``xargs -P<cores>``.

Runs N ``/bin/true`` actions (one core each) through the dispatcher (journal on, as in
production) and through ``seq N | xargs -P<cores> -I{} /bin/true``, alternating, R
rounds; prints each rate, the dispatcher ÷ xargs ratio per round and the live
scheduler's decision latency (the ``decide`` call in the dispatcher's loop).

    python benchmarks/dispatch_throughput.py [--n 2000] [--rounds 3]
        [--schedulers elastic_greedy,checkpoints/default]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import tempfile
import time

from metasched.runtime.dispatcher import Dispatcher, DispatcherConfig


def xargs_rate(n: int, procs: int) -> float:
    """Actions per second of ``seq n | xargs -P procs -I{} /bin/true``."""
    t0 = time.perf_counter()
    subprocess.run(f"seq {n} | xargs -P{procs} -I{{}} /bin/true", shell=True, check=True)
    return n / (time.perf_counter() - t0)


async def _dispatch(n: int, scheduler: str, journal: str) -> tuple[float, dict]:
    cfg = DispatcherConfig(scheduler=scheduler, journal=journal)
    async with Dispatcher(cfg) as d:
        t0 = time.perf_counter()
        futs = [d.accept({"kind": "cpu", "argv": ["/bin/true"], "timeout_s": 60})
                for _ in range(n)]
        results = await asyncio.gather(*futs)
        rate = n / (time.perf_counter() - t0)
        bad = [r for r in results if not r.ok]
        if bad:
            raise SystemExit(f"{len(bad)} actions failed, e.g. {bad[0].reason}")
        return rate, d.stats()


def dispatcher_rate(n: int, scheduler: str) -> tuple[float, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        return asyncio.run(_dispatch(n, scheduler, os.path.join(tmp, "journal.db")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000, help="actions per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--schedulers", default="elastic_greedy,checkpoints/default")
    args = ap.parse_args()
    procs = len(os.sched_getaffinity(0))
    scheds = args.schedulers.split(",")
    rates: dict[str, list[float]] = {"xargs": []}
    ratios: dict[str, list[float]] = {s: [] for s in scheds}
    lat: dict[str, list[dict]] = {s: [] for s in scheds}
    for r in range(args.rounds):
        x = xargs_rate(args.n, procs)
        rates["xargs"].append(x)
        for s in scheds:
            rate, stats = dispatcher_rate(args.n, s)
            if stats["fallback"]:
                raise SystemExit(f"{s}: fell back ({stats['fallback']})")
            rates.setdefault(s, []).append(rate)
            ratios[s].append(rate / x)
            lat[s].append(stats["decision_latency_us"])
        print(f"round {r + 1}: xargs -P{procs} {x:,.0f}/s; " + "; ".join(
            f"{s} {rates[s][-1]:,.0f}/s ({ratios[s][-1]:.2f}x)" for s in scheds), flush=True)
    print(f"\n{args.n} x /bin/true, {procs} cores, median of {args.rounds} rounds")
    print("| runner | actions/s | ÷ xargs | decision p50 / p90 / p99 µs |")
    print("|---|---|---|---|")
    print(f"| xargs -P{procs} | {statistics.median(rates['xargs']):,.0f} | 1.00 | — |")
    for s in scheds:
        p = {k: statistics.median(x[k] for x in lat[s]) for k in ("p50", "p90", "p99")}
        print(f"| dispatcher, {s} | {statistics.median(rates[s]):,.0f} "
              f"| {statistics.median(ratios[s]):.2f} "
              f"| {p['p50']:.1f} / {p['p90']:.1f} / {p['p99']:.1f} |")


if __name__ == "__main__":
    main()
