"""E2B's code interpreter and templates with packages, driven by the unmodified
``e2b-code-interpreter`` SDK (only its two URLs and a key set) against one
metasched-serve on 127.0.0.1 (in this process, its own thread; ``elastic_greedy``, the
machine's cores, bubblewrap sandboxes).

- ``overhead``: in one sandbox, ``run_code("1")`` and ``commands.run("true")`` in
  turn, ``--calls`` times each (after ``--warmup``): p50 and p99 of each
  (milliseconds, client-side) and the p50 of their difference, call by call;
- ``concurrent``: ``--sandboxes`` ``AsyncSandbox`` at once, each ``--cells`` cells
  that build on the one before (state across cells), then killed; the wall time, and
  what is left once they are gone (trajectories, sandboxes, kernels: all must be 0);
- ``template``: a template with one small pure-Python package from the registry
  (``--package``): its layer built (then found in the cache), the package imported in
  ``--sandboxes`` sandboxes at once, and the creation time of a second sandbox of it
  against one of a template without packages, ``--rounds`` pairs in turn, the order
  alternating (median).

    python benchmarks/e2b_interpreter.py overhead [--calls 200] [--warmup 10]
    python benchmarks/e2b_interpreter.py concurrent [--sandboxes 16] [--cells 20]
    python benchmarks/e2b_interpreter.py template [--package tabulate==0.9.0]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from metasched.runtime.dispatch import Dispatcher, DispatcherConfig
from metasched.runtime.sandbox.config import SandboxConfig
from metasched.serve import BackgroundServer, ServeConfig, create_app
from metasched.serve.e2b.templates import E2BTemplate, build_layers


def percentile(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (nearest rank)."""
    ys = sorted(xs)
    return ys[min(len(ys) - 1, max(0, round(q * len(ys)) - 1))]


@contextmanager
def served(templates: dict[str, E2BTemplate] | None = None,
           layers: dict[str, Any] | None = None,
           cache: str | None = None) -> Iterator[tuple[Any, dict[str, str]]]:
    """A service; its dispatcher, and the SDK's connection options."""
    config = DispatcherConfig(scheduler="elastic_greedy",
                              sandbox=SandboxConfig(**(layers or {})))
    app = create_app(lambda: Dispatcher(config),
                     ServeConfig(languages=[], e2b_templates=templates or {},
                                 e2b_cache=cache))
    with BackgroundServer(app) as srv:
        yield app.state.service.dispatcher, {"api_url": f"{srv.url}/e2b",
                                             "sandbox_url": f"{srv.url}/e2b",
                                             "api_key": "unused"}


def overhead(args: argparse.Namespace) -> None:
    from e2b_code_interpreter import Sandbox

    with served() as (_, opts):
        sb = Sandbox.create(timeout=3600, **opts)
        cell, command, diff = [], [], []
        for i in range(args.warmup + args.calls):
            t0 = time.perf_counter()
            assert sb.run_code("1").text == "1"
            t1 = time.perf_counter()
            assert sb.commands.run("true").exit_code == 0
            t2 = time.perf_counter()
            if i >= args.warmup:
                cell.append((t1 - t0) * 1000)
                command.append((t2 - t1) * 1000)
                diff.append(cell[-1] - command[-1])
        sb.kill()
    print(f"{args.calls} calls each, in turn in one sandbox ({args.warmup} warm-up "
          f"not counted), milliseconds:")
    print(f"  {'call':<22} {'p50':>8} {'p99':>8}")
    for name, xs in (('run_code("1")', cell), ('commands.run("true")', command)):
        print(f"  {name:<22} {percentile(xs, 0.5):8.1f} {percentile(xs, 0.99):8.1f}")
    print(f"  per-cell overhead (run_code - commands.run, call by call): p50 "
          f"{percentile(diff, 0.5):.1f} ms")


