"""The sharded control plane's throughput on this machine: 1 shard and 2 shards side by
side, on stand-in nodes (commands end at once: nothing runs, every other cost is paid).

Starts a local Ray (bound to 127.0.0.1), then two sets of shards, one of 1 and one of
2 (each shard a dispatcher actor with its journal, ``elastic_greedy``, one stand-in
node of ``--cores`` cores), and, R rounds (the order rotated per round), submits N
no-op cpu actions over ``--trajectories`` trajectories through a router to each set, all
at once, and times them until every result is back. Printed per round: actions/s of
each set, the ratio (2 shards / 1 shard: the acceptance figure, >= 1.7), the load
average, and the CPU each shard and this process (the router, standing in for the
clients) spent per action.

    python benchmarks/shard_throughput.py [--n 10000] [--rounds 3] [--cpus 2]
        [--trajectories 256] [--cores 64] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


async def _round(router, n: int, trajectories: int, tag: str) -> dict:
    """Submit ``n`` no-op actions through ``router``; actions/s and CPU per action."""
    reqs = [{"kind": "cpu", "argv": ["true"], "trajectory": f"t{i % trajectories}",
             "id": f"{tag}-{i}", "timeout_s": 60.0} for i in range(n)]
    before = await router.astats()
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    results = await asyncio.gather(*(router.accept(r) for r in reqs))
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    after = await router.astats()
    bad = sum(r.status != "done" for r in results)
    shard_ms = {s: (after[s]["cpu_s"] - before[s]["cpu_s"]) * 1e3 / n for s in after}
    return {"rate": n / wall, "wall_s": wall, "not_done": bad,
            "router_cpu_ms_per_action": cpu * 1e3 / n, "shard_cpu_ms_per_action": shard_ms,
            "load": os.getloadavg()[0]}


def measure(n: int, rounds: int, cpus: int, trajectories: int, cores: int) -> dict:
    import ray

    from metasched.runtime.dispatch import DispatcherConfig
    from metasched.runtime.shards import start_shards, stop_shards

    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
             num_cpus=cpus, namespace="metasched", log_to_driver=False,
             logging_level="ERROR")
    cfg = DispatcherConfig(scheduler="elastic_greedy")
    out: dict = {"n": n, "rounds": [], "trajectories": trajectories}
    with tempfile.TemporaryDirectory() as tmp:
        standin = {"nodes": 1, "cores": cores}
        sets = {1: start_shards(1, cfg, journal_dir=tmp, standin=standin, prefix="one"),
                2: start_shards(2, cfg, journal_dir=tmp, standin=standin, prefix="two")}
        try:
            async def run() -> None:
                for k in sets:  # warm: the handles, the streams, the first decisions
                    await _round(sets[k], 500, trajectories, f"warm{k}")
                for r in range(rounds):
                    order = [1, 2] if r % 2 == 0 else [2, 1]
                    row = {}
                    for k in order:
                        row[k] = await _round(sets[k], n, trajectories, f"r{r}s{k}")
                    row["ratio"] = row[2]["rate"] / row[1]["rate"]
                    out["rounds"].append(row)
                    print(f"round {r + 1}: 1 shard {row[1]['rate']:,.0f}/s (load "
                          f"{row[1]['load']:.1f}), 2 shards {row[2]['rate']:,.0f}/s (load "
                          f"{row[2]['load']:.1f}): x{row['ratio']:.2f}; CPU ms/action: "
                          f"1 shard {_fmt(row[1])}; 2 shards {_fmt(row[2])}", flush=True)
                for router in sets.values():
                    await router.aclose()

            asyncio.run(run())
        finally:
            for router in sets.values():
                stop_shards(router.names, drain=False, leases=False)
            ray.shutdown()
    ratios = [row["ratio"] for row in out["rounds"]]
    out["median_ratio"] = statistics.median(ratios)
    out["median_rate"] = {k: statistics.median(row[k]["rate"] for row in out["rounds"])
                          for k in (1, 2)}
    return out


def _fmt(r: dict) -> str:
    shards = ", ".join(f"{v:.3f}" for v in r["shard_cpu_ms_per_action"].values())
    return f"shards {shards}, router {r['router_cpu_ms_per_action']:.3f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=10_000, help="actions per set per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cpus", type=int, default=2, help="CPUs the local Ray counts")
    p.add_argument("--trajectories", type=int, default=256)
    p.add_argument("--cores", type=int, default=64, help="cores of each stand-in node")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    args = p.parse_args()
    if min(args.n, args.rounds, args.cpus, args.trajectories, args.cores) < 1:
        p.error("--n, --rounds, --cpus, --trajectories, --cores: must be >= 1")
    print(f"started {time.strftime('%H:%M:%S')} load {os.getloadavg()}", flush=True)
    r = measure(args.n, args.rounds, args.cpus, args.trajectories, args.cores)
    print(f"median 2 shards / 1 shard: x{r['median_ratio']:.2f} over {args.rounds} rounds of "
          f"{args.n:,} (1 shard {r['median_rate'][1]:,.0f}/s, 2 shards "
          f"{r['median_rate'][2]:,.0f}/s)")
    if args.json:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
