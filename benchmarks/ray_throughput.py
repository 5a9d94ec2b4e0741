"""Throughput of the dispatcher actor on no-op actions, side by side with raw Ray tasks.

Starts a local Ray (bound to 127.0.0.1; or joins ``--address``), then, R rounds, each
way through the actor side by side with the raw baseline measured just before it (the
machine's load drifts within a round; each round takes the ways in a rotated order):

- raw: N tasks as a user would write them without a scheduler (``/bin/true`` through
  the CPU executor, pinned to one core, ``num_cpus=1``, node affinity, unconfined),
  submitted by this process all at once and awaited on its event loop;
- raw, k in flight: the same tasks, at most k (the cores the dispatcher grants) running
  or queued in Ray at a time, the next submitted when one ends;
- through the actor, once per ``--submit`` mode: the same N actions submitted through a
  handle to the dispatcher actor (journal on, as in production), which queues them,
  schedules them (elastic_greedy) and has each node's daemon run them confined as the
  dispatcher's ``sandbox`` settings say (``--isolation``: ``auto`` is bwrap sandboxes
  and cgroup slots where the machine allows, as users get by default): ``stream`` (the
  default), commands and results on one direct stream per node; ``daemon``, a direct
  call to the daemon per action; ``task``, a Ray task per action with ``num_cpus`` of
  its grant that asks the daemon (with ``stream`` and ``daemon`` the daemon holds the
  dispatcher's cores in Ray, so its dispatcher runs only for its own measurement,
  started and stopped each round);
  each once per ``--ahead`` value (the dispatcher's ``ahead_per_core``: commands per
  core handed to the node ahead of its free cores; 0: none, each started on a free
  core; the default is the backend's).

Prints the cost of one Ray actor call (CPU in the caller and the callee: what
``submit="stream"`` saves on every action), each rate, the ratio per round (actor ÷ the
raw run just before it, the acceptance figure: >= 0.8) and its median, and where the CPU
went: the dispatcher actor's CPU seconds per action, and so the ceiling of one
dispatcher actor on one core (actions/s it could schedule were the tasks free), and the
rate of empty Ray tasks (no command) here, Ray's own floor. With ``--floor``, after
each way, the dispatcher actor's own floor: the CPU per action of an actor that makes
the same Ray calls (a batch call per client loop turn, the results stream) and nothing
else, its results paced at the rate the dispatcher just reached.

    python benchmarks/ray_throughput.py [--n 2000] [--rounds 3] [--cpus 2]
        [--submit stream,daemon,task] [--ahead 0,1] [--isolation auto] [--trajectories 0]
        [--address auto] [--floor]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import pickle
import statistics
import tempfile
import time

# Ray resolves 127.0.0.1 to the machine's outward address (and binds every server to all
# interfaces) unless clusters are off; with them off it binds to 127.0.0.1 only. Read when
# ray is first imported (this script's own imports of metasched's Ray backend included).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def _local_ray(cpus: int) -> None:
    import ray

    # address="local": a Ray of its own, not one a ``ray start`` on the machine made.
    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
             num_cpus=cpus,
             namespace="metasched", log_to_driver=False, logging_level="ERROR")


async def _raw(n: int, body: str, in_flight: int | None = None) -> float:
    """Actions per second of ``n`` tasks submitted as the dispatcher's backend submits
    them (``body``: "command", the executor on /bin/true; "empty", a task that returns),
    all at once, or at most ``in_flight`` at a time (the next when one ends)."""
    import ray

    from metasched.runtime.ray_backend.cluster import cluster_view

    # A dispatcher stopped just before may still hold CPUs in Ray (its daemons end
    # asynchronously): the raw run starts once every CPU is free again.
    total = ray.cluster_resources().get("CPU", 0.0)
    for _ in range(600):
        if ray.available_resources().get("CPU", 0.0) >= total:
            break
        await asyncio.sleep(0.05)
    (node,) = (await cluster_view())[:1]
    strategy = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(node.name, False)
    if body == "command":
        fn = _command.options(num_cpus=1, scheduling_strategy=strategy)
        cores = node.cores
        t0 = time.perf_counter()
        if in_flight is None:
            refs = [fn.remote(("/bin/true",), cores[i % len(cores)]) for i in range(n)]
            outs = [pickle.loads(o) for o in await asyncio.gather(*refs)]
        else:
            slots = asyncio.Semaphore(in_flight)

            async def one(i: int):
                async with slots:
                    return pickle.loads(await fn.remote(("/bin/true",), cores[i % len(cores)]))
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


class _Echo:
    """An async actor whose one method returns its argument: the cost of a Ray call."""

    async def echo(self, data: bytes) -> bytes:
        return data

    def pid(self) -> int:
        return os.getpid()


async def _call_cost(n: int) -> tuple[float, float]:
    """CPU seconds per Ray actor call (a 200-byte argument, a no-op async method, ``n``
    calls made at once): in this process (the caller) and in the actor (the callee)."""
    import psutil
    import ray

    actor = ray.remote(_Echo).options(max_concurrency=1000).remote()
    callee = psutil.Process(await actor.pid.remote())
    await asyncio.gather(*(actor.echo.remote(b"x" * 200) for _ in range(200)))  # warm
    me = psutil.Process()
    c0, e0 = sum(me.cpu_times()[:2]), sum(callee.cpu_times()[:2])
    await asyncio.gather(*(actor.echo.remote(b"x" * 200) for _ in range(n)))
    caller = (sum(me.cpu_times()[:2]) - c0) / n
    per_callee = (sum(callee.cpu_times()[:2]) - e0) / n
    ray.kill(actor)
    return caller, per_callee


class _Floor:
    """The floor of the dispatcher actor's own Ray traffic: an async actor with its
    calls (one ``accept_batch`` per client loop turn, one ``results`` stream yielding
    every :data:`YIELD_INTERVAL_S` at most, the same classes) that queues, schedules,
    journals and runs nothing: each request's result is made at the pace ``rate``
    (the rate the dispatcher just reached, so that results come as spread out)."""

    def __init__(self, rate: float) -> None:
        from metasched.runtime.ray_backend.actor import YIELD_INTERVAL_S, ResultBoxes

        self.rate = rate
        self.boxes = ResultBoxes(YIELD_INTERVAL_S)
        self.pacers: set = set()

    async def accept_batch(self, client: str, packed: bytes, calls=None) -> bytes:
        from metasched.runtime.ray_backend.actor import dumps

        requests = pickle.loads(packed)
        box = self.boxes.get(client)
        task = asyncio.ensure_future(self._pace(requests, box))
        self.pacers.add(task)
        task.add_done_callback(self.pacers.discard)
        return dumps([None] * len(requests))

    async def _pace(self, requests: list, box) -> None:
        from metasched.runtime.requests import DONE, Result

        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for i, req in enumerate(requests):
            wait = t0 + i / self.rate - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            now = time.time()
            box.put(Result(req["id"], DONE, exit_code=0, queued_at=now, started_at=now,
                           finished_at=now, allocation={"node": "n", "cores": [0]},
                           attempts=1))

    async def results(self, client: str):
        from metasched.runtime.ray_backend.actor import dumps

        box = self.boxes.get(client)
        while True:
            yield dumps(await box.take())

    def pid(self) -> int:
        return os.getpid()


def _floor_actor(rate: float):
    """:class:`_Floor` with the dispatcher actor's direct results connection."""
    from metasched.runtime.ray_backend.actor import DispatcherActor

    class Floor(_Floor):
        open_results = DispatcherActor.open_results
        _serve_results = DispatcherActor._serve_results

        def __init__(self, rate: float) -> None:
            super().__init__(rate)
            self._boxes = self.boxes

    return Floor


