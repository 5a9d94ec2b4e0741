"""The simulator's outputs pinned on fixed seeds: every grant (instant, action, cores,
node, device, batch, hold) and every finish (submission, start, end, outcome) of small
instances of each profile, under every heuristic and the shipped policies (the
meta-policy ``checkpoints/default`` and the per-action ``checkpoints/per_action``), hashed and
compared with digests stored in ``tests/data/sim_digests.json``. The default run checks
a subset (``DEFAULT_PAIRS``); ``pytest -m slow tests/test_sim_digests.py`` checks the rest.

Speed-ups of the sampler, the core or the schedulers must leave these unchanged. After a
change that is meant to change results, rewrite the file with
``python tests/test_sim_digests.py --write`` and say why in the commit.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from metasched.agents import BASELINES, make_scheduler
from metasched.compose import profile
from metasched.core.actions import Grant
from metasched.envs.scheduling import scale_workload
from metasched.sim.simulator import Simulator

DIGESTS = Path(__file__).parent / "data" / "sim_digests.json"
ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ("checkpoints/default", "checkpoints/per_action")
SCHEDULERS = (*BASELINES, *SHIPPED)
SEEDS = (1_000_000, 1_000_001)


def _case(name: str):
    """(workload, cluster, simulator options) of a named case: each profile at a quarter
    of its trajectories for one step on its own cluster; ``coding-nodes``: half of
    coding's trajectories spread over 8 nodes, the most the per-action policy observes
    (sandbox placement and per-node queues across nodes); ``mixed-guard``: mixed with
    the starvation guard on."""
    if name == "coding-nodes":
        w, c = profile("coding")
        return scale_workload(w, load=0.5, steps=1), replace(c, cpu_nodes=8), {}
    if name == "mixed-guard":
        w, c = profile("mixed")
        return scale_workload(w, load=0.25, steps=1), c, {"max_wait_s": 5.0}
    w, c = profile(name)
    return scale_workload(w, load=0.25, steps=1), c, {}


CASES = ("coding", "mixed", "search", "rm_math", "retool", "coding-nodes", "mixed-guard")


def run_digest(case: str, scheduler: str, seed: int,
               alter: Callable[[Grant], Grant] | None = None) -> str:
    """The sha256 of one run's grants and finishes (floats by their exact repr);
    ``alter`` rewrites each grant before it is applied."""
    w, c, opts = _case(case)
    sim = Simulator(w, c, seed, **opts)
    h = hashlib.sha256()
    apply = sim.apply

    def recording_apply(g: Grant) -> None:
        if alter is not None:
            g = alter(g)
        h.update(repr((sim.state.t, g.action.id, g.cores, g.node, g.device,
                       tuple(b.id for b in g.batch), g.hold)).encode())
        apply(g)

    sim.apply = recording_apply  # the run loop and the guard both call self.apply
    name = str(ROOT / scheduler) if scheduler in SHIPPED else scheduler
    r = sim.run(make_scheduler(name))
    for col in (r.kind, r.submit, r.start, r.end, r.ok):
        h.update(np.ascontiguousarray(col).tobytes())
    h.update(repr(sorted(r.counters.items())).encode())
    return h.hexdigest()


def _stored() -> dict[str, str]:
    return json.loads(DIGESTS.read_text())


def _key(case: str, scheduler: str, seed: int) -> str:
    return f"{case}/{scheduler}/{seed}"


# The default run's subset (first seed): every scheduler and every case at least once, the
# per-action policy on the most nodes it observes, the meta-policy where the rule it picks
# is not rate_greedy's. Every pair on both seeds runs with -m slow.
DEFAULT_PAIRS = {("coding-nodes", "checkpoints/per_action"), ("retool", "checkpoints/default"),
                 ("coding", "elastic_greedy"),
                 ("mixed", "rate_greedy"), ("mixed-guard", "sjf"), ("search", "fifo"),
                 ("rm_math", "static"), ("rm_math", "random"), ("retool", "task_isolated"),
                 ("retool", "critical_path"), ("coding", "least_slack"),
                 ("mixed", "rate_greedy_step"), ("retool", "slack_first")}


def _params() -> list:
    return [pytest.param(case, s, seed, marks=() if (case, s) in DEFAULT_PAIRS
                         and seed == SEEDS[0] else pytest.mark.slow)
            for case in CASES for s in SCHEDULERS for seed in SEEDS]


def test_default_pairs_cover_every_scheduler_and_case() -> None:
    assert {s for _, s in DEFAULT_PAIRS} == set(SCHEDULERS)
    assert {c for c, _ in DEFAULT_PAIRS} == set(CASES)


@pytest.mark.parametrize("case, scheduler, seed", _params())
def test_outputs_match_stored_digest(case: str, scheduler: str, seed: int) -> None:
    assert run_digest(case, scheduler, seed) == _stored()[_key(case, scheduler, seed)], (
        f"{case} under {scheduler}, seed {seed}: grants or finishes changed")


def test_digest_sees_a_changed_run() -> None:
    """The digest tells runs apart: another seed, or one grant given one core fewer."""
    a = run_digest("coding", "elastic_greedy", SEEDS[0])
    assert a == run_digest("coding", "elastic_greedy", SEEDS[0])
    assert a != run_digest("coding", "elastic_greedy", SEEDS[1])
    changed: list[Grant] = []

    def one_core_fewer(g: Grant) -> Grant:
        if not changed and g.action.spec.kind == "cpu" and g.cores > g.action.spec.min_cores:
            g = replace(g, cores=g.cores - 1)
            changed.append(g)
        return g

    assert a != run_digest("coding", "elastic_greedy", SEEDS[0], alter=one_core_fewer)
    assert changed


def _write() -> None:
    out = {_key(case, s, seed): run_digest(case, s, seed)
           for case in CASES for s in SCHEDULERS for seed in SEEDS}
    DIGESTS.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(out)} digests to {DIGESTS}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        raise SystemExit("usage: python tests/test_sim_digests.py --write")
    _write()
