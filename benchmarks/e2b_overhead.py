"""Per-command overhead of the E2B path against ``/run_code``, for the same no-op.

One metasched-serve on 127.0.0.1 (in this process, its own thread; ``elastic_greedy``,
the machine's cores, bubblewrap sandboxes where available) and one client issuing one
call at a time, the paths taken in turn so that the machine's load falls on each alike:

- ``e2b``: ``sandbox.commands.run("true")`` through the unmodified ``e2b`` SDK in one
  sandbox (its trajectory's sandbox made once): one action, its watcher (``python3``)
  running ``/bin/bash -l -c true``;
- ``run_code``: ``POST /run_code`` ``{"language": "bash", "code": "true"}`` with an
  ``X-Trajectory-Id`` (the sandbox made once): two actions, the source written, then
  ``bash`` run;
- ``v1``: ``POST /v1/actions?wait=60`` ``{"kind": "cpu", "argv": ["true"]}`` in a
  trajectory: one action, the command alone (the floor both build on).

Prints p50 and p99 (milliseconds, client-side, from the call to its answer) of each.

    python benchmarks/e2b_overhead.py [--calls 200] [--warmup 10]
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

import httpx

from metasched.runtime.dispatch import Dispatcher, DispatcherConfig
from metasched.serve import BackgroundServer, ServeConfig, create_app


def percentile(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (nearest rank)."""
    ys = sorted(xs)
    return ys[min(len(ys) - 1, max(0, round(q * len(ys)) - 1))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=200, help="calls per path")
    ap.add_argument("--warmup", type=int, default=10, help="calls per path not counted")
    args = ap.parse_args()

    import e2b

    config = DispatcherConfig(scheduler="elastic_greedy")
    app = create_app(lambda: Dispatcher(config), ServeConfig(languages=["bash"]))
    with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, timeout=120) as http:
        sb = e2b.Sandbox.create(api_url=f"{srv.url}/e2b", sandbox_url=f"{srv.url}/e2b",
                                api_key="unused", timeout=3600)
        traj = f"bench-{uuid.uuid4().hex}"

        def via_e2b() -> None:
            assert sb.commands.run("true").exit_code == 0

        def via_run_code() -> None:
            r = http.post("/run_code", json={"language": "bash", "code": "true"},
                          headers={"X-Trajectory-Id": traj})
            assert r.status_code == 200 and r.json()["status"] == "Success", r.text

        def via_v1() -> None:
            r = http.post("/v1/actions", params={"wait": 60}, json={
                "kind": "cpu", "argv": ["true"], "trajectory": traj + "-v1"})
            assert r.status_code == 200 and r.json()["status"] == "done", r.text

        paths = {"e2b": via_e2b, "run_code": via_run_code, "v1": via_v1}
        times: dict[str, list[float]] = {name: [] for name in paths}
        for i in range(args.warmup + args.calls):
            for name, call in paths.items():
                t0 = time.perf_counter()
                call()
                if i >= args.warmup:
                    times[name].append((time.perf_counter() - t0) * 1000)
        sb.kill()
    print(f"{args.calls} sequential no-op calls per path ({args.warmup} warm-up calls "
          f"not counted), milliseconds:")
    print(f"  {'path':<10} {'p50':>8} {'p99':>8} {'mean':>8}")
    for name, xs in times.items():
        print(f"  {name:<10} {percentile(xs, 0.5):8.1f} {percentile(xs, 0.99):8.1f} "
              f"{statistics.fmean(xs):8.1f}")


if __name__ == "__main__":
    main()
