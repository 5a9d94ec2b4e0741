"""Trace replay: round trip, replay equivalence, independent actions, strict errors."""

from __future__ import annotations

import dataclasses
import json
import math
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metasched.agents import make_scheduler
from metasched.compose import profile
from metasched.core.cluster_config import ClusterConfig
from metasched.errors import ConfigError
from metasched.sim.sampling import WorkloadInstance
from metasched.sim.simulator import Simulator
from metasched.sim.trace import read_trace, trace_from_workload, validate_against, write_trace
from metasched.sim.workload_config import WorkloadConfig

SEED = 11


@cache
def small(name: str) -> tuple[WorkloadConfig, ClusterConfig]:
    """A profile shrunk to one step of four trajectories."""
    w, c = profile(name)
    return dataclasses.replace(w, steps=1, trajectories_per_step=4), c


def roundtrip(instance: WorkloadInstance, tmp_path: Path) -> WorkloadInstance:
    path = tmp_path / "trace.jsonl"
    write_trace(instance, path)
    return read_trace(path)


@pytest.mark.parametrize("name", ["coding", "rm_math"])
def test_round_trip_is_exact(name: str, tmp_path: Path) -> None:
    w, _ = small(name)
    inst = trace_from_workload(w, SEED)
    assert inst.steps and inst.n_actions > 0
    back = roundtrip(inst, tmp_path)
    assert back == inst
    for s, s2 in zip(inst.steps, back.steps, strict=True):
        for t, t2 in zip(s, s2, strict=True):
            for turn, turn2 in zip(t.turns, t2.turns, strict=True):
                assert turn.gen_s == turn2.gen_s
                for f in dataclasses.fields(turn.action):
                    assert getattr(turn.action, f.name) == getattr(turn2.action, f.name)


def _assert_same_result(a, b) -> None:
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert np.array_equal(x, y), f.name
        else:
            assert x == y, f.name


@pytest.mark.parametrize("name", ["coding", "rm_math"])
def test_replay_matches_sampling(name: str, tmp_path: Path) -> None:
    w, c = small(name)
    back = roundtrip(trace_from_workload(w, SEED), tmp_path)
    validate_against(back, w.services, c)
    sampled = Simulator(w, c, SEED).run(make_scheduler("elastic_greedy"))
    replayed = Simulator(w, c, SEED, instance=back).run(make_scheduler("elastic_greedy"))
    assert sampled.counters["completed"] + sampled.counters["failed"] > 0
    _assert_same_result(sampled, replayed)


INDEPENDENT = [
    "# independent actions only: no RL steps",
    '{"type": "action", "arrival_s": 0.0, "task": "t1", "action": {"kind": "cpu", '
    '"name": "build", "duration_s": 4.0, "timeout_s": 60, "min_cores": 2, "max_cores": 8, '
    '"parallel_fraction": 0.5}}',
    "",
    '{"type": "action", "arrival_s": 2.5, "task": "t2", "action": {"kind": "gpu", '
    '"name": "score", "duration_s": 0.3, "est_s": 0.5, "timeout_s": 30, "service": "orm_7b"}}',
    '{"type": "action", "arrival_s": 1.25, "task": "t3", "action": {"kind": "api", '
    '"name": "search", "duration_s": 1.0, "timeout_s": 30, "endpoint": "llm_judge", '
    '"tokens": 500}}',
    '{"type": "action", "arrival_s": 7, "task": "t1", "action": {"kind": "cpu", '
    '"name": "lint", "duration_s": 0.2, "timeout_s": 60}}',
]


def test_independent_actions_run_at_their_arrivals(tmp_path: Path) -> None:
    path = tmp_path / "independent.jsonl"
    path.write_text("\n".join(INDEPENDENT) + "\n")
    inst = read_trace(path)
    assert inst.steps == [] and len(inst.independent) == 4
    assert inst.independent[0].spec.max_cores == 8 and inst.independent[1].spec.est_s == 0.5
    assert inst.independent[3].spec.max_cores == 1 and inst.independent[3].spec.est_s == 0.2
    w, c = profile("mixed")
    validate_against(inst, w.services, c)
    assert roundtrip(inst, tmp_path) == inst
    r = Simulator(w, c, SEED, instance=inst).run(make_scheduler("elastic_greedy"))
    assert r.counters["completed"] == 4 and r.counters["pending"] == 0
    assert len(r.step_start) == 0
    arrivals = sorted(ia.arrival_s for ia in inst.independent)
    assert sorted(r.submit.tolist()) == arrivals
    assert all(np.isfinite(r.end)) and all(r.end > r.submit)


