"""The quota proxy under many worker processes: does a shared upstream quota hold?

A counting upstream on 127.0.0.1 (``metasched.serve.rate_limited``) answers 429 past
its quota, ``--rpm`` × ``--window-s`` / 60 requests in any ``--window-s`` seconds (60
requests in any 60 s by default). ``--processes`` worker processes, each with
``--threads`` callers, post to ``/v1/endpoints/search/...`` of one ``metasched-serve``
application as fast as answers come, for ``--seconds``. Printed (and with ``--json``,
one JSON object): the most requests the upstream counted in any window, the 429s it
sent, what the workers got back (status counts), and the requests answered per minute
of the run, and how soon the upstream had its first quota of requests (a quota counted
over a sliding window admits them at once: the proxy should not spread them over the
window).

    python benchmarks/quota_proxy.py [--rpm 60] [--window-s 60] [--processes 4]
        [--threads 4] [--seconds 62] [--json]

``tests/test_serve_proxy.py`` runs it with the defaults as the acceptance check (slow),
and at 600 RPM over a 6 s window for 7 s in the default run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from collections import Counter


def worker(url: str, threads: int) -> None:
    """One worker process: says ``ready`` once imported, reads the end of the run (wall
    clock) from stdin, then ``threads`` callers post until it; prints the statuses it
    got, as a JSON list."""
    import httpx

    print("ready", flush=True)
    until = float(sys.stdin.readline())
    statuses: list[int] = []

    def loop(i: int) -> None:
        with httpx.Client(timeout=None) as c:
            n = 0
            while time.time() < until:
                try:
                    r = c.post(f"{url}/v1/endpoints/search/query?w={i}&n={n}", json={"q": n},
                               timeout=max(0.1, until - time.time()))
                except httpx.TimeoutException:
                    break  # the run is over while this call waited its turn
                statuses.append(r.status_code)
                n += 1

    callers = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    print(json.dumps(statuses))


def measure(rpm: float, processes: int, threads: int, seconds: float,
            window_s: float = 60.0) -> dict:
    """Run the scenario (see the module docstring) and return its figures."""
    from metasched.runtime.dispatch import Dispatcher, DispatcherConfig
    from metasched.serve import BackgroundServer, ServeConfig, create_app
    from metasched.serve.config import parse_upstreams
    from metasched.serve.rate_limited import RateLimitedServer, max_in_window

    quota = rpm * window_s / 60.0
    with RateLimitedServer(quota, window_s=window_s) as upstream:
        endpoints, upstreams = parse_upstreams({"search": {
            "rpm": rpm, "window_s": window_s, "max_concurrency": processes,
            "url": upstream.url}})
        dcfg = DispatcherConfig(scheduler="elastic_greedy", endpoints=endpoints)
        app = create_app(lambda: Dispatcher(dcfg), ServeConfig(upstreams=upstreams,
                                                               languages=[]))
        with BackgroundServer(app) as srv:
            procs = [subprocess.Popen([sys.executable, __file__, "--worker", srv.url,
                                       str(threads)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
                     for _ in range(processes)]
            # The run starts once every worker is up (starting Python on a loaded
            # machine takes seconds, which would otherwise come off the run).
            for proc in procs:
                assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
            until = time.time() + seconds
            outs = [json.loads(proc.communicate(f"{until}\n", timeout=seconds + 120)[0])
                    for proc in procs]
        arrivals = list(upstream.arrivals)
        rejected = upstream.rejected
    statuses = Counter(str(s) for out in outs for s in out)
    ts = sorted(arrivals)
    first = ts[int(quota) - 1] - ts[0] if len(ts) >= quota else None
    return {"rpm": rpm, "window_s": window_s, "quota": quota, "processes": processes,
            "callers": processes * threads, "seconds": seconds,
            "upstream_requests": len(arrivals),
            "busiest_window": max_in_window(arrivals, window_s), "upstream_429": rejected,
            "first_quota_within_s": first,
            "worker_statuses": dict(statuses),
            "answered_per_minute": statuses.get("200", 0) * 60.0 / seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rpm", type=float, default=60.0)
    p.add_argument("--window-s", type=float, default=60.0,
                   help="the sliding window the quota is counted over (seconds)")
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--threads", type=int, default=4, help="callers per process")
    p.add_argument("--seconds", type=float, default=62.0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--worker", nargs=2, metavar=("URL", "THREADS"),
                   help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker[0], int(args.worker[1]))
        return
    if (not args.rpm > 0 or not args.window_s > 0 or args.processes < 1 or args.threads < 1
            or not args.seconds > 0):
        p.error("--rpm, --window-s, --processes, --threads, --seconds: must be > 0")
    if args.rpm * args.window_s / 60.0 < 1:
        p.error("--rpm, --window-s: the quota (rpm x window / 60) must be >= 1 request")
    r = measure(args.rpm, args.processes, args.threads, args.seconds, args.window_s)
    if args.json:
        print(json.dumps(r))
        return
    print(f"{r['callers']} callers in {r['processes']} processes for {r['seconds']:g} s "
          f"against a {r['rpm']:g} RPM upstream:")
    print(f"  busiest {r['window_s']:g} s window at the upstream: {r['busiest_window']} requests "
          f"({r['upstream_requests']} in all), 429s sent: {r['upstream_429']}")
    first = r["first_quota_within_s"]
    print(f"  the first {r['quota']:g} requests reached it within "
          + ("(fewer were sent)" if first is None else f"{first:.2f} s"))
    print(f"  workers got: {r['worker_statuses']}, "
          f"{r['answered_per_minute']:.1f} answered per minute")


if __name__ == "__main__":
    main()
