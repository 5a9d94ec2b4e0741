"""Live demonstration: agent trajectories run with today's practice and with metasched,
side by side, on this machine.

    .venv/bin/python examples/agent_rollout.py              # 12 trajectories, ~3 min
    .venv/bin/python examples/agent_rollout.py --trajectories 4 --mode metasched

N agent trajectories run concurrently, in W rollout workers. Each trajectory is drawn
from the ``retool`` profile (turns, LLM generation gaps, code-run durations; times
scaled by ``--time-scale``): a turn is an LLM generation (a delay), then a tool call:

- a Python program (real CPU work, posted to ``/run_code``),
- a test run (``--tests`` test programs posted to ``/run_code`` at once), or
- a web search, through a local server on 127.0.0.1 that answers 429 past ``--rpm``
  requests in any 60 s;

and the trajectory ends with its reward: a small torch model, run as a GPU-service
action on the CPU stand-in device.

Today's practice: every trajectory reserves its cores for its whole life (``static``:
the cores split evenly over the trajectories, at least one each; a trajectory's first
code call waits for a free sandbox, which it keeps to its end), each worker wraps its
code calls in a fixed semaphore and calls the
search API directly under its own rate limit (the API's published RPM, as each worker is
configured with it), retrying its 429s. metasched: the same service with the shipped
policy (cores per action), searches through its quota proxy (the quota held for all
workers at once). Both runs replay the same drawn workload; both go through
``metasched-serve``'s ``/run_code`` (so the sandboxes are the same), only the policy and
the API path differ.

Measured and printed: mean ACT of tool calls (issue to answer, as the agent sees it:
queueing, semaphores, rate-limit waits and retries included) by kind and overall, the
step time (start to the last trajectory's end), core utilisation (core-seconds the
dispatcher granted to running actions over cores x step time; in today's practice the
parallel runs of one sandbox each count its core, so this overstates it), and the 429s
the search API sent.
Needs torch (``pip install 'metasched[train]'``; ``make install`` has it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from metasched.compose import profile
from metasched.core.pools import EndpointSpec
from metasched.runtime.dispatch import Dispatcher, DispatcherConfig
from metasched.serve import BackgroundServer, ServeConfig, Upstream, create_app
from metasched.serve.config import derated
from metasched.serve.rate_limited import RateLimitedServer
from metasched.sim.sampling import sample_trajectory

MODES = ("today", "metasched")
KINDS = ("python", "tests", "search", "reward")

# A program that works the CPU for `work` seconds of its own CPU time, then prints.
PROGRAM = """import time
t0 = time.process_time()
n = 0
while time.process_time() - t0 < {work}:
    n += sum(i * i for i in range(2000))
print({answer})
"""
# A test: the same work, then an assertion on what it computed.
TEST = PROGRAM.replace("print({answer})", "assert {answer} % 7 == {answer_mod}\nprint('ok')")


@dataclass
class Turn:
    gen_s: float
    tool: str  # python | tests | search
    work_s: list[float]  # CPU seconds of each program (tests: several)


@dataclass
class Plan:
    """One trajectory: its turns and its reward's payload."""

    turns: list[Turn]
    payload: list[float]


def draw(n: int, seed: int, time_scale: float, tests: int) -> list[Plan]:
    """N trajectories from the retool profile: its turns, generation gaps and code-run
    durations (times x ``time_scale``), each turn's tool drawn 60% python, 25% tests,
    15% search."""
    workload, _ = profile("retool")
    task = workload.tasks[0]
    rng = np.random.default_rng(seed)
    plans = []
    for _ in range(n):
        spec = sample_trajectory(task, rng, 0.0)
        turns = []
        for t in spec.turns[:-1]:  # the last is the profile's reward: ours is the model
            tool = rng.choice(["python", "tests", "search"], p=[0.6, 0.25, 0.15])
            k = tests if tool == "tests" else 1
            work = [min(3.0, t.action.true_s * time_scale * float(rng.uniform(0.5, 1.5)))
                    for _ in range(k)]
            turns.append(Turn(min(20.0, t.gen_s * time_scale), str(tool), work))
        gen = min(20.0, spec.turns[-1].gen_s * time_scale)
        turns.append(Turn(gen, "reward", []))
        plans.append(Plan(turns, [float(x) for x in rng.standard_normal(16)]))
    return plans


