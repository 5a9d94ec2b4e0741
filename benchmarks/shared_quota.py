"""One API quota shared by dispatcher shards through the lease service: is it ever
exceeded, and how much of it is used?

A counting upstream on 127.0.0.1 (``metasched.serve.rate_limited``) answers 429 past
``--rpm`` x ``--window-s`` / 60 requests in any ``--window-s`` seconds and records when
each request arrived. ``--shards`` shards (stand-in nodes; the API calls are real HTTP
from each shard's dispatcher) share the endpoint's quota as leases; ``--clients`` async
callers per shard (each its own trajectory, placed on that shard) submit one call after
another for ``--seconds``. With ``--kill-leases-at S``, the lease service's process is
killed (SIGKILL) S seconds in; the time until it answers again is measured from here.

Printed (and with ``--json``, one JSON object): the most requests the upstream counted
in any window (must be <= the quota), its 429s, the calls answered, the quota used
(answered / the most a sliding window admits over the run: the quota x the windows the
run starts, ``ceil(seconds / window)``; the acceptance figure, >= 95%), and the lease
service's restart time.

    python benchmarks/shared_quota.py [--rpm 60] [--window-s 60] [--shards 2]
        [--clients 4] [--seconds 170] [--kill-leases-at S] [--lease-block 1] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import tempfile
import threading
import time
from collections import Counter

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def _watch_restart(kill_at: float, out: dict) -> None:
    """At ``kill_at`` (monotonic), SIGKILL the lease service; then time until it answers
    a ping from a new process."""
    import ray

    from metasched.runtime.leases.service import LEASE_SERVICE, NAMESPACE

    actor = ray.get_actor(LEASE_SERVICE, namespace=NAMESPACE)
    pid = ray.get(actor.ping.remote())["pid"]
    time.sleep(max(0.0, kill_at - time.monotonic()))
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    while True:
        try:
            info = ray.get(actor.ping.remote(), timeout=1.0)
            if info["pid"] != pid:
                out.update(back_within_s=time.monotonic() - t0, restored=info["restored"])
                return
        except Exception:  # noqa: BLE001 - dead or restarting: ask again
            pass
        time.sleep(0.05)


def measure(rpm: float, window_s: float, shards: int, clients: int, seconds: float,
            kill_leases_at: float | None = None, cpus: int = 2, lease_block: int = 1) -> dict:
    import ray

    from metasched.core.pools import EndpointSpec
    from metasched.runtime.api_spec import HttpSpec
    from metasched.runtime.dispatch import DispatcherConfig
    from metasched.runtime.leases import PoolLimit
    from metasched.runtime.shards import start_shards, stop_shards
    from metasched.serve.rate_limited import RateLimitedServer, max_in_window

    quota = rpm * window_s / 60.0
    callers = shards * clients
    spec = EndpointSpec(rpm=rpm, max_concurrency=callers, window_s=window_s)
    cfg = DispatcherConfig(scheduler="elastic_greedy", endpoints={"search": spec})
    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
             num_cpus=cpus, namespace="metasched", log_to_driver=False,
             logging_level="ERROR")
    restart: dict = {}
    statuses: Counter = Counter()
    per_shard: Counter = Counter()
    with tempfile.TemporaryDirectory() as tmp, \
            RateLimitedServer(quota, window_s=window_s) as upstream:
        router = start_shards(shards, cfg, journal_dir=tmp, standin={"nodes": 1, "cores": 4},
                              pools={"search": PoolLimit.endpoint(spec)},
                              lease_file=f"{tmp}/leases.jsonl", lease_block=lease_block)
        # ``clients`` trajectories placed on each shard.
        names: dict[str, list[str]] = {s: [] for s in router.names}
        i = 0
        while min(len(v) for v in names.values()) < clients:
            key = f"caller-{i}"
            shard = router.ring.hashed(key)
            if len(names[shard]) < clients:
                names[shard].append(key)
            i += 1
        http = HttpSpec(upstream.url + "/search", json={"q": 1})

        async def caller(trajectory: str, shard: str, until: float) -> None:
            n = 0
            while time.monotonic() < until:
                r = await router.submit({"kind": "api", "endpoint": "search", "http": http,
                                         "trajectory": trajectory, "turn": n,
                                         "id": f"{trajectory}-{n}", "timeout_s": 600.0})
                statuses[r.status if r.status == "done" else f"{r.status}: {r.reason}"] += 1
                per_shard[shard] += r.status == "done"
                n += 1

        async def run() -> float:
            t0 = time.monotonic()
            until = t0 + seconds
            watcher = None
            if kill_leases_at is not None:
                watcher = threading.Thread(target=_watch_restart,
                                           args=(t0 + kill_leases_at, restart), daemon=True)
                watcher.start()
            # A call that waits for its lease past the end is not counted as used.
            tasks = [asyncio.ensure_future(caller(t, s, until))
                     for s, ts in names.items() for t in ts]
            await asyncio.wait(tasks, timeout=seconds)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if watcher is not None:
                watcher.join(30)
            await router.aclose()
            return t0

        try:
            asyncio.run(run())
        finally:
            stop_shards(router.names, drain=False)
            ray.shutdown()
        arrivals = list(upstream.arrivals)
        ok = sum(1 for s in upstream.answered if s == 200)
        rejected = upstream.rejected
    windows = math.ceil(seconds / window_s)
    return {"rpm": rpm, "window_s": window_s, "quota": quota, "shards": shards,
            "clients_per_shard": clients, "seconds": seconds, "lease_block": lease_block,
            "upstream_requests": len(arrivals), "upstream_ok": ok,
            "busiest_window": max_in_window(arrivals, window_s), "upstream_429": rejected,
            "answered": dict(statuses), "done_per_shard": dict(per_shard),
            "quota_used": ok / (quota * windows), "windows": windows,
            "lease_service_restart": restart or None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rpm", type=float, default=60.0)
    p.add_argument("--window-s", type=float, default=60.0)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--clients", type=int, default=4, help="callers per shard")
    p.add_argument("--seconds", type=float, default=170.0)
    p.add_argument("--kill-leases-at", type=float, default=None, metavar="S",
                   help="SIGKILL the lease service S seconds into the run")
    p.add_argument("--lease-block", type=int, default=1,
                   help="leases a shard asks for in one call")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if (not args.rpm > 0 or not args.window_s > 0 or args.shards < 1 or args.clients < 1
            or not args.seconds > 0 or args.lease_block < 1):
        p.error("--rpm, --window-s, --shards, --clients, --seconds, --lease-block: must be "
                "> 0")
    if args.rpm * args.window_s / 60.0 < 1:
        p.error("--rpm, --window-s: the quota (rpm x window / 60) must be >= 1 request")
    print(f"started {time.strftime('%H:%M:%S')} load {os.getloadavg()}", flush=True)
    r = measure(args.rpm, args.window_s, args.shards, args.clients, args.seconds,
                args.kill_leases_at, lease_block=args.lease_block)
    if args.json:
        print(json.dumps(r))
        return
    print(f"{r['shards']} shards x {r['clients_per_shard']} callers for {r['seconds']:g} s, "
          f"a {r['quota']:g}-request quota per {r['window_s']:g} s:")
    print(f"  busiest window at the upstream: {r['busiest_window']} requests "
          f"({r['upstream_requests']} in all), 429s: {r['upstream_429']}")
    print(f"  answered: {r['answered']} (per shard {r['done_per_shard']}); quota used "
          f"{r['quota_used']:.1%} of {r['quota'] * r['windows']:g} over {r['windows']} windows")
    if r["lease_service_restart"]:
        print(f"  lease service killed at {args.kill_leases_at:g} s: back within "
              f"{r['lease_service_restart']['back_within_s']:.2f} s, "
              f"{r['lease_service_restart']['restored']} leases read back")
    print(f"  load {os.getloadavg()}")


if __name__ == "__main__":
    main()