async def _loop(opts: dict[str, str], cells: int) -> str:
    from e2b_code_interpreter import AsyncSandbox

    sb = await AsyncSandbox.create(timeout=3600, request_timeout=600, **opts)
    await sb.run_code("acc = []", timeout=600)
    for i in range(cells):
        ex = await sb.run_code(f"acc.append({i})\nsum(acc)", timeout=600)
        assert ex.error is None and ex.text == str(sum(range(i + 1))), ex
    await sb.kill()
    return sb.sandbox_id


def concurrent(args: argparse.Namespace) -> None:
    with served() as (dispatcher, opts):
        t0 = time.perf_counter()
        ids = asyncio.run(_gather(opts, args.sandboxes, args.cells))
        took = time.perf_counter() - t0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and _left(dispatcher, ids) != (0, 0, 0):
            time.sleep(0.2)
        left = _left(dispatcher, ids)
    print(f"{args.sandboxes} AsyncSandbox at once x {args.cells} cells each (state across "
          f"cells): {took:.1f} s; left after kill: trajectories {left[0]}, sandboxes "
          f"{left[1]}, kernels {left[2]}")


async def _gather(opts: dict[str, str], n: int, cells: int) -> list[str]:
    return list(await asyncio.gather(*(_loop(opts, cells) for _ in range(n))))


def _left(dispatcher: Any, ids: list[str]) -> tuple[int, int, int]:
    names = [f"e2b-{i}" for i in ids]
    trajectories = sum(n in dispatcher.trajectories.by_name for n in names)
    boxes = sum(dispatcher.sandboxes.get(n) is not None for n in names)
    return trajectories, boxes, len(dispatcher.kernels.running)


def template(args: argparse.Namespace) -> None:
    from e2b_code_interpreter import AsyncSandbox, Sandbox

    module = args.package.split("=")[0].split("<")[0].split(">")[0].replace("-", "_")
    with_pkg = E2BTemplate(packages={"pip": [args.package]})
    plain = E2BTemplate()
    templates = {"with-package": with_pkg, "plain": plain}
    cache = args.cache
    t0 = time.perf_counter()
    layers = build_layers(templates, cache)
    built = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert build_layers(templates, cache) == layers
    cached = time.perf_counter() - t0
    print(f"layers built (or found) in {built:.1f} s; found again in {cached * 1000:.0f} ms")
    with served(templates, layers, cache) as (_, opts):

        async def imported() -> str:
            sb = await AsyncSandbox.create("with-package", timeout=600, **opts)
            ex = await sb.run_code(f"import {module}\n{module}.__file__")
            await sb.kill()
            assert ex.error is None, ex.error
            return ex.text or ""

        async def all_of() -> list[str]:
            return list(await asyncio.gather(*(imported() for _ in range(args.sandboxes))))

        paths = asyncio.run(all_of())
        print(f"{module} imported in {len(paths)} sandboxes at once, from "
              f"{sorted(set(paths))}")
        times: dict[str, list[float]] = {"with-package": [], "plain": []}
        for name in times:  # each template's first sandbox: not counted
            Sandbox.create(name, **opts).kill()
        for i in range(args.rounds):  # the order alternates: each follows the other's kill
            for name in (list(times) if i % 2 == 0 else list(times)[::-1]):
                t0 = time.perf_counter()
                sb = Sandbox.create(name, **opts)
                times[name].append((time.perf_counter() - t0) * 1000)
                sb.kill()
    print(f"creation of a later sandbox, {args.rounds} of each in turn, median ms: "
          + ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in times.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    p = sub.add_parser("overhead")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--warmup", type=int, default=10)
    p = sub.add_parser("concurrent")
    p.add_argument("--sandboxes", type=int, default=16)
    p.add_argument("--cells", type=int, default=20)
    p = sub.add_parser("template")
    p.add_argument("--package", default="tabulate==0.9.0")
    p.add_argument("--sandboxes", type=int, default=16)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--cache", default=None, help="layers' cache (default: the service's "
                   "default; not under /tmp, which sandboxes have their own of)")
    args = ap.parse_args()
    {"overhead": overhead, "concurrent": concurrent, "template": template}[args.what](args)


if __name__ == "__main__":
    main()