class Bucket:
    """A worker's own rate limit (today's practice): a token bucket of ``rpm``."""

    def __init__(self, rpm: float) -> None:
        self.rate, self.level, self.t = rpm / 60.0, 1.0, time.monotonic()

    async def take(self) -> None:
        while True:
            now = time.monotonic()
            self.level = min(1.0, self.level + (now - self.t) * self.rate)
            self.t = now
            if self.level >= 1.0:
                self.level -= 1.0
                return
            await asyncio.sleep((1.0 - self.level) / self.rate)


@dataclass
class Tally:
    """What the agents saw. ``calls``: each tool call's trajectory, turn, tool, and when
    it was issued and answered (seconds from the rollout's start): the timelines."""

    act: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in KINDS})
    failed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    seen_429: int = 0
    t0: float = field(default_factory=time.monotonic)
    calls: list[dict] = field(default_factory=list)


class Worker:
    """One rollout worker: its HTTP client and, in today's practice, its semaphore and
    rate limit."""

    def __init__(self, mode: str, service: str, upstream: str, args: argparse.Namespace,
                 tally: Tally) -> None:
        self.mode, self.service, self.upstream, self.tally = mode, service, upstream, tally
        self.http = httpx.AsyncClient(timeout=None)
        self.code_slots = asyncio.Semaphore(args.semaphore) if mode == "today" else None
        self.bucket = Bucket(args.rpm) if mode == "today" else None

    async def run_code(self, trajectory: str, turn: int, code: str) -> bool:
        body = {"code": code, "language": "python", "run_timeout": 30}
        headers = {"X-Trajectory-Id": trajectory, "X-Turn": str(turn), "X-Task": "agent"}
        if self.code_slots is not None:
            async with self.code_slots:
                r = await self.http.post(f"{self.service}/run_code", json=body, headers=headers)
        else:
            r = await self.http.post(f"{self.service}/run_code", json=body, headers=headers)
        return r.status_code == 200 and r.json()["status"] == "Success"

    async def search(self, trajectory: str, turn: int, query: str) -> bool:
        if self.mode == "metasched":  # the proxy queues and retries
            r = await self.http.get(f"{self.service}/v1/endpoints/search/q",
                                    params={"q": query},
                                    headers={"X-Trajectory-Id": trajectory,
                                             "X-Turn": str(turn), "X-Task": "agent"})
            return r.status_code == 200
        backoff = 0.5
        for _ in range(20):  # the worker's own limit, then the API's answer
            await self.bucket.take()
            r = await self.http.get(f"{self.upstream}/q", params={"q": query})
            if r.status_code != 429:
                return r.status_code == 200
            self.tally.seen_429 += 1
            wait = float(r.headers.get("retry-after", backoff))
            await asyncio.sleep(min(30.0, wait) + random.uniform(0, backoff))
            backoff = min(8.0, backoff * 2)
        return False

    async def reward(self, trajectory: str, turn: int, payload: list[float]) -> bool:
        r = await self.http.post(f"{self.service}/v1/actions", params={"wait": 600}, json={
            "kind": "gpu", "service": "rm", "payload": payload, "timeout_s": 120,
            "trajectory": trajectory, "turn": turn, "task": "agent", "reward": True})
        return r.status_code == 200 and r.json()["status"] == "done"


async def trajectory(i: int, plan: Plan, worker: Worker,
                     sandboxes: asyncio.Semaphore | None) -> None:
    """One trajectory's turns. In today's practice its first code call waits for a
    sandbox of its own (that wait is part of the call's ACT), kept to its end."""
    name = f"traj-{i}"
    tally = worker.tally
    holding = False
    try:
        for turn, t in enumerate(plan.turns):
            await asyncio.sleep(t.gen_s)  # the LLM generates
            t0 = time.monotonic()
            if sandboxes is not None and not holding and t.tool in ("python", "tests"):
                await sandboxes.acquire()
                holding = True
            if t.tool == "python":
                ok = await worker.run_code(name, turn, PROGRAM.format(work=t.work_s[0],
                                                                      answer=turn))
            elif t.tool == "tests":
                oks = await asyncio.gather(*(worker.run_code(name, turn, TEST.format(
                    work=w, answer=7 * k + 3, answer_mod=3))
                    for k, w in enumerate(t.work_s)))
                ok = all(oks)
            elif t.tool == "search":
                ok = await worker.search(name, turn, f"q{i}-{turn}")
            else:
                ok = await worker.reward(name, turn, plan.payload)
            t1 = time.monotonic()
            tally.act[t.tool].append(t1 - t0)
            tally.failed[t.tool] += not ok
            tally.calls.append({"trajectory": i, "turn": turn, "tool": t.tool,
                                "issued_s": t0 - tally.t0, "answered_s": t1 - tally.t0})
    finally:
        if holding:
            sandboxes.release()


