"""Traces of finished actions (``TraceWriter``): what the simulator and the live dispatcher
record, that replay reads it, and that the reader stays strict about what it adds."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
from helpers import COMMAND_PY, shrunk

from metasched.agents import make_scheduler
from metasched.core.trace_writer import TraceWriter
from metasched.errors import ConfigError
from metasched.runtime.dispatch import Dispatcher, DispatcherConfig
from metasched.sim.simulator import Simulator
from metasched.sim.trace import read_trace, scan_trace

PY = COMMAND_PY  # what a sandbox's user can run (see helpers)


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.mark.parametrize("name", ["coding", "rm_math", "search"])
def test_simulator_records_every_finished_action(name: str, tmp_path: Path) -> None:
    w, c = shrunk(name, load=0.1, steps=2)
    path = tmp_path / "t.jsonl"
    with TraceWriter(path, c, w.services) as log:
        sim = Simulator(w, c, seed=3, trace_writer=log)
        result = sim.run(make_scheduler("elastic_greedy"))
    rows = lines(path)
    assert rows[0]["type"] == "cluster" and rows[0]["cpu"]["nodes"] == c.cpu_nodes
    actions = rows[1:]
    assert len(actions) == log.n_written == result.counters["submitted"] == sim.instance.n_actions
    # The generation gap before a turn is what the simulator waited: that turn's gen_s.
    gens = {(str(i), j): turn.gen_s for i, ts in enumerate(t for s in sim.instance.steps
                                                           for t in s)
            for j, turn in enumerate(ts.turns)}
    for row in actions:
        m = row["measured"]
        assert m["queue_s"] >= 0 and m["run_s"] >= 0 and m["status"] in ("done", "timeout")
        assert m["step"] in (0, 1)
        if m["turn"] == 0:
            assert "gap_s" not in m
        else:
            assert m["gap_s"] == pytest.approx(gens[(m["trajectory"], m["turn"])], abs=1e-6)
        if row["action"]["kind"] == "cpu":
            assert 1 <= m["cores"] <= row["action"]["max_cores"]
        if row["action"]["kind"] == "gpu":
            assert m["batch"] >= 1 and m["device"] >= 0
    # Replay reads it (the actions arrive at their recorded times) and runs every one.
    inst = read_trace(path)
    assert len(inst.independent) == len(actions) and not inst.steps
    again = Simulator(w, c, seed=3, instance=inst).run(make_scheduler("elastic_greedy"))
    assert again.counters["completed"] + again.counters["failed"] == len(actions)


async def test_dispatcher_writes_a_trace_and_appends_after_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "live.jsonl"

    async def session(prefix: str) -> None:
        config = DispatcherConfig(scheduler="elastic_greedy", trace=path)
        async with Dispatcher(config) as d:
            for turn in range(3):
                r = await d.submit({"kind": "cpu", "argv": [PY, "-c", "pass"], "timeout_s": 30,
                                    "trajectory": f"{prefix}-t", "turn": turn, "task": "swe",
                                    "name": "py", "reward": turn == 2})
                assert r.status == "done"
                await asyncio.sleep(0.02)
            r = await d.submit({"kind": "cpu", "argv": ["sleep", "5"], "timeout_s": 0.2,
                                "task": "swe", "name": "hang"})
            assert r.status == "failed"

    await session("a")
    await session("b")
    rows = lines(path)
    # Appended, not restarted; the second service's start is a cluster line of its own
    # between the sessions' actions, later than the first.
    kinds = [r["type"] for r in rows]
    assert kinds.count("cluster") == 2 and kinds[0] == "cluster"
    second = kinds.index("cluster", 1)
    assert kinds[1:second] == ["action"] * 4 and kinds[second + 1:] == ["action"] * 4
    assert rows[second]["started_at"] > rows[0]["started_at"]
    assert rows[second]["cpu"] == rows[0]["cpu"]
    acts = [r for r in rows if r["type"] == "action"]
    assert len(acts) == 8
    for prefix in ("a", "b"):
        traj = [r for r in acts if r["measured"].get("trajectory") == f"{prefix}-t"]
        assert [r["measured"]["turn"] for r in traj] == [0, 1, 2]
        assert "gap_s" not in traj[0]["measured"]
        assert all(r["measured"]["gap_s"] >= 0.02 for r in traj[1:])
        assert traj[2]["action"]["reward"] is True
        assert all(r["measured"]["exit_code"] == 0 and r["measured"]["status"] == "done"
                   and len(r["measured"]["core_ids"]) == r["measured"]["cores"] for r in traj)
    hang = [r for r in acts if r["action"]["name"] == "hang"]
    assert [r["measured"]["status"] for r in hang] == ["timeout", "timeout"]
    # Arrival times share the first dispatcher's origin: the second session comes later.
    arrivals = [r["arrival_s"] for r in acts]
    assert arrivals == sorted(arrivals)
    assert read_trace(path).n_actions == 8


def test_dispatcher_trace_that_cannot_be_written_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^trace: .*cannot write there"):
        Dispatcher(DispatcherConfig(scheduler="fifo", trace=tmp_path / "no" / "t.jsonl"))


GOOD = {"type": "action", "arrival_s": 1.0, "task": "t",
        "action": {"kind": "cpu", "name": "x", "duration_s": 1.0, "timeout_s": 9},
        "measured": {"queue_s": 0.0, "run_s": 1.0, "status": "done", "cores": 1}}


@pytest.mark.parametrize(("change", "message"), [
    ({"measured": {"queue_s": 0, "run_s": 1, "status": "ok"}}, "measured.status: must be one of"),
    ({"measured": {"queue_s": 0, "run_s": -1, "status": "done"}}, "measured.run_s: must be >= 0"),
    ({"measured": {"queue_s": 0, "run_s": 1, "status": "done", "speed": 2}},
     "measured.speed: unknown field"),
    ({"measured": {"run_s": 1, "status": "done"}}, "measured.queue_s: is required"),
    ({"measured": {"queue_s": 0, "run_s": 1, "status": "done", "core_ids": [0, -1]}},
     r"measured.core_ids\[1\]: must be >= 0"),
    ({"measured": {"queue_s": 0, "run_s": 1, "status": "done", "gap_s": float("nan")}},
     "invalid JSON|measured.gap_s: must be a finite number"),
])
def test_measured_fields_are_checked(change: dict, message: str, tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({**GOOD, **change}) + "\n")
    with pytest.raises(ConfigError, match=rf"t.jsonl:1: ({message})"):
        read_trace(path)


@pytest.mark.parametrize(("line", "message"), [
    ({"type": "cluster", "cpu": {"nodes": -1}}, "cluster.cpu.nodes: must be >= 0"),
    ({"type": "cluster", "services": {"rm": {"mem_gb": 0, "restore_s": 1}}},
     "services.rm.mem_gb: must be > 0"),
    ({"type": "cluster", "owner": "x"}, "owner: unknown field"),
])
def test_cluster_lines_are_checked(line: dict, message: str, tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(line) + "\n" + json.dumps(GOOD) + "\n")
    with pytest.raises(ConfigError, match=rf"t.jsonl:1: {message}"):
        read_trace(path)


def test_scan_trace_streams_records_with_what_was_measured(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("# a comment\n" + json.dumps(GOOD) + "\n\n")
    (rec,) = list(scan_trace(path))
    assert rec.lineno == 2 and rec.measured.status == "done" and rec.measured.cores == 1
    assert rec.action.spec.true_s == 1.0 and rec.trajectory is None


@pytest.mark.parametrize("value", [5, "", ["a"]])
def test_dispatch_trace_setting_is_checked(value, tmp_path: Path) -> None:
    from metasched.cli.dispatch_app import dispatcher_config

    with pytest.raises(ConfigError, match=r"^trace: must be a file path or null"):
        dispatcher_config({"trace": value}, tmp_path)


@pytest.mark.subprocess
def test_dispatch_app_records_a_trace(tmp_path: Path) -> None:
    import subprocess

    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text("".join(json.dumps({"kind": "cpu", "argv": [PY, "-c", "pass"], "timeout_s": 30,
                                        "trajectory": "t", "turn": i, "reward": i == 1}) + "\n"
                            for i in range(2)))
    trace = tmp_path / "live.jsonl"
    p = subprocess.run([sys.executable, "-m", "metasched.cli.dispatch_app", f"jobs={jobs}",
                        f"trace={trace}", "scheduler=fifo", "progress=false",
                        f"hydra.run.dir={tmp_path / 'out'}"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert read_trace(trace).n_actions == 2
