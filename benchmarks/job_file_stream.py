"""``metasched-dispatch`` on a long job file: peak memory and time to the first start.

Writes a job file of N lines (the first records the time it starts; the rest are
``/bin/true``), runs ``metasched-dispatch`` on it in a child process, and reports the
peak resident memory (``wait4``: the largest of the dispatcher and its commands, so the
dispatcher's), the time from launch to the first command's start, the total wall time,
and how many results ``results.jsonl`` holds. The same with a one-line file gives the start-up
floor (imports, loading the scheduler) that every run pays.

    python benchmarks/job_file_stream.py [--n 100000] [--scheduler elastic_greedy]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run(n: int, scheduler: str, tmp: Path) -> dict[str, float]:
    """One run of ``metasched-dispatch`` on an ``n``-line file."""
    marker = tmp / f"first-{n}"
    jobs = tmp / f"jobs-{n}.jsonl"
    with open(jobs, "w") as f:
        f.write(json.dumps({"kind": "cpu", "timeout_s": 60, "argv": [
            sys.executable, "-c", f"import time; open({str(marker)!r}, 'w').write("
                                  "repr(time.time()))"]}) + "\n")
        line = json.dumps({"kind": "cpu", "argv": ["/bin/true"], "timeout_s": 60}) + "\n"
        f.writelines(line for _ in range(n - 1))
    out = tmp / f"out-{n}"
    log = tmp / f"log-{n}"
    t0 = time.time()
    with open(log, "w") as err:
        p = subprocess.Popen([sys.executable, "-m", "metasched.cli.dispatch_app",
                              f"jobs={jobs}", f"scheduler={scheduler}", "progress=false",
                              f"hydra.run.dir={out}"], stdout=subprocess.DEVNULL, stderr=err,
                             cwd=tmp)  # not this directory: -m would import from it first
        _, status, usage = os.wait4(p.pid, 0)  # this child's own peak (its commands' aside)
    wall = time.time() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise SystemExit(f"metasched-dispatch failed ({p.returncode}): "
                         f"{log.read_text()[-2000:]}")
    peak_kb = usage.ru_maxrss
    with open(out / "results.jsonl") as f:
        results = sum(1 for _ in f)
    return {"lines": n, "peak_rss_mb": peak_kb / 1024, "first_start_s": float(
        marker.read_text()) - t0, "wall_s": wall, "results": results}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100_000, help="lines in the job file")
    ap.add_argument("--scheduler", default="elastic_greedy")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        for n in (1, args.n):
            r = run(n, args.scheduler, Path(d))
            print(f"{r['lines']:>7} lines: peak RSS {r['peak_rss_mb']:.1f} MB, first command "
                  f"started {r['first_start_s']:.2f} s after launch, all done in "
                  f"{r['wall_s']:.1f} s, {r['results']} results ({os.cpu_count()} cpus)",
                  flush=True)


if __name__ == "__main__":
    main()