def test_validate_against_rejects_what_the_cluster_lacks(tmp_path: Path) -> None:
    path = tmp_path / "independent.jsonl"
    path.write_text("\n".join(INDEPENDENT))
    inst = read_trace(path)
    w, c = profile("mixed")
    cases = [
        ({}, c, "independent[1].action.service"),
        (w.services, dataclasses.replace(c, endpoints={}), "independent[2].action.endpoint"),
        (w.services, dataclasses.replace(c, cores_per_node=1), "independent[0].action.min_cores"),
        (w.services, dataclasses.replace(c, cpu_nodes=0), "independent[0].action.min_cores"),
        (w.services, dataclasses.replace(c, gpu_mem_gb=10), "independent[1].action.service"),
    ]
    for services, cluster, field in cases:
        with pytest.raises(ConfigError) as e:
            validate_against(inst, services, cluster)
        assert e.value.field == f"trace.{field}"


# ---------------------------------------------------------------- malformed input

ACTION = {"kind": "cpu", "name": "shell", "duration_s": 1.0, "timeout_s": 60}
REWARD = {"kind": "gpu", "name": "rm", "duration_s": 0.5, "timeout_s": 60, "service": "orm_7b",
          "reward": True}
TRAJ = {"type": "trajectory", "task": "swe", "step": 0,
        "sandbox": {"mem_gb": 4, "startup_s": 20},
        "turns": [{"gen_s": 1.0, "action": ACTION}, {"gen_s": 2.0, "action": REWARD}]}
INDEP = {"type": "action", "arrival_s": 3.0, "task": "x", "action": ACTION}
FULL = {**TRAJ, "turns": [  # every optional field given
    {"gen_s": 0, "action": {**ACTION, "est_s": 2.0, "min_cores": 2, "max_cores": 4,
                            "parallel_fraction": 0.5, "reward": False}},
    {"gen_s": 1, "action": {"kind": "api", "name": "judge", "duration_s": 1, "timeout_s": 9,
                            "endpoint": "llm_judge", "tokens": 100, "reward": True}}]}


def with_(obj: dict, path: str, value=...) -> str:
    """``obj`` as a JSON line with the value at dotted ``path`` replaced (``...``: deleted)."""
    obj = json.loads(json.dumps(obj))
    *parents, last = path.split(".")
    d = obj
    for p in parents:
        d = d[int(p)] if isinstance(d, list) else d[p]
    if value is ...:
        del d[last]
    else:
        d[last] = value
    return json.dumps(obj)


