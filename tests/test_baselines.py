"""Every heuristic baseline on every profile (shrunk), and the properties that tell the
baselines apart: trajectory-bound holds, elastic cores, and ACT."""

from __future__ import annotations

import dataclasses
from functools import cache

import numpy as np
import pytest

from metasched.agents import BASELINES, make_scheduler
from metasched.compose import PROFILES, profile
from metasched.core.metrics import CPU_BUSY, CPU_HELD, GPU_BUSY, GPU_HELD
from metasched.core.scheduler import Scheduler
from metasched.errors import ConfigError
from metasched.sim.simulator import Simulator

# Trajectories per step for the shrunk profiles: small, but enough to queue work.
SIZES = {"coding": 12, "search": 32, "rm_math": 32, "mixed": 40, "retool": 48}
SEEDS = (0, 1, 2)


@cache
def shrunk(name: str, steps: int = 1, trajectories: int | None = None):
    w, c = profile(name)
    n = SIZES[name] if trajectories is None else trajectories
    return dataclasses.replace(w, steps=steps, trajectories_per_step=n), c


@cache
def run(name: str, scheduler: str, seed: int = 0):
    w, c = shrunk(name)
    sim = Simulator(w, c, seed)
    return sim.run(make_scheduler(scheduler)), sim.instance.n_actions


class Spy(Scheduler):
    """Wraps a scheduler and records every grant it makes."""

    def __init__(self, inner: Scheduler) -> None:
        self.inner = inner
        self.name = inner.name
        self.grants = []

    def reset(self, state, rng):
        self.inner.reset(state, rng)

    def decide(self, state):
        grants = self.inner.decide(state)
        self.grants.extend(grants)
        return grants


def test_baselines_are_registered():
    assert set(BASELINES) == {"static", "task_isolated", "fifo", "sjf", "elastic_greedy",
                              "rate_greedy", "random", "rate_greedy_step", "critical_path",
                              "least_slack", "slack_first"}
    for name in BASELINES:
        assert make_scheduler(name).name == name
    with pytest.raises(ConfigError, match="unknown scheduler 'nope'"):
        make_scheduler("nope")


@pytest.mark.parametrize("name", PROFILES)
@pytest.mark.parametrize("scheduler", BASELINES)
def test_baseline_completes_and_accounts(scheduler, name):
    r, n_actions = run(name, scheduler)
    c = r.counters
    assert n_actions > 0
    assert c["submitted"] == n_actions == len(r.act)
    assert c["completed"] + c["failed"] == c["submitted"]
    assert c["pending"] == 0
    assert c["completed"] == int(r.ok.sum())
    assert np.isfinite(r.act).all()
    assert np.isfinite(r.lower_bound).all() and (r.lower_bound > 0).all()
    assert (r.start >= r.submit).all() and (r.end >= r.start).all()
    # No action finishes faster than its own best case (max cores, no queueing).
    assert (r.act >= r.lower_bound * (1 - 1e-9) - 1e-9).all()
    for pool, u in r.utilisation().items():
        assert 0.0 <= u <= 1.0, (pool, u)
    assert len(r.step_start) == 1 and r.makespan == r.step_end[-1]


@pytest.mark.parametrize("name", PROFILES)
@pytest.mark.parametrize("scheduler", ["fifo", "sjf", "elastic_greedy", "random"])
def test_action_level_baselines_hold_nothing(scheduler, name):
    r, _ = run(name, scheduler)
    assert r.idle_held() == {"cpu": 0.0, "gpu": 0.0, "api": 0.0}


def test_static_holds_idle_cores_on_coding():
    r, _ = run("coding", "static")
    held = r.idle_held()["cpu"]
    busy = r.totals[CPU_BUSY]
    assert held > 0.0
    # Sandboxes sit idle while the LLM generates: held-but-idle dwarfs the busy time.
    assert held > busy