async def rollout(mode: str, plans: list[Plan], service: str, upstream: str,
                  args: argparse.Namespace, n_sandboxes: int) -> Tally:
    tally = Tally()
    workers = [Worker(mode, service, upstream, args, tally) for _ in range(args.workers)]
    # Today's practice: a pool of sandboxes, one per trajectory from its first tool call
    # to its end.
    sandboxes = asyncio.Semaphore(n_sandboxes) if mode == "today" else None
    try:
        await asyncio.gather(*(trajectory(i, p, workers[i % len(workers)], sandboxes)
                               for i, p in enumerate(plans)))
    finally:
        for w in workers:
            await w.http.aclose()
    return tally


def busy_core_s(status: dict) -> float:
    """Core-seconds the dispatcher has granted so far."""
    return (status["granted_utilisation"]["cpu"] * status["uptime_s"]
            * len(status["pools"]["cpu"]["cores"]))


def run_mode(mode: str, plans: list[Plan], args: argparse.Namespace) -> dict:
    """One rollout of ``plans`` under ``mode``, with its own service and search API."""
    from metasched.runtime.gpu import linear_scorer
    from metasched.runtime.machine import usable_cores

    cores = len(usable_cores())
    quota = EndpointSpec(rpm=args.rpm, max_concurrency=args.workers * 4)
    if mode == "today":
        per_sandbox = max(1, cores // len(plans))
        scheduler, params = "static", {"cores_per_sandbox": per_sandbox}
    else:
        scheduler, params, per_sandbox = args.scheduler, {}, 1
    with RateLimitedServer(args.rpm, latency_s=args.search_latency_s) as api:
        upstream = Upstream(url=api.url)
        trace = None if args.trace is None else args.trace.with_name(
            f"{args.trace.stem}.{mode}{args.trace.suffix}" if args.mode == "both"
            else args.trace.name)
        dcfg = DispatcherConfig(scheduler=scheduler, scheduler_params=params, gpu_standin=1,
                                endpoints={"search": derated(quota, upstream.margin_s)},
                                tail_bytes=65536, trace=trace)
        scfg = ServeConfig(upstreams={"search": upstream}, languages=["python"])
        app = create_app(lambda: Dispatcher(dcfg, services={"rm": linear_scorer(16)}), scfg)
        with BackgroundServer(app) as srv:
            before = httpx.get(f"{srv.url}/v1/status").json()
            t0 = time.monotonic()
            tally = asyncio.run(rollout(mode, plans, srv.url, api.url, args,
                                        max(1, cores // per_sandbox)))
            step_s = time.monotonic() - t0
            after = httpx.get(f"{srv.url}/v1/status").json()
        rejected = api.rejected
    calls = [x for k in KINDS for x in tally.act[k]]
    last = max(tally.calls, key=lambda c: c["answered_s"])["trajectory"]
    util = (busy_core_s(after) - busy_core_s(before)) / (cores * step_s)
    return {"mode": mode, "scheduler": after["scheduler"], "step_s": step_s,
            "mean_act_s": float(np.mean(calls)),
            "mean_act_s_by_kind": {k: float(np.mean(v)) if v else math.nan
                                   for k, v in tally.act.items()},
            "calls": {k: len(v) for k, v in tally.act.items()}, "failed": tally.failed,
            "cores_busy": util, "api_429": rejected, "worker_429": tally.seen_429,
            "last_trajectory": critical(tally.calls, last, plans[last]),
            "timeline": tally.calls}


def critical(calls: list[dict], i: int, plan: Plan) -> dict:
    """Where trajectory ``i``'s time went: its LLM generation, then each tool's calls
    (issue to answer, as the agent saw them)."""
    mine = [c for c in calls if c["trajectory"] == i]
    out = {"trajectory": i, "end_s": max(c["answered_s"] for c in mine),
           "generation_s": sum(t.gen_s for t in plan.turns)}
    for k in KINDS:
        out[f"{k}_s"] = sum(c["answered_s"] - c["issued_s"] for c in mine if c["tool"] == k)
    return out


def table(results: dict[str, dict]) -> str:
    a, b = results.get("today"), results.get("metasched")
    rows = [("mean ACT, all tool calls (s)", "mean_act_s", None)]
    rows += [(f"mean ACT, {k} (s)", "mean_act_s_by_kind", k) for k in KINDS]
    rows += [("step time (s)", "step_s", None), ("cores granted to actions", "cores_busy", None),
             ("429s from the search API", "api_429", None)]

    def get(r: dict | None, key: str, sub: str | None) -> float:
        if r is None:
            return math.nan
        return r[key][sub] if sub else r[key]

    lines = ["| | today's practice | metasched | today ÷ metasched |", "|---|---|---|---|"]
    for label, key, sub in rows:
        x, y = get(a, key, sub), get(b, key, sub)
        ratio = f"{x / y:.2f}×" if y and not math.isnan(x) and not math.isnan(y) else "–"
        fx = f"{x:.1%}" if key == "cores_busy" else f"{x:.3g}"
        fy = f"{y:.1%}" if key == "cores_busy" else f"{y:.3g}"
        lines.append(f"| {label} | {fx} | {fy} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trajectories", type=int, default=12)
    p.add_argument("--workers", type=int, default=4, help="rollout workers")
    p.add_argument("--tests", type=int, default=3, help="test programs per test run")
    p.add_argument("--rpm", type=float, default=6.0, help="the search API's quota")
    p.add_argument("--search-latency-s", type=float, default=0.2)
    p.add_argument("--semaphore", type=int, default=2,
                   help="today's practice: code calls in flight per worker")
    p.add_argument("--time-scale", type=float, default=0.3,
                   help="times of the retool profile x this")
    p.add_argument("--scheduler", default="checkpoints/default",
                   help="metasched's policy (a checkpoint or a heuristic)")
    p.add_argument("--mode", choices=(*MODES, "both"), default="both")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    p.add_argument("--trace", type=Path, default=None,
                   help="record the dispatcher's finished actions to this JSONL trace "
                        "(with --mode both: one file per mode, NAME.<mode>.jsonl)")
    args = p.parse_args(argv)
    for name in ("trajectories", "workers", "tests", "semaphore"):
        if getattr(args, name) < 1:
            p.error(f"--{name}: must be >= 1")
    if not args.rpm > 0 or not args.time_scale > 0:
        p.error("--rpm and --time-scale: must be > 0")
    try:
        import torch  # noqa: F401 - the reward model
    except ImportError:
        print("error: torch: the reward model needs it: pip install 'metasched[train]'",
              file=sys.stderr)
        sys.exit(2)
    plans = draw(args.trajectories, args.seed, args.time_scale, args.tests)
    n_calls = sum(len(p.turns) for p in plans)
    print(f"{args.trajectories} trajectories, {n_calls} tool calls (rewards included), "
          f"{args.workers} workers, search quota {args.rpm:g} RPM")
    results = {}
    for mode in (MODES if args.mode == "both" else (args.mode,)):
        print(f"running: {mode} ...", flush=True)
        results[mode] = run_mode(mode, plans, args)
        r = results[mode]
        print(f"  {r['scheduler']}: step {r['step_s']:.1f} s, mean ACT {r['mean_act_s']:.3f} s, "
              f"failed {sum(r['failed'].values())}", flush=True)
        c = r["last_trajectory"]
        print(f"  last to end: traj-{c['trajectory']} at {c['end_s']:.1f} s: generation "
              f"{c['generation_s']:.1f} s, " + ", ".join(f"{k} {c[f'{k}_s']:.1f} s"
                                                         for k in KINDS), flush=True)
    print(table(results))
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