async def _floor(n: int, rate: float) -> float:
    """CPU seconds per action of a :class:`_Floor` actor answering ``n`` actions at
    ``rate`` through a dispatcher handle (after a warm-up of 200)."""
    import psutil
    import ray

    from metasched.runtime.ray_backend.client import MAX_CONCURRENCY, DispatcherHandle

    actor = ray.remote(_floor_actor(rate)).options(num_cpus=0, max_concurrency=MAX_CONCURRENCY
                                       ).remote(rate)
    proc = psutil.Process(await actor.pid.remote())
    handle = DispatcherHandle(actor, "floor")
    try:
        await _through_actor(handle, min(n, 200))
        c0 = sum(proc.cpu_times()[:2])
        await _through_actor(handle, n)
        return (sum(proc.cpu_times()[:2]) - c0) / n
    finally:
        await handle.aclose()
        ray.kill(actor)


_loop = None


def _command_task(argv: tuple[str, ...], core: int) -> bytes:
    """A user's plain task: run ``argv`` pinned to ``core`` through the CPU executor (one
    event loop per worker, kept), return how it ended, pickled."""
    global _loop
    from metasched.runtime.machine import default_workdir
    from metasched.runtime.process import run_process

    if _loop is None:
        _loop = asyncio.new_event_loop()
    out = _loop.run_until_complete(run_process(argv, cores=[core], timeout_s=60.0,
                                               cwd_root=default_workdir()))
    return pickle.dumps(out, pickle.HIGHEST_PROTOCOL)


