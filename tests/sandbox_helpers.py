"""Shared by the sandbox tests: what this machine supports (a test that needs a missing
piece is skipped with the reason), and running one command through a ``Sandboxes``."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

import pytest
from helpers import dispatcher_config

from metasched.runtime.dispatch import DispatcherConfig
from metasched.runtime.sandbox import bwrap, cgroups, gvisor
from metasched.runtime.sandbox.config import SandboxConfig
from metasched.runtime.sandbox.manager import Sandbox, Sandboxes

# The isolation mode the running test confines with: "bwrap", or "gvisor" under the
# ``isolation`` fixture's gvisor parameter.
MODE = {"isolation": "bwrap"}
ISOLATION_MODES = ["bwrap", pytest.param("gvisor", marks=pytest.mark.gvisor)]
_missing: dict[str, str | None] = {}


def isolation_missing(mode: str | None = None) -> str | None:
    """Why isolation ``mode`` (default: the running test's) cannot run here, or None."""
    mode = mode or MODE["isolation"]
    if os.geteuid() != 0:
        return "the sandbox needs root"
    if mode not in _missing:
        path, why = (gvisor.find_runsc() if mode == "gvisor" else bwrap.find_bwrap())
        _missing[mode] = None if path is not None else why
    return _missing[mode]


def needs_isolation() -> None:
    why = isolation_missing()
    if why is not None:
        pytest.skip(f"{MODE['isolation']} isolation unavailable: {why}")


@pytest.fixture
def gvisor_mode():
    """The gvisor mode for the test (skipped where runsc cannot run)."""
    MODE["isolation"] = "gvisor"
    try:
        path, why = gvisor.find_runsc()
        if path is None:
            pytest.skip(f"gvisor isolation unavailable: {why}")
        yield
    finally:
        MODE["isolation"] = "bwrap"


@pytest.fixture(scope="module", params=ISOLATION_MODES)
def isolation(request):
    """Run the test under each isolation mode (skipped, with the reason, where it cannot
    run here): :func:`sandboxed_config` and :func:`needs_isolation` follow it."""
    MODE["isolation"] = request.param
    try:
        needs_isolation()
        yield request.param
    finally:
        MODE["isolation"] = "bwrap"


def needs_controllers(*names: str, mode: str = "auto") -> cgroups.Hierarchies:
    h = cgroups.discover(mode)
    missing = {c: h.missing[c] for c in names if c in h.missing}
    if missing:
        pytest.skip("cgroup controllers unavailable: "
                    + "; ".join(f"{c}: {why}" for c, why in missing.items()))
    return h


def sandboxed_config(mode: str = "auto", **kw) -> DispatcherConfig:
    """Dispatcher settings whose commands run in sandboxes (the test's isolation mode:
    bwrap unless under the ``isolation`` fixture) with cgroups ``mode``
    (``sandbox``: more of their settings), ``elastic_greedy``, sampled every 0.05 s
    unless given."""
    return dispatcher_config(sandbox=SandboxConfig(isolation=MODE["isolation"], cgroups=mode,
                                                   **kw.pop("sandbox", {})), **kw)


@dataclass
class Ran:
    status: int
    stdout: str
    stderr: str
    pid: int

    @property
    def code(self) -> int:
        return os.waitstatus_to_exitcode(self.status) if self.status >= 0 else self.status


async def run_in(sandboxes: Sandboxes, sb: Sandbox, argv: list[str], *, cores=(0,),
                 mem_limit_mb=None, pids_max=None, env=None, timeout_s=30.0) -> Ran:
    """Run ``argv`` in ``sb`` and wait for it (killed after ``timeout_s``)."""
    loop = asyncio.get_running_loop()
    await sb.ready
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    environ = {b"PATH": b"/usr/local/bin:/usr/bin:/bin", b"HOME": b"/workspace"}
    environ.update({k.encode(): v.encode() for k, v in (env or {}).items()})
    try:
        started = sandboxes.start(sb, argv=argv, env=environ, cores=list(cores),
                              mem_limit_mb=mem_limit_mb, pids_max=pids_max,
                              out_w=out_w, err_w=err_w)
    finally:
        os.close(out_w)
        os.close(err_w)
    done = loop.create_future()
    sandboxes.on_exit(started, done.set_result)
    chunks = {out_r: bytearray(), err_r: bytearray()}

    def reader(fd):
        def read():
            data = os.read(fd, 65536)
            if data:
                chunks[fd].extend(data)
            else:
                loop.remove_reader(fd)
        return read
    for fd in chunks:
        os.set_blocking(fd, False)
        loop.add_reader(fd, reader(fd))
    try:
        ev = await asyncio.wait_for(asyncio.shield(done), timeout_s)
    except asyncio.TimeoutError:
        sandboxes.kill(started)
        ev = await done
    sandboxes.finished(sb, started)
    await asyncio.sleep(0.05)  # the pipes' last bytes
    for fd in chunks:
        loop.remove_reader(fd)
        try:
            chunks[fd].extend(os.read(fd, 1 << 20))
        except BlockingIOError:
            pass
        os.close(fd)
    return Ran(ev["status"], chunks[out_r].decode(errors="replace"),
               chunks[err_r].decode(errors="replace"), started.pid)