GOOD = json.dumps(TRAJ)
BAD = [  # (lines, line number of the error, field named)
    (['{"type": "trajectory",'], 1, "invalid JSON"),
    (["[1, 2]"], 1, "JSON object"),
    ([GOOD, with_(TRAJ, "type", "bogus")], 2, "type"),
    ([with_(TRAJ, "type")], 1, "type"),
    ([with_(TRAJ, "colour", "red")], 1, "colour"),
    ([with_(TRAJ, "task", 3)], 1, "task"),
    ([with_(TRAJ, "step", -1)], 1, "step"),
    ([with_(TRAJ, "step", 0.5)], 1, "step"),
    ([with_(TRAJ, "sandbox.mem_gb", "4")], 1, "sandbox.mem_gb"),
    ([with_(TRAJ, "sandbox.startup_s")], 1, "sandbox.startup_s"),
    ([with_(TRAJ, "turns", [])], 1, "turns"),
    ([with_(TRAJ, "turns.0.gen_s", -1)], 1, "turns[0].gen_s"),
    ([with_(TRAJ, "turns.0.action.duration_s", -1)], 1, "turns[0].action.duration_s"),
    ([with_(TRAJ, "turns.0.action.duration_s", 0)], 1, "turns[0].action.duration_s"),
    ([with_(TRAJ, "turns.0.action.kind", "tpu")], 1, "turns[0].action.kind"),
    ([with_(json.loads(with_(TRAJ, "turns.0.action.min_cores", 4)), "turns.0.action.max_cores",
            2)], 1, "turns[0].action.max_cores"),
    ([with_(TRAJ, "turns.0.action.parallel_fraction", 1.5)], 1,
     "turns[0].action.parallel_fraction"),
    ([with_(TRAJ, "turns.0.action.service", "rm")], 1, "turns[0].action.service"),
    ([with_(TRAJ, "turns.1.action.service")], 1, "turns[1].action.service"),
    ([with_(TRAJ, "turns.1.action.tokens", 5)], 1, "turns[1].action.tokens"),
    ([with_(TRAJ, "turns.0.action.reward", True)], 1, "turns[0].action.reward"),
    ([with_(TRAJ, "turns.1.action.reward")], 1, "turns[1].action.reward"),
    ([with_(TRAJ, "turns.1.action.reward", 1)], 1, "turns[1].action.reward"),
    ([with_(TRAJ, "turns.0.action.est_s", None)], 1, "turns[0].action.est_s"),
    ([GOOD.replace('"duration_s": 1.0', '"duration_s": NaN')], 1, "turns[0].action.duration_s"),
    ([GOOD.replace('"timeout_s": 60', '"timeout_s": Infinity', 1)], 1,
     "turns[0].action.timeout_s"),
    ([GOOD.replace('"timeout_s": 60', '"timeout_s": 1e999', 1)], 1, "turns[0].action.timeout_s"),
    ([with_(TRAJ, "turns.0.action.min_cores", 10**400)], 1, "turns[0].action.min_cores"),
    (["# header", "", GOOD, with_(TRAJ, "step", 2)], 4, "step"),
    ([with_(INDEP, "arrival_s", -0.5)], 1, "arrival_s"),
    ([with_(INDEP, "action.endpoint", "web")], 1, "action.endpoint"),
    ([with_(INDEP, "action.kind", "api")], 1, "action.endpoint"),
]


def check_error(err: ConfigError, name: str, line: int | None, field: str) -> None:
    msg = str(err)
    assert "\n" not in msg
    where = f"{name}:{line}" if line is not None else name
    assert msg.startswith(where), msg
    assert field in msg, msg