_empty = None
_command = None


async def _through_actor(handle, n: int, trajectories: int = 0) -> float:
    """Actions/s of ``n`` no-op actions through ``handle``: trajectory-less, or spread
    over ``trajectories`` trajectories (each its sandbox, made at its first action: the
    same names on every call, so that the warm-up made them and they stay open)."""
    def request(i: int) -> dict:
        req = {"kind": "cpu", "argv": ["/bin/true"], "timeout_s": 60}
        if trajectories:
            req["trajectory"] = f"t{i % trajectories}"
        return req
    t0 = time.perf_counter()
    futs = [handle.accept(request(i)) for i in range(n)]
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
    p.add_argument("--submit", default="stream,daemon,task",
                   help="the dispatcher's ways of reaching its daemons, comma-separated")
    p.add_argument("--ahead", default=None,
                   help="the dispatcher's ahead_per_core values to run, comma-separated "
                        "(default: the backend's)")
    p.add_argument("--isolation", default="auto", choices=["auto", "bwrap", "none"],
                   help="the dispatcher's sandbox.isolation")
    p.add_argument("--trajectories", type=int, default=0,
                   help="spread the actor's actions over this many trajectories (0: none)")
    p.add_argument("--floor", action="store_true",
                   help="after each way, the CPU per action of an actor that does nothing "
                        "but the dispatcher actor's Ray calls, at the rate it reached")
    args = p.parse_args()
    if args.n < 1 or args.rounds < 1 or args.trajectories < 0:
        raise SystemExit("error: n, rounds, trajectories: must be >= 1 (trajectories >= 0)")
    from metasched.runtime.ray_backend.cluster import SUBMIT_MODES

    modes = [m.strip() for m in args.submit.split(",") if m.strip()]
    bad = [m for m in modes if m not in SUBMIT_MODES]
    if bad or not modes:
        raise SystemExit(f"error: submit: one or more of {', '.join(SUBMIT_MODES)} "
                         f"(got {args.submit!r})")

    try:
        aheads = ([None] if args.ahead is None
                  else [int(v) for v in args.ahead.split(",") if v.strip()])
    except ValueError:
        aheads = []
    if not aheads or any(v is not None and v < 0 for v in aheads):
        raise SystemExit(f"error: ahead: whole numbers >= 0, comma-separated (got "
                         f"{args.ahead!r})")
    runs = [(m, a) for m in modes for a in aheads]

    def label(run: tuple[str, int | None]) -> str:
        return run[0] if run[1] is None else f"{run[0]} D={run[1]}"

    if args.address is None:
        _local_ray(args.cpus)
    import psutil
    import ray

    from metasched.runtime.dispatch import DispatcherConfig
    from metasched.runtime.ray_backend import start_dispatcher, stop_dispatcher
    from metasched.runtime.sandbox.config import SandboxConfig

    if args.address is not None:
        ray.init(address=args.address, namespace="metasched", log_to_driver=False)
    global _empty, _command
    _empty = ray.remote(max_retries=0)(_empty_task)
    _command = ray.remote(max_retries=0)(_command_task)

    async def through(mode: str, ahead: int | None, tmp: str, n: int
                      ) -> tuple[float, float, dict]:
        """Actions/s of ``n`` actions through a fresh dispatcher in ``mode`` with
        ``ahead_per_core`` ``ahead`` (warmed first), its actor's CPU s per action, its
        stats."""
        name = f"bench-{os.getpid()}-{mode}"
        cfg = DispatcherConfig(scheduler=args.scheduler, sample_interval_s=1.0,
                               journal=os.path.join(tmp, f"{name}-{time.time_ns()}.db"),
                               sandbox=SandboxConfig(isolation=args.isolation),
                               ahead_per_core=ahead)
        handle = await asyncio.to_thread(start_dispatcher, cfg, name=name, submit=mode)
        try:
            stats = await handle.astats()
            proc = psutil.Process(stats["actor_pid"])  # on this machine
            await _through_actor(handle, min(n, 200), args.trajectories)
            c0 = sum(proc.cpu_times()[:2])
            rate = await _through_actor(handle, n, args.trajectories)
            per = (sum(proc.cpu_times()[:2]) - c0) / n
            stats = await handle.astats()
        finally:
            await handle.aclose()
            await asyncio.to_thread(stop_dispatcher, name, drain=False)
        return rate, per, stats

    async def rounds(tmp: str) -> None:
        await _raw(min(args.n, 200), "command")  # workers started, imports done
        empty = await _raw(args.n, "empty")
        print(f"empty Ray tasks (no command): {empty:,.0f}/s")
        caller, callee = await _call_cost(args.n)
        print(f"one Ray actor call (no-op, {args.n:,} at once): {caller * 1e3:.2f} ms of CPU in "
              f"the caller, {callee * 1e3:.2f} ms in the callee")
        cores = args.cpus
        print(f"| round | way | load avg | raw Ray tasks /s | through the actor /s | actor ÷ "
              f"raw | raw, {cores} in flight /s | actor ÷ raw {cores} in flight | actor CPU "
              f"ms/action | floor ms/action |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        ratios = {m: [] for m in runs}
        ratios_k = {m: [] for m in runs}
        cpu_per = {m: [] for m in runs}
        floors = {m: [] for m in runs}
        stats = {}
        for r in range(args.rounds):
            raw_k = await _raw(args.n, "command", in_flight=cores)
            shift = r % len(runs)
            for m in runs[shift:] + runs[:shift]:
                load = os.getloadavg()[0]
                raw = await _raw(args.n, "command")
                rate, per, stats[m] = await through(m[0], m[1], tmp, args.n)
                ratios[m].append(rate / raw)
                ratios_k[m].append(rate / raw_k)
                cpu_per[m].append(per)
                floor = await _floor(args.n, rate) if args.floor else math.nan
                floors[m].append(floor)
                print(f"| {r + 1} | {label(m)} | {load:.1f} | {raw:,.0f} | {rate:,.0f} | "
                      f"{rate / raw:.2f} | {raw_k:,.0f} | {rate / raw_k:.2f} | "
                      f"{per * 1e3:.3f} | {floor * 1e3:.3f} |", flush=True)
        print()
        for m in runs:
            med = statistics.median(cpu_per[m])
            lat = stats[m]["decision_latency_us"]
            print(f"{label(m)}: median actor ÷ raw {statistics.median(ratios[m]):.2f} (min "
                  f"{min(ratios[m]):.2f}, max {max(ratios[m]):.2f}, {args.rounds} rounds of "
                  f"{args.n:,}); ÷ raw with {cores} in flight "
                  f"{statistics.median(ratios_k[m]):.2f}; actor {med * 1e3:.3f} ms CPU per "
                  f"action (median): ceiling of one actor on one core ~{1 / med:,.0f} "
                  f"actions/s; decision latency µs p50 {lat.get('p50', 0):.0f}, p99 "
                  f"{lat.get('p99', 0):.0f}; ahead_per_core {stats[m]['ahead_per_core']}; "
                  f"{stats[m]['sandboxes']}")
            if args.floor:
                print(f"{label(m)}: floor (Ray calls and the results stream alone, at the "
                      f"same rate) {statistics.median(floors[m]) * 1e3:.3f} ms CPU per "
                      f"action (median)")

    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(rounds(tmp))


if __name__ == "__main__":
    main()
