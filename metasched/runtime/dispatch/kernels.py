"""Kernels: persistent interpreters of a trajectory: one for ``/run_jupyter``, and one
per context of E2B's code interpreter (:mod:`metasched.serve.e2b.interpreter`).

A kernel is a process of its trajectory's sandbox, started as a command is (the same
sandboxes: the sandbox, its user, a cgroup slot with the memory and process limits),
on the dispatcher's cores; it runs :data:`DRIVER`, which keeps one namespace and
executes the cells it is sent over a Unix socket in the workspace (:data:`SOCKET`).
Cells are actions of the trajectory: each is a command (:data:`CELL_CLIENT`) that
hands one cell to the kernel and prints its result, granted a core while the kernel
computes, queued, journaled and timed out as any other.

A kernel lives as long as its trajectory: closing the trajectory (its last action, an
explicit close, or its idle time, ``trajectory_idle_s``) ends its sandbox and the kernel
with it; a dispatcher that closes kills every kernel.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any, Protocol

from metasched.runtime.backend import Backend
from metasched.runtime.dispatch.shared import Shared
from metasched.runtime.launch import launch
from metasched.runtime.process import Process

__all__ = ["CELL_CLIENT", "DRIVER", "DRIVER_PATH", "SOCKET", "KernelHost", "Kernels"]


class KernelHost(Shared, Protocol):
    """What the kernels ask of their dispatcher
    (the :class:`~.dispatcher.Dispatcher`)."""

    backend: Backend
    base_env: dict[str, str]
    cores: list[int]
    sandboxes: Any  # the backend's sandboxes (made at start)


log = logging.getLogger("metasched.dispatch")

DRIVER_PATH = ".metasched/kernel.py"  # in the workspace
SOCKET = ".metasched/kernel.sock"

# The kernel: one namespace, a cell at a time; stdout/stderr captured per cell, the value
# of a last bare expression displayed (Jupyter's execute_result), an exception reported
# as Jupyter's error content; a cell's time limit is a SIGALRM raised inside it.
DRIVER = r'''
import ast, contextlib, io, json, os, signal, socket, sys, traceback
class CellTimeout(BaseException):
    pass
def _alarm(*_):
    raise CellTimeout()
signal.signal(signal.SIGALRM, _alarm)
ns = {"__name__": "__main__", "__builtins__": __builtins__}
path = sys.argv[1]
with contextlib.suppress(FileNotFoundError):
    os.unlink(path)
srv = socket.socket(socket.AF_UNIX)
srv.bind(path + ".new")
os.rename(path + ".new", path)
srv.listen(4)
def run(code, timeout):
    out, err, display, error = io.StringIO(), io.StringIO(), [], []
    status = "ok"
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                if timeout > 0:
                    signal.setitimer(signal.ITIMER_REAL, timeout)
                tree = ast.parse(code, "<cell>", "exec")
                last = None
                if tree.body and isinstance(tree.body[-1], ast.Expr):
                    last = tree.body.pop()
                exec(compile(tree, "<cell>", "exec"), ns)
                if last is not None:
                    value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), ns)
                    if value is not None:
                        display.append({"text/plain": repr(value)})
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
    except CellTimeout:
        status = "timeout"
        error.append({"ename": "TimeoutError", "evalue": f"cell ran past {timeout:g} s",
                      "traceback": []})
    except BaseException as e:
        status = "error"
        tb = traceback.format_exception(type(e), e, e.__traceback__.tb_next)
        error.append({"ename": type(e).__name__, "evalue": str(e), "traceback": tb})
    return {"status": status, "stdout": out.getvalue(), "stderr": err.getvalue(),
            "display": display, "error": error}
def fit(doc, limit):
    # The answer within the output a command may keep: the ends of the longest texts.
    keep = max(256, limit // 4)
    while True:
        data = json.dumps(doc, default=repr).encode()
        if len(data) <= limit or keep < 64:
            return data
        for key in ("stdout", "stderr"):
            if len(doc[key]) > keep:
                doc[key] = "[...]" + doc[key][-keep:]
        for item in doc["display"]:
            for k, v in item.items():
                item[k] = v if len(str(v)) <= keep else str(v)[:keep] + "[...]"
        for e in doc["error"]:
            e["traceback"] = e["traceback"][-3:]
            e["evalue"] = e["evalue"][:keep]
        keep //= 2
while True:
    conn, _ = srv.accept()
    with conn:
        data = b""
        while True:
            chunk = conn.recv(65536)
            if not chunk:
                break
            data += chunk
        limit = 1 << 30
        try:
            req = json.loads(data)
            limit = int(req.get("max_bytes", limit))
            doc = run(req["code"], float(req.get("timeout", 0)))
        except BaseException as e:
            doc = {"status": "error", "stdout": "", "stderr": "", "display": [],
                   "error": [{"ename": type(e).__name__, "evalue": str(e), "traceback": []}]}
        with contextlib.suppress(OSError):
            conn.sendall(fit(doc, limit))
'''

# A cell: argv[1] is the request (JSON), argv[2] how long to wait for the kernel's socket.
CELL_CLIENT = r'''
import json, socket, sys, time
deadline = time.monotonic() + float(sys.argv[2])
while True:
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(sys.argv[3])
        break
    except OSError as e:
        s.close()
        if time.monotonic() > deadline:
            sys.exit(f"kernel: not running ({e.strerror})")
        time.sleep(0.02)
s.sendall(sys.argv[1].encode())
s.shutdown(socket.SHUT_WR)
data = b""
while True:
    chunk = s.recv(65536)
    if not chunk:
        break
    data += chunk
if not data:
    sys.exit("kernel: died while it ran the cell")
sys.stdout.write(data.decode())
'''


class Kernels:
    """The kernels of dispatcher ``d``'s trajectories (see the module docstring)."""

    def __init__(self, d: KernelHost) -> None:
        self.d = d
        # (trajectory, name) -> its kernel: /run_jupyter's is named "", the code
        # interpreter's by their contexts.
        self.running: dict[tuple[str, str], tuple[Process, asyncio.Task]] = {}
        # Why a kernel ended on its own (a crash, its memory limit), until read.
        self.ended: dict[tuple[str, str], str] = {}

    def alive(self, trajectory: str, name: str = "") -> bool:
        """Whether ``trajectory`` has a kernel ``name`` that has not ended."""
        kept = self.running.get((trajectory, name))
        return kept is not None and not kept[1].done()

    def start(self, trajectory: str, *, python: str, mem_limit_mb: float | None,
              lifetime_s: float, name: str = "", argv: list[str] | None = None,
              env: Mapping[str, str] | None = None) -> str | None:
        """Start ``trajectory``'s kernel ``name`` (its sandbox must be ready: one of its
        commands has run): :data:`DRIVER`, or the program ``argv`` when given, with
        ``env`` over the sandbox's environment; None, or why it could not start (one
        line)."""
        d = self.d
        if self.alive(trajectory, name):
            return None
        if d.sandboxes is None or not d.sandboxes.isolated:
            return "kernels need sandboxes (sandbox.isolation=bwrap)"
        sandbox = d.sandboxes.get(trajectory)
        run_dir = getattr(d.backend, "run_dir", None)
        if sandbox is None or run_dir is None or not d.cores:
            return f"trajectory {trajectory!r} has no sandbox on this machine"
        proc = launch(argv or [python, DRIVER_PATH, SOCKET], cores=list(d.cores),
                      timeout_s=lifetime_s, env=d.base_env, request_env=env,
                      sandboxes=d.sandboxes, sandbox=sandbox,
                      cwd_root=run_dir.path,
                      pids_max=d.config.sandbox.pids_max,
                      mem_limit_mb=mem_limit_mb or d.config.limits.mem_mb,
                      tail_bytes=d.config.tail_bytes)
        key = (trajectory, name)
        self.ended.pop(key, None)
        task = d.loop.task(self._watch(key, proc))
        self.running[key] = (proc, task)
        return None

    async def _watch(self, key: tuple[str, str], proc: Process) -> None:
        out = await proc.wait()
        if out.reason and out.reason != "cancelled":
            self.ended[key] = out.reason
            log.debug("kernel %s of %s ended: %s %s", key[1] or "-", key[0], out.reason,
                      out.stderr[-300:])
        kept = self.running.get(key)
        if kept is not None and kept[0] is proc:
            del self.running[key]

    def stop(self, trajectory: str, name: str | None = None) -> None:
        """Kill ``trajectory``'s kernel ``name`` (None: all its kernels; a no-op without
        one)."""
        for key, (proc, _) in list(self.running.items()):
            if key[0] == trajectory and (name is None or key[1] == name):
                proc.cancel()
        for key in [k for k in self.ended if k[0] == trajectory]:
            if name is None or key[1] == name:
                del self.ended[key]

    async def close(self) -> None:
        """Kill every kernel and wait for them to end."""
        tasks = [task for _, task in self.running.values()]
        for task in tasks:
            task.cancel()  # cancelling its wait kills its group
        await asyncio.gather(*tasks, return_exceptions=True)
        self.running.clear()
