"""The files of a cgroup: reading and writing them, a flat-keyed counter, removing a
cgroup directory (children first) and killing the processes in one."""

from __future__ import annotations

import os
import signal
import time


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _counter(path: str, key: str) -> int:
    """The ``key N`` line of a flat-keyed cgroup file (0 if absent)."""
    try:
        text = _read(path)
    except OSError:
        return 0
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            try:
                return int(value)
            except ValueError:
                return 0
    return 0


def _remove_dirs(dirs: dict[str, str]) -> bool:
    """Remove each directory of ``dirs`` (forgetting those removed); whether all are."""
    for key in list(dirs):
        if remove_dir(dirs[key]):
            del dirs[key]
    return not dirs


def remove_dir(path: str) -> bool:
    """rmdir a cgroup directory (children first); whether it is gone. A cgroup still
    holding processes stays."""
    try:
        entries = os.scandir(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    with entries:
        children = [e.path for e in entries if e.is_dir(follow_symlinks=False)]
    for child in children:
        remove_dir(child)
    try:
        os.rmdir(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def kill_members(path: str, timeout_s: float = 2.0) -> bool:
    """SIGKILL every process in the cgroup directory ``path`` (not its children) and
    wait for them to be gone; whether it emptied."""
    kill = os.path.join(path, "cgroup.kill")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            pids = [int(x) for x in _read(os.path.join(path, "cgroup.procs")).split()]
        except OSError:
            return True
        if not pids:
            return True
        if os.path.exists(kill):
            try:
                _write(kill, "1")
            except OSError:
                pass
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
