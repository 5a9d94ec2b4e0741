"""Cost per action of journaling starts and results, by group-commit size.

    .venv/bin/python benchmarks/journal_writes.py [--n 3000] [--groups 1,7,30]
        [--repeat 3]

Accepts ``--n`` requests in one transaction, then journals each request's start (with
a pid) and its result, ``group`` requests per transaction, in two ways, and prints µs
per request (best of ``--repeat``; the two ways alternate within each repeat):

- ``one call per row``: ``Journal.started`` then ``Journal.finished`` for each request
  (two statements each);
- ``record``: ``Journal.record`` with each request's start and result in one row
  update (``started_finished``), as the dispatcher writes a command that starts and
  ends within one group commit.

The journal lives in a temporary directory (``synchronous=NORMAL``, as by default).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from metasched.runtime.journal import Journal
from metasched.runtime.requests import Result

REQUEST = '{"queued_at":1.0,"request":{"kind":"cpu","argv":["/bin/true"],"timeout_s":60}}'
RESULT = Result("k", "done", "", 0, None, "", "", 1.0, 2.0, 3.0, {"cores": [1]}, 1).to_json()


def _journal(tmp: str, n: int) -> Journal:
    j = Journal(os.path.join(tmp, f"j{time.perf_counter_ns()}.db"))
    j.accept_many((f"k{i}", REQUEST) for i in range(n))
    return j


def per_row(tmp: str, n: int, group: int) -> float:
    """µs per request writing a start and a result with a call each."""
    with _journal(tmp, n) as j:
        t0 = time.perf_counter()
        for g in range(0, n, group):
            with j.batch():
                keys = [f"k{i}" for i in range(g, min(n, g + group))]
                for k in keys:
                    j.started(k, pid=123, attempt=1)
                for k in keys:
                    j.finished(k, RESULT)
        return 1e6 * (time.perf_counter() - t0) / n


def recorded(tmp: str, n: int, group: int) -> float:
    """µs per request writing start and result in one ``record`` update per group."""
    with _journal(tmp, n) as j:
        t0 = time.perf_counter()
        for g in range(0, n, group):
            with j.batch():
                now = time.time()
                j.record([], [], [(f"k{i}", 1, now, RESULT, now)
                                  for i in range(g, min(n, g + group))])
        return 1e6 * (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--groups", default="1,7,30", help="requests per commit, comma-separated")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    print("| requests per commit | one call per row µs | record µs |")
    print("|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for group in (int(g) for g in args.groups.split(",")):
            old, new = [], []
            for _ in range(args.repeat):
                old.append(per_row(tmp, args.n, group))
                new.append(recorded(tmp, args.n, group))
            print(f"| {group} | {min(old):.1f} | {min(new):.1f} |")


if __name__ == "__main__":
    main()