@pytest.mark.parametrize("name", ["search", "rm_math", "mixed"])
def test_partitioned_baselines_hold_idle_reservations(name):
    for scheduler in ("static", "task_isolated"):
        r, _ = run(name, scheduler)
        assert sum(r.idle_held().values()) > 0.0, scheduler


@pytest.mark.parametrize("name", PROFILES)
@pytest.mark.parametrize("scheduler", BASELINES)
def test_busy_plus_held_idle_within_capacity(scheduler, name):
    r, _ = run(name, scheduler)
    span = r.makespan
    for pool, busy, held in (("cpu", CPU_BUSY, CPU_HELD), ("gpu", GPU_BUSY, GPU_HELD)):
        cap = r.capacity[pool]
        assert r.totals[busy] + r.totals[held] <= cap * span * (1 + 1e-9), pool
        # ... and in every timeline bucket.
        row = r.timeline[:, busy] + r.timeline[:, held]
        assert (row <= cap * r.timeline_dt * (1 + 1e-9)).all(), pool


# ------------------------------------------------------------------ elastic cores


def test_elastic_gives_idle_cores_to_a_parallel_action(make_workload, make_cluster):
    """One 30 s test suite (p = 0.9, 1-16 cores) on an idle 64-core node gets all 16."""
    w = make_workload({"kind": "cpu", "duration_s": 30.0, "timeout_s": 600.0, "cores": [1, 16],
                       "parallel_fraction": 0.9}, sandbox={"mem_gb": 1, "startup_s": 0})
    spy = Spy(make_scheduler("elastic_greedy"))
    r = Simulator(w, make_cluster(cores=64), seed=0).run(spy)
    assert [g.cores for g in spy.grants] == [16]
    assert r.act[0] == pytest.approx(30.0 * (0.1 + 0.9 / 16))
    assert r.act[0] == pytest.approx(r.lower_bound[0])


def test_fifo_gives_minimum_cores(make_workload, make_cluster):
    w = make_workload({"kind": "cpu", "duration_s": 30.0, "timeout_s": 600.0, "cores": [2, 16],
                       "parallel_fraction": 0.9}, sandbox={"mem_gb": 1, "startup_s": 0})
    spy = Spy(make_scheduler("fifo"))
    r = Simulator(w, make_cluster(cores=64), seed=0).run(spy)
    assert [g.cores for g in spy.grants] == [2]
    assert r.act[0] == pytest.approx(30.0 * (0.1 + 0.9 / 2))


def test_elastic_grants_extra_cores_on_coding():
    w, c = shrunk("coding")
    spies = {s: Spy(make_scheduler(s)) for s in ("elastic_greedy", "fifo")}
    for spy in spies.values():
        Simulator(w, c, seed=0).run(spy)
    parallel = [g for g in spies["elastic_greedy"].grants
                if g.action.spec.max_cores > 1 and g.action.spec.parallel_fraction > 0]
    assert parallel
    assert any(g.cores > 1 for g in parallel)
    assert all(g.action.spec.min_cores <= g.cores <= g.action.spec.max_cores
               for g in spies["elastic_greedy"].grants)
    assert all(g.cores == g.action.spec.min_cores for g in spies["fifo"].grants)


# ------------------------------------------------------------------ ACT


@pytest.mark.parametrize("name, steps, trajectories", [("coding", 1, 64), ("rm_math", 4, 128)])
@pytest.mark.parametrize("seed", SEEDS)
def test_elastic_mean_act_not_worse_than_fifo(name, steps, trajectories, seed):
    w, c = shrunk(name, steps=steps, trajectories=trajectories)
    elastic = Simulator(w, c, seed).run(make_scheduler("elastic_greedy"))
    fifo = Simulator(w, c, seed).run(make_scheduler("fifo"))
    assert len(elastic.act) == len(fifo.act)  # the same workload instance
    assert elastic.act.mean() <= fifo.act.mean()
