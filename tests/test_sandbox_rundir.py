"""Run directories: after a dispatcher dies, the next one removes exactly what the dead
one made (its run directory and the cgroups its marker lists), never a directory that
merely looks like one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from metasched.runtime.sandbox import cgroups
from metasched.runtime.sandbox.rundir import MARKER, RunDirectory, remove_dead_runs


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_dead_runs_are_removed_and_only_they(tmp_path):
    mine = RunDirectory(str(tmp_path))
    (tmp_path / "metasched-run-lookalike").mkdir()  # no marker: a user's directory
    (tmp_path / "metasched-run-lookalike" / "data").write_text("keep")
    (tmp_path / "metasched-1234-0").mkdir()  # the old scratch naming, not a run
    dead = tmp_path / "metasched-run-dead"
    (dead / "scratch").mkdir(parents=True)
    (dead / MARKER).write_text(json.dumps({"pid": dead_pid(), "start_time": 1, "cgroups": []}))
    alive = tmp_path / "metasched-run-alive"
    alive.mkdir()
    with open(f"/proc/{os.getppid()}/stat", "rb") as f:
        data = f.read()
    started = int(data[data.rfind(b")") + 2:].split()[19])
    (alive / MARKER).write_text(json.dumps({"pid": os.getppid(), "start_time": started}))
    reused = tmp_path / "metasched-run-reused-pid"
    reused.mkdir()
    (reused / MARKER).write_text(json.dumps({"pid": os.getppid(), "start_time": started - 1}))

    removed = remove_dead_runs(str(tmp_path))
    assert sorted(removed) == sorted([str(dead), str(reused)])
    assert not dead.exists() and not reused.exists()
    assert (tmp_path / "metasched-run-lookalike" / "data").read_text() == "keep"
    assert (tmp_path / "metasched-1234-0").is_dir()
    assert alive.is_dir() and os.path.isdir(mine.path)  # live dispatchers' runs stay
    mine.remove()
    assert not os.path.exists(mine.path)


def test_a_dead_runs_cgroups_are_emptied_and_removed(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("cgroups need root here")
    h = cgroups.discover("auto")
    if h.v2 is None and not h.v1:
        pytest.skip(f"no writable cgroup hierarchy: {h.describe()}")
    tree = cgroups.CgroupTree(h)
    slot = tree.new_slot()
    fds = slot.procs_fds
    left = subprocess.Popen(["sleep", "300"], pass_fds=fds,
                            preexec_fn=lambda: [os.write(fd, b"0") for fd in fds])
    run = tmp_path / "metasched-run-crashed"
    run.mkdir()
    (run / MARKER).write_text(json.dumps({"pid": dead_pid(), "start_time": 1,
                                          "cgroups": tree.directories()}))
    remove_dead_runs(str(tmp_path))
    assert left.wait(5) == -9  # what the dead dispatcher left running is killed
    assert all(not os.path.exists(d) for d in tree.directories())
    assert not run.exists()
    for fd in fds:
        os.close(fd)
