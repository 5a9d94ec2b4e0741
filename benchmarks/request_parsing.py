"""Request parsing cost of two checkouts side by side, in alternating short bursts.

    .venv/bin/python benchmarks/request_parsing.py [--python OTHER/.venv/bin/python]
        [--bursts 40] [--n 1000]

Each ``--python`` interpreter (this one first, then each one given: another checkout's
virtual environment, which imports that checkout's ``metasched``) runs in a worker
process that times ``--n`` calls of one step when asked. The driver asks the workers in
turn, step by step, ``--bursts`` times, so a change of the machine's load falls on all
of them alike; it prints the best and the median µs per call of each step for each
interpreter, and the ratio of each one's best to the first's.

Steps: ``parse_request`` of a minimal cpu request (3 fields), of a cpu request with 13
fields, of an api request with its http spec, and a job file's line (``json.loads``
then ``parse_request``), the forms ``benchmarks/dispatch_steps.py`` times too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from dispatch_steps import API, FULL, REQUEST

# The requests timed: those of dispatch_steps.py, sent to each worker as JSON.
REQUESTS = {"cpu, 3 fields": REQUEST, "cpu, 13 fields": FULL, "api, http spec": API}

# The worker: reads the requests, then a step name and a count per line, and answers the
# seconds they took.
WORKER = r'''
import json, sys, time
from metasched.runtime.requests import parse_request
requests = json.loads(sys.stdin.readline())
line = json.dumps(requests["cpu, 13 fields"])
steps = {name: (lambda d=d: parse_request(d)) for name, d in requests.items()}
steps["job line (json.loads + parse)"] = lambda: parse_request(json.loads(line), "jobs.jsonl:1")
print(json.dumps(list(steps)), flush=True)
for cmd in sys.stdin:
    name, n = cmd.rsplit(" ", 1)
    fn = steps[name]
    t0 = time.perf_counter()
    for _ in range(int(n)):
        fn()
    print(time.perf_counter() - t0, flush=True)
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", action="append", default=[],
                    help="another interpreter (checkout) to compare; repeatable")
    ap.add_argument("--bursts", type=int, default=40, help="timings per step and worker")
    ap.add_argument("--n", type=int, default=1000, help="calls per timing")
    args = ap.parse_args()
    pythons = [sys.executable, *args.python]
    for p in args.python:
        if not Path(p).is_file():
            ap.error(f"--python: {p} is not a file")
    workers = [subprocess.Popen([p, "-c", WORKER], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True) for p in pythons]
    try:
        for w in workers:
            w.stdin.write(json.dumps(REQUESTS) + "\n")
            w.stdin.flush()
        steps = [json.loads(w.stdout.readline()) for w in workers][0]
        times: dict[tuple[int, str], list[float]] = {}
        for b in range(args.bursts):
            for step in steps:
                for i, w in enumerate(workers):
                    w.stdin.write(f"{step} {args.n}\n")
                    w.stdin.flush()
                    times.setdefault((i, step), []).append(
                        float(w.stdout.readline()) / args.n * 1e6)
            print(f"\rburst {b + 1}/{args.bursts}", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
    finally:
        for w in workers:
            w.stdin.close()
            w.wait()
    print("| step | " + " | ".join(f"{p}: best / median µs" for p in pythons)
          + "".join(f" | ÷ first ({p})" for p in pythons[1:]) + " |")
    print("|---" * (1 + 2 * len(pythons) - 1) + "|")
    for step in steps:
        best = [min(times[i, step]) for i in range(len(pythons))]
        cells = [f"{best[i]:.1f} / {statistics.median(times[i, step]):.1f}"
                 for i in range(len(pythons))]
        ratios = [f"{best[i] / best[0]:.2f}" for i in range(1, len(pythons))]
        print(f"| {step} | " + " | ".join(cells + ratios) + " |")


if __name__ == "__main__":
    main()
