"""A dispatcher shard killed (SIGKILL) under load: is anything lost, and how soon are its
trajectories served again?

Starts a local Ray (127.0.0.1) and ``--shards`` shards with journals, on stand-in nodes
of ``--cores`` cores whose commands take ``--run-s`` each (so actions are queued and
running when the shard dies). ``--trajectories`` trajectories each submit one cpu
action after another (the next when the last is answered) for ``--seconds``; at
``--kill-at`` seconds the first shard's process is killed. Its adopter opens its
journal; the router sends it what the dead shard had not answered.

Printed (and with ``--json``, one JSON object): actions submitted and answered (lost
= submitted - answered, must be 0), answered not ``done``, actions that ran more than
once (``attempts > 1``: those running at the kill, the documented at-least-once), and
for the dead shard's trajectories the time from the kill to each one's next answer
(max: the acceptance figure, <= 5 s).

    python benchmarks/shard_faults.py [--shards 2] [--trajectories 64] [--cores 32]
        [--run-s 0.2] [--seconds 12] [--kill-at 4] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import tempfile
import time
from collections import Counter

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def measure(shards: int, trajectories: int, cores: int, run_s: float, seconds: float,
            kill_at: float, cpus: int = 2) -> dict:
    import ray

    from metasched.runtime.dispatch import DispatcherConfig
    from metasched.runtime.shards import start_shards, stop_shards

    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
             num_cpus=cpus, namespace="metasched", log_to_driver=False,
             logging_level="ERROR")
    cfg = DispatcherConfig(scheduler="elastic_greedy")
    submitted = answered = 0
    statuses: Counter = Counter()
    twice = 0
    after_kill: dict[str, float] = {}  # dead shard's trajectory -> first answer after
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        router = start_shards(shards, cfg, journal_dir=tmp,
                              standin={"nodes": 1, "cores": cores, "seconds": run_s})
        victim = router.names[0]
        killed: dict[str, float] = {}

        async def trajectory(name: str, until: float) -> None:
            nonlocal submitted, answered, twice
            turn = 0
            while time.monotonic() < until:
                submitted += 1
                r = await router.submit({"kind": "cpu", "argv": ["true"], "trajectory": name,
                                         "turn": turn, "id": f"{name}-{turn}", "max_cores": 1,
                                         "timeout_s": 60.0})
                answered += 1
                statuses[r.status] += 1
                twice += r.attempts > 1
                if killed and name not in after_kill and router.ring.owner(name) == victim:
                    after_kill[name] = time.monotonic() - killed["at"]
                turn += 1

        async def kill(at: float) -> None:
            stats = await router.astats()
            pid = stats[victim]["pid"]
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            os.kill(pid, signal.SIGKILL)
            killed["at"] = time.monotonic()
            out["queued_at_kill"] = sum(d["queued"] + d["running"]
                                        for d in stats[victim]["dispatchers"].values())

        async def run() -> None:
            t0 = time.monotonic()
            names = [f"traj-{i}" for i in range(trajectories)]
            tasks = [asyncio.ensure_future(trajectory(n, t0 + seconds)) for n in names]
            await asyncio.gather(kill(t0 + kill_at), *tasks)
            out["victim_trajectories"] = sum(router.ring.owner(n) == victim for n in names)
            out["adopted_within_s"] = router.served_again_s()
            out["after"] = await router.astats()
            await router.aclose()

        try:
            asyncio.run(run())
        finally:
            stop_shards(router.ring.live, drain=False, leases=False)
            ray.shutdown()
    gaps = sorted(after_kill.values())
    adopter = next(iter(out["after"].values()))
    return {"shards": shards, "trajectories": trajectories, "run_s": run_s,
            "seconds": seconds, "kill_at": kill_at, "submitted": submitted,
            "answered": answered, "lost": submitted - answered, "statuses": dict(statuses),
            "ran_more_than_once": twice,
            "victim_trajectories": out["victim_trajectories"],
            "victim_trajectories_served_again": len(gaps),
            "served_again_s": {"max": gaps[-1] if gaps else None,
                               "median": statistics.median(gaps) if gaps else None},
            "adopted_within_s": out["adopted_within_s"],
            "adopter_dispatchers": sorted(adopter["dispatchers"]),
            "load": os.getloadavg()[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--trajectories", type=int, default=64)
    p.add_argument("--cores", type=int, default=32, help="cores of each stand-in node")
    p.add_argument("--run-s", type=float, default=0.2, help="each command's time")
    p.add_argument("--seconds", type=float, default=12.0)
    p.add_argument("--kill-at", type=float, default=4.0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.shards < 2:
        p.error("--shards: at least 2 (one is killed)")
    if not 0 < args.kill_at < args.seconds:
        p.error("--kill-at: must be within the run")
    print(f"started {time.strftime('%H:%M:%S')} load {os.getloadavg()}", flush=True)
    r = measure(args.shards, args.trajectories, args.cores, args.run_s, args.seconds,
                args.kill_at)
    if args.json:
        print(json.dumps(r))
        return
    print(f"{r['submitted']} actions submitted, {r['answered']} answered (lost {r['lost']}): "
          f"{r['statuses']}; ran more than once: {r['ran_more_than_once']}")
    print(f"  killed shard's trajectories: {r['victim_trajectories']}, served again "
          f"{r['victim_trajectories_served_again']}, the next answer after the kill within "
          f"max {r['served_again_s']['max']:.2f} s (median "
          f"{r['served_again_s']['median']:.2f} s); adopted within {r['adopted_within_s']}")
    print(f"  load {r['load']:.1f}")


if __name__ == "__main__":
    main()
