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
Then the streaming latency: one command in the sandbox prints ``--lines`` lines
``--gap`` seconds apart (``python3 -u``, each line its wall-clock time), and the time
from each line's print to the SDK's ``on_stdout`` callback that brings it (the same
machine's clock on both sides), p50 and p99.

    python benchmarks/e2b_overhead.py [--calls 200] [--warmup 10] [--lines 50] [--gap 0.2]
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
    ap.add_argument("--lines", type=int, default=50, help="lines printed (streaming)")
    ap.add_argument("--gap", type=float, default=0.2, help="seconds between the lines")
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
        lags = stream_lags(sb, args.lines, args.gap)
        sb.kill()
    print(f"{args.calls} sequential no-op calls per path ({args.warmup} warm-up calls "
          f"not counted), milliseconds:")
    print(f"  {'path':<10} {'p50':>8} {'p99':>8} {'mean':>8}")
    for name, xs in times.items():
        print(f"  {name:<10} {percentile(xs, 0.5):8.1f} {percentile(xs, 0.99):8.1f} "
              f"{statistics.fmean(xs):8.1f}")
    print(f"streaming: {len(lags)} lines {args.gap:g} s apart, from print to on_stdout, "
          f"milliseconds: p50 {percentile(lags, 0.5):.1f}, p99 {percentile(lags, 0.99):.1f}, "
          f"max {max(lags):.1f}")


def stream_lags(sb: object, lines: int, gap: float) -> list[float]:
    """Milliseconds from each of ``lines`` prints in ``sb`` to its ``on_stdout``."""
    lags: list[float] = []
    pending = ""

    def on_stdout(text: str) -> None:
        nonlocal pending
        now = time.time()
        pending += text
        *done, pending = pending.split("\n")
        lags.extend((now - float(line)) * 1000 for line in done if line)

    program = (f"import time\nfor _ in range({lines}):\n    print(repr(time.time()))\n"
               f"    time.sleep({gap})")
    r = sb.commands.run(f"python3 -u -c '{program}'", on_stdout=on_stdout,  # type: ignore[attr-defined]
                        timeout=lines * gap + 120)
    assert r.exit_code == 0 and len(lags) == lines, (r, lags)
    return lags


if __name__ == "__main__":
    main()