@pytest.mark.parametrize(("lines", "line", "field"), BAD,
                         ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_malformed_line_raises_config_error(lines: list[str], line: int, field: str,
                                            tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError) as e:
        read_trace(path)
    check_error(e.value, str(path), line, field)


def test_unreadable_and_empty_files(tmp_path: Path) -> None:
    for path, content in ((tmp_path / "missing.jsonl", None), (tmp_path, None),
                          (tmp_path / "empty.jsonl", "# only a comment\n\n"),
                          (tmp_path / "bad.jsonl", b"\xff\xfe{}\n")):
        if isinstance(content, str):
            path.write_text(content)
        elif isinstance(content, bytes):
            path.write_bytes(content)
        with pytest.raises(ConfigError) as e:
            read_trace(path)
        assert str(e.value).startswith(str(path)) and "\n" not in str(e.value)


def test_write_refuses_what_it_cannot_read_back(tmp_path: Path) -> None:
    w, _ = small("coding")
    inst = trace_from_workload(w, SEED)
    traj = inst.steps[0][0]
    turn = dataclasses.replace(traj.turns[0], action=dataclasses.replace(
        traj.turns[0].action, timeout_s=math.inf))
    bad = WorkloadInstance(steps=[[dataclasses.replace(traj, turns=(turn, *traj.turns[1:]))]])
    with pytest.raises(ConfigError, match=r":1: turns\[0\]\.action\.timeout_s"):
        write_trace(bad, tmp_path / "t.jsonl")
    for empty in (WorkloadInstance(), WorkloadInstance(steps=[[traj], []])):
        with pytest.raises(ConfigError):
            write_trace(empty, tmp_path / "t.jsonl")


# ---------------------------------------------------------------- fuzzing

SPECIAL = st.sampled_from([math.nan, math.inf, -math.inf, 10**400, -1, 0, 0.5, 2, True, "",
                           "cpu", "gpu", "api", "trajectory", "action", None, [], {}])
JSON = st.recursive(
    SPECIAL | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=12)
KEYS = st.sampled_from(sorted({*TRAJ, *INDEP, *ACTION, *REWARD, "est_s", "min_cores",
                               "max_cores", "parallel_fraction", "endpoint", "tokens",
                               "gen_s", "mem_gb", "startup_s"}))


def _paths(obj, prefix=()):
    """Every path into ``obj`` (dict keys and list indices)."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(
        obj, list) else ()
    for k, v in items:
        yield (*prefix, k)
        yield from _paths(v, (*prefix, k))


@st.composite
def near_valid(draw) -> object:
    """A valid line with one value replaced, deleted or added (reaches the deep checks)."""
    obj = json.loads(json.dumps(draw(st.sampled_from([TRAJ, INDEP, FULL]))))
    path = draw(st.sampled_from(list(_paths(obj))))
    parent = obj
    for k in path[:-1]:
        parent = parent[k]
    op = draw(st.sampled_from(["set", "delete", "add"]))
    if op == "set":
        parent[path[-1]] = draw(JSON)
    elif op == "delete":
        del parent[path[-1]]
    elif isinstance(parent, dict):
        parent[draw(KEYS)] = draw(JSON)
    return obj


LINE = (JSON | st.dictionaries(KEYS, JSON, max_size=5) | near_valid()).map(json.dumps) \
    | st.binary(max_size=20).filter(lambda b: b"\n" not in b)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=st.lists(LINE, min_size=1, max_size=4))
def test_random_lines_raise_only_config_error(lines: list, tmp_path_factory) -> None:
    path = tmp_path_factory.mktemp("fuzz") / "trace.jsonl"
    path.write_bytes(b"\n".join(x if isinstance(x, bytes) else x.encode() for x in lines))
    try:
        inst = read_trace(path)
    except ConfigError as e:
        assert "\n" not in str(e) and str(e).startswith(str(path))
    else:
        assert isinstance(inst, WorkloadInstance)


def test_turns_submitted_together_round_trip(tmp_path):
    """``together`` (calls made at once), ``chained`` (a chain inside them) and
    ``same_turn`` (one agent turn) are written and read back; misplaced, one line."""
    from metasched.core.actions import Turn
    from metasched.sim.trace import read_trace, trace_from_workload, write_trace

    w, _ = profile("coding")
    inst = trace_from_workload(dataclasses.replace(w, trajectories_per_step=2, steps=1), 0)
    t0 = inst.steps[0][0]
    turns = list(t0.turns)
    turns[0] = Turn(turns[0].gen_s, turns[0].action, together=True)
    turns[1] = Turn(turns[1].gen_s, turns[1].action, chained=True, same_turn=True)
    inst.steps[0][0] = dataclasses.replace(t0, turns=tuple(turns))
    path = tmp_path / "t.jsonl"
    write_trace(inst, path)
    back = read_trace(path)
    assert [t.together for t in back.steps[0][0].turns] == [t.together for t in turns]
    assert [t.chained for t in back.steps[0][0].turns] == [t.chained for t in turns]
    assert [t.same_turn for t in back.steps[0][0].turns] == [t.same_turn for t in turns]
    for key in ("chained", "same_turn"):  # on the first turn: no turn before it
        write_trace(inst, path)
        rows = [json.loads(x) for x in path.read_text().splitlines()]
        rows[0]["turns"][0][key] = True
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        with pytest.raises(ConfigError) as e:
            read_trace(path)
        assert key in str(e.value) and "\n" not in str(e.value)
    write_trace(inst, path)
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    rows[0]["turns"][-1]["together"] = True  # on the reward: nothing follows it
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(ConfigError) as e:
        read_trace(path)
    assert "together" in str(e.value) and "\n" not in str(e.value)
