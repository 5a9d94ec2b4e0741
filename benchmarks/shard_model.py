"""A model of the sharded control plane at a rate this machine cannot reach: how many
shards, how loaded the lease service, and the p99 dispatch overhead, at ``--rate``
actions/s and ``--sandboxes`` concurrent sandboxes, from per-action costs measured here.

The inputs (each printed with where it came from):

- a shard's CPU per action (``--shard-ms``): measured by ``shard_throughput.py`` on
  stand-in nodes (no node link), or the dispatcher actor's on real nodes
  (``ray_throughput.py --submit stream``); the model is run for each given value;
- the lease service's CPU per call (``--lease-ms``): measured here with ``--measure``
  (acquire and release round trips through its actor, as a shard makes them), and
  the book's own cost per lease in process;
- a shard's memory per open trajectory (``--traj-kb``): measured here with
  ``--measure`` (a dispatcher on stand-in nodes holding 10,000 open trajectories);
- the share of actions that are API calls on a shared quota (``--api-share``) and the
  results stream's yield interval (``--yield-ms``, the dispatcher actor's
  ``YIELD_INTERVAL_S``): settings, not measurements.

The model: each shard's event loop is one server (it does an action's work in turns
of its loop, one at a time); actions arrive at ``rate / N`` per shard. With service
time ``c`` and utilisation ``rho = rate c / N``, the M/M/1 sojourn's p99 is
``ln(100) c / (1 - rho)`` (exponential service: above the deterministic case, so a
bound for a loop whose work per action varies little). Dispatch overhead = that sojourn
(admission, journal, decision, grant, completion) + the wait for the results stream's
next yield (at most its interval, p99 ~ the interval). Shards: the fewest with
``rho <= --max-util`` whose p99 is within ``--p99-ms``. The lease service is one more
server: 2 calls per API action (acquire, release) at ``n`` leases per acquire (the
client can take a block of leases at once) plus each shard's renewals (3 per TTL).

    python benchmarks/shard_model.py [--measure] [--rate 10000] [--sandboxes 100000]
        [--shard-ms 0.165,0.46] [--lease-ms X] [--api-share 0.25] [--yield-ms 5]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import math
import os
import time
import tracemalloc

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def measure_book(leases: int = 50_000) -> float:
    """The lease book's own CPU per lease (µs): acquire and release, in process, with
    a window holding ``leases`` leases."""
    from metasched.runtime.leases import LeaseBook, PoolLimit

    book = LeaseBook({"api": PoolLimit(calls=leases, window_s=3600.0)}, ttl_s=30.0)
    t0 = time.process_time()
    for _ in range(leases):
        (lease,) = book.acquire("s", "api").leases
        book.release([lease.id])
    return (time.process_time() - t0) * 1e6 / leases


def measure_service(calls: int = 2000) -> float:
    """The lease service actor's CPU per call (ms): acquire and release round trips
    through a :class:`LeaseClient`, as a shard makes them, on a local Ray."""
    import ray

    from metasched.runtime.leases import PoolLimit
    from metasched.runtime.leases.service import LeaseClient, start_lease_service

    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
             num_cpus=2, namespace="metasched", log_to_driver=False, logging_level="ERROR")
    try:
        actor = start_lease_service({"api": PoolLimit(calls=10 * calls, window_s=3600.0)},
                                    name="model-leases")
        client = LeaseClient(actor, "model")

        def cpu() -> float:
            return ray.get(actor.ping.remote())["cpu_s"]

        async def run() -> None:
            async def one() -> None:
                for _ in range(calls // 8):
                    client.release(await client.acquire("api"))
            await asyncio.gather(*(one() for _ in range(8)))
            await client.close()

        c0 = cpu()
        asyncio.run(run())
        n = ray.get(actor.load.remote())["calls"]
        return (cpu() - c0) * 1e3 / n
    finally:
        ray.shutdown()


def measure_trajectory_kb(n: int = 10_000) -> float:
    """A dispatcher's memory per open trajectory (KB): one action each on stand-in
    nodes, the trajectories left open (their sandboxes' records held)."""
    from metasched.runtime.dispatch import Dispatcher, DispatcherConfig
    from metasched.runtime.shards.standin import StandinBackend

    async def run() -> float:
        d = Dispatcher(DispatcherConfig(scheduler="elastic_greedy"),
                       backend=StandinBackend("model", cores=64))
        await d.start()
        await asyncio.gather(*(d.submit({"kind": "cpu", "argv": ["true"], "max_cores": 1,
                                         "trajectory": f"warm{i}"}) for i in range(200)))
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        await asyncio.gather(*(d.submit({"kind": "cpu", "argv": ["true"], "max_cores": 1,
                                         "trajectory": f"t{i}"}) for i in range(n)))
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        # What finished actions leave (bounded: metrics_window) is not the trajectory's.
        await d.close(drain=False)
        return (after - before) / n / 1024

    return asyncio.run(run())


def shards_needed(rate: float, c_ms: float, p99_ms: float, yield_ms: float,
                  max_util: float) -> tuple[int, float, float]:
    """The fewest shards meeting the targets; their utilisation and p99 (ms)."""
    c = c_ms / 1e3
    n = max(1, math.ceil(rate * c / max_util))
    while True:
        rho = rate * c / n
        p99 = math.log(100) * c_ms / (1 - rho) + yield_ms
        if rho <= max_util and p99 <= p99_ms:
            return n, rho, p99
        n += 1
        if n > 100_000:
            raise ValueError("no shard count meets the targets")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--measure", action="store_true",
                   help="measure the lease costs and a trajectory's memory here first")
    p.add_argument("--rate", type=float, default=10_000.0, help="actions/s")
    p.add_argument("--sandboxes", type=int, default=100_000, help="concurrent sandboxes")
    p.add_argument("--shard-ms", default="0.165,0.46",
                   help="a shard's CPU ms per action (comma-separated: one model each)")
    p.add_argument("--lease-ms", type=float, default=None,
                   help="the lease service's CPU ms per call (default: measured, or 0.9)")
    p.add_argument("--traj-kb", type=float, default=None,
                   help="a shard's KB per open trajectory (default: measured, or 5)")
    p.add_argument("--api-share", type=float, default=0.25)
    p.add_argument("--lease-block", default="1,16", help="leases per acquire call")
    p.add_argument("--yield-ms", type=float, default=5.0)
    p.add_argument("--p99-ms", type=float, default=10.0)
    p.add_argument("--max-util", type=float, default=0.7)
    p.add_argument("--ttl-s", type=float, default=5.0)
    args = p.parse_args()
    lease_ms, traj_kb, source = args.lease_ms, args.traj_kb, "given"
    print(f"started {time.strftime('%H:%M:%S')} load {os.getloadavg()}", flush=True)
    if args.measure:
        book_us = measure_book()
        print(f"lease book, in process: {book_us:.1f} µs CPU per lease (acquire + release, "
              f"50,000 leases in one window)")
        if traj_kb is None:
            traj_kb = measure_trajectory_kb()
            print(f"a dispatcher's memory per open trajectory: {traj_kb:.2f} KB "
                  f"(10,000 open, stand-in nodes)")
        if lease_ms is None:
            lease_ms = measure_service()
            print(f"lease service actor: {lease_ms:.3f} ms CPU per call (acquire or "
                  f"release through LeaseClient, 8 callers; load {os.getloadavg()[0]:.1f})")
        source = "measured here"
    lease_ms = 0.9 if lease_ms is None else lease_ms
    traj_kb = 5.0 if traj_kb is None else traj_kb
    print(f"\nat {args.rate:,.0f} actions/s, {args.sandboxes:,} concurrent sandboxes; "
          f"targets: p99 dispatch overhead <= {args.p99_ms:g} ms, loop utilisation <= "
          f"{args.max_util:g}; results yield every {args.yield_ms:g} ms")
    print("| shard CPU ms/action | shards | loop utilisation | p99 dispatch overhead ms | "
          "open trajectories per shard | their memory per shard MB |")
    print("|---|---|---|---|---|---|")
    for c in (float(x) for x in args.shard_ms.split(",")):
        n, rho, p99 = shards_needed(args.rate, c, args.p99_ms, args.yield_ms, args.max_util)
        per = args.sandboxes / n
        print(f"| {c:g} | {n} | {rho:.2f} | {p99:.2f} | {per:,.0f} | "
              f"{per * traj_kb / 1024:,.0f} |")
    print(f"\nresults yield every {args.yield_ms:g} ms (start_shards(yield_s=...); the "
          f"shipped default is 20 ms): about {0.4 * 1e3 / args.yield_ms / 1e3:.0%} of a "
          f"shard's core per busy client stream (0.4 ms per yield, docs/benchmarks/ray.md)")
    api = args.rate * args.api_share
    print(f"\nlease service ({source}: {lease_ms:.3f} ms CPU per call, one actor, "
          f"{args.api_share:.0%} of actions on shared quotas = {api:,.0f} leases/s):")
    print("| leases per acquire | calls/s | service utilisation | p99 wait ms |")
    print("|---|---|---|---|")
    for b in (int(x) for x in args.lease_block.split(",")):
        n_shards = shards_needed(args.rate, float(args.shard_ms.split(",")[-1]),
                                 args.p99_ms, args.yield_ms, args.max_util)[0]
        calls = 2 * api / b + n_shards * 3 / args.ttl_s
        rho = calls * lease_ms / 1e3
        wait = "over 1: saturated" if rho >= 1 else \
            f"{math.log(100) * lease_ms / (1 - rho):.2f}"
        print(f"| {b} | {calls:,.0f} | {rho:.2f} | {wait} |")


if __name__ == "__main__":
    main()
