"""Throughput of the dispatcher actor on no-op actions, side by side with raw Ray tasks.

Starts a local Ray (bound to 127.0.0.1; or joins ``--address``), then alternates, R
rounds:

- raw: N ``run_command`` tasks (the task a granted command becomes: ``/bin/true``
  through the CPU executor, pinned to one core), each with ``num_cpus=1`` and
  node affinity, submitted by this process all at once and awaited on its event loop;
- raw, k in flight: the same tasks, at most k (the cores the dispatcher grants) running
  or queued in Ray at a time, the next submitted when one ends: how a dispatcher that
  holds cores must submit (it starts an action only on a free core);
- actor: the same N actions submitted through a handle to the dispatcher actor (journal
  on, as in production), which queues them, schedules them (elastic_greedy) and runs
  each as that same task.

Prints each rate, the ratio per round (actor ÷ raw, the acceptance figure: >= 0.8) and
its median, and where the CPU went: the dispatcher actor's CPU seconds per action, and
so the ceiling of one dispatcher actor on one core (actions/s it could schedule were
the tasks free), and the rate of empty Ray tasks (no command) here, Ray's own floor.

    python benchmarks/ray_throughput.py [--n 2000] [--rounds 3] [--cpus 2] [--address auto]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pickle
import statistics
import tempfile
import time


def _local_ray(cpus: int) -> None:
    # Ray resolves 127.0.0.1 to the machine's outward address (and binds every server to
    # all interfaces) unless clusters are off; with them off it binds to 127.0.0.1 only.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=cpus,
             namespace="metasched", log_to_driver=False, logging_level="ERROR")


async def _raw(n: int, body: str, in_flight: int | None = None) -> float:
    """Actions per second of ``n`` tasks submitted as the dispatcher's backend submits
    them (``body``: "command", the executor on /bin/true; "empty", a task that returns),
    all at once, or at most ``in_flight`` at a time (the next when one ends)."""
    import ray

    from metasched.runtime.backend import CommandSpec
    from metasched.runtime.ray_backend.cluster import cluster_view
    from metasched.runtime.ray_backend.node_tasks import pack, run_command

    (node,) = (await cluster_view())[:1]
    strategy = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(node.name, False)
    if body == "command":
        fn = run_command.options(num_cpus=1, scheduling_strategy=strategy)
        spec = CommandSpec(("/bin/true",), 60.0)
        cores = node.cores
        t0 = time.perf_counter()
        if in_flight is None:
            refs = [fn.remote(pack(spec, [cores[i % len(cores)]], None)) for i in range(n)]
            outs = [pickle.loads(o) for o in await asyncio.gather(*refs)]
        else:
            slots = asyncio.Semaphore(in_flight)

            async def one(i: int):
                async with slots:
                    return pickle.loads(await fn.remote(pack(spec, [cores[i % len(cores)]],
                                                             None)))
            outs = await asyncio.gather(*(one(i) for i in range(n)))
        rate = n / (time.perf_counter() - t0)
        bad = [o for o in outs if not o.ok]
        if bad:
            raise SystemExit(f"{len(bad)} raw tasks failed, e.g. {bad[0].reason}")
        return rate
    fn = _empty.options(num_cpus=1, scheduling_strategy=strategy)
    t0 = time.perf_counter()
    await asyncio.gather(*(fn.remote() for _ in range(n)))
    return n / (time.perf_counter() - t0)


def _empty_task():
    return None


_empty = None


async def _through_actor(handle, n: int) -> float:
    t0 = time.perf_counter()
    futs = [handle.accept({"kind": "cpu", "argv": ["/bin/true"], "timeout_s": 60})
            for _ in range(n)]
    results = await asyncio.gather(*futs)
    rate = n / (time.perf_counter() - t0)
    bad = [r for r in results if not r.ok]
    if bad:
        raise SystemExit(f"{len(bad)} actions failed, e.g. {bad[0].reason}")
    return rate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=2000, help="actions per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray")
    p.add_argument("--address", default=None, help="join this cluster instead ('auto')")
    p.add_argument("--scheduler", default="elastic_greedy")
    args = p.parse_args()
    if args.n < 1 or args.rounds < 1:
        raise SystemExit("error: n, rounds: must be >= 1")

    if args.address is None:
        _local_ray(args.cpus)
    import psutil
    import ray

    from metasched.runtime.dispatcher import DispatcherConfig
    from metasched.runtime.ray_backend import start_dispatcher, stop_dispatcher

    if args.address is not None:
        ray.init(address=args.address, namespace="metasched", log_to_driver=False)
    global _empty
    _empty = ray.remote(max_retries=0)(_empty_task)

    name = f"bench-{os.getpid()}"
    with tempfile.TemporaryDirectory() as tmp:
        cfg = DispatcherConfig(scheduler=args.scheduler, journal=os.path.join(tmp, "j.db"),
                               sample_interval_s=1.0)
        handle = start_dispatcher(cfg, name=name)
        stats = handle.stats()
        actor_proc = psutil.Process(stats["actor_pid"])  # on this machine
        cores = stats["nodes"] * stats["cores_per_node"]  # what the dispatcher may grant

        async def rounds() -> None:
            # Warm both paths (workers started, leases held, imports done).
            await _raw(min(args.n, 200), "command")
            await _through_actor(handle, min(args.n, 200))
            empty = await _raw(args.n, "empty")
            print(f"empty Ray tasks (no command): {empty:,.0f}/s")
            print(f"| round | raw Ray tasks /s | raw, {cores} in flight /s | through the "
                  f"actor /s | actor ÷ raw | actor ÷ raw {cores} in flight | actor CPU "
                  f"ms/action |")
            print("|---|---|---|---|---|---|---|")
            ratios, ratios_k, cpu_per = [], [], []
            for r in range(args.rounds):
                raw = await _raw(args.n, "command")
                raw_k = await _raw(args.n, "command", in_flight=cores)
                c0 = sum(actor_proc.cpu_times()[:2])
                actor = await _through_actor(handle, args.n)
                per = (sum(actor_proc.cpu_times()[:2]) - c0) / args.n
                ratios.append(actor / raw)
                ratios_k.append(actor / raw_k)
                cpu_per.append(per)
                print(f"| {r + 1} | {raw:,.0f} | {raw_k:,.0f} | {actor:,.0f} | "
                      f"{actor / raw:.2f} | {actor / raw_k:.2f} | {per * 1e3:.3f} |",
                      flush=True)
            med = statistics.median(cpu_per)
            print(f"\nmedian actor ÷ raw: {statistics.median(ratios):.2f} "
                  f"(min {min(ratios):.2f}, max {max(ratios):.2f}, {args.rounds} rounds of "
                  f"{args.n:,}); actor ÷ raw with {cores} in flight: "
                  f"{statistics.median(ratios_k):.2f} (min {min(ratios_k):.2f}, max "
                  f"{max(ratios_k):.2f})")
            print(f"dispatcher actor: {med * 1e3:.3f} ms CPU per action (median): ceiling "
                  f"of one actor on one core ~{1 / med:,.0f} actions/s")
            await handle.aclose()

        try:
            asyncio.run(rounds())
            stats = handle.stats()
            lat = stats["decision_latency_us"]
            print(f"decision latency µs: p50 {lat.get('p50', 0):.0f}, p99 "
                  f"{lat.get('p99', 0):.0f}; decisions {stats['decisions']:,}")
        finally:
            stop_dispatcher(name)


if __name__ == "__main__":
    main()
