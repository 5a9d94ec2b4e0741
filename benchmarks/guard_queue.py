"""Dispatch rate with a deep queue older than the starvation guard's limit.

Queues N ``/bin/true`` actions (one core each) on a dispatcher at once and measures the
completion rate over a window that starts once the queue has waited past ``max_wait_s``
(so every queued action is overdue and the guard acts at every pass), side by side with
the same run under ``max_wait_s=null`` (the guard off), alternating, R rounds. Prints
each rate and the ratio of the guarded rate to the unguarded one per round.

    python benchmarks/guard_queue.py [--n 100000] [--max-wait 5] [--window 10]
        [--rounds 3] [--scheduler elastic_greedy] [--journal]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time

from metasched.runtime.dispatch import Dispatcher, DispatcherConfig


async def _rate(n: int, max_wait_s: float | None, start_s: float, window_s: float,
                scheduler: str, journal: str | None) -> tuple[float, int]:
    """Completions per second in [start_s, start_s + window_s) after ``n`` were queued
    (in one loop turn); also how many were still queued when the window closed."""
    cfg = DispatcherConfig(scheduler=scheduler, journal=journal, max_wait_s=max_wait_s)
    done_at: list[float] = []
    async with Dispatcher(cfg) as d:
        for _ in range(n):
            fut = d.accept({"kind": "cpu", "argv": ["/bin/true"], "timeout_s": 3600})
            fut.add_done_callback(lambda _: done_at.append(time.perf_counter()))
        d.flush()
        t0 = time.perf_counter()  # all queued (none starts before this loop turn ends)
        await asyncio.sleep(max(0.0, t0 + start_s + window_s - time.perf_counter()))
        queued = d.state.n_pending
        await d.close(drain=False)  # what is left is killed, not waited for
    lo, hi = t0 + start_s, t0 + start_s + window_s
    return sum(lo <= t < hi for t in done_at) / window_s, queued


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100_000, help="actions queued at once")
    ap.add_argument("--max-wait", type=float, default=5.0, help="the guard's max_wait_s")
    ap.add_argument("--window", type=float, default=10.0, help="seconds measured")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--scheduler", default="elastic_greedy")
    ap.add_argument("--journal", action="store_true", help="with a journal (off: none)")
    args = ap.parse_args()
    start = args.max_wait + 1.0  # the window opens once the queue is past the limit
    runs = {f"max_wait_s={args.max_wait:g}": args.max_wait, "max_wait_s=null": None}
    rates: dict[str, list[float]] = {name: [] for name in runs}
    print(f"{args.n} x /bin/true queued at once on {len(os.sched_getaffinity(0))} cores, "
          f"{args.scheduler}, journal {'on' if args.journal else 'off'}; completions per "
          f"second in [{start:g}, {start + args.window:g}) s after queueing")
    for r in range(args.rounds):
        for name, wait in runs.items():
            with tempfile.TemporaryDirectory() as tmp:
                journal = os.path.join(tmp, "journal.db") if args.journal else None
                rate, queued = asyncio.run(_rate(args.n, wait, start, args.window,
                                                 args.scheduler, journal))
            rates[name].append(rate)
            print(f"  round {r + 1}: {name:>16}: {rate:8.1f} actions/s "
                  f"({queued} still queued at the end)", flush=True)
        guarded, free = (rates[k][-1] for k in runs)
        print(f"  round {r + 1}: ratio guarded / unguarded {guarded / free:.3f}")
    ratios = [g / f for g, f in zip(*rates.values(), strict=True)]
    for name, xs in rates.items():
        print(f"{name:>16}: median {statistics.median(xs):.1f} actions/s")
    print(f"ratio guarded / unguarded: median {statistics.median(ratios):.3f} "
          f"(rounds: {', '.join(f'{x:.3f}' for x in ratios)})")


if __name__ == "__main__":
    main()
