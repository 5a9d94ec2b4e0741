"""E2B's code interpreter: what its ``code-interpreter-v1`` template serves on port
49999, under the service's ``/e2b`` prefix (the SDK, ``e2b-code-interpreter``, sends it
to ``E2B_SANDBOX_URL`` with the headers ``E2b-Sandbox-Id`` and ``E2b-Sandbox-Port``).

- ``POST /execute`` (``code``, and ``context_id`` or ``language``, ``env_vars``): the
  cell's events, one JSON object a line, as they happen (``stdout``, ``stderr``,
  ``result``, ``error``, ``number_of_executions``), then ``end_of_execution``;
- ``POST /contexts`` (``language``, ``cwd``), ``GET /contexts``, ``DELETE
  /contexts/{id}``, ``POST /contexts/{id}/restart``.

A context is a kernel (:mod:`.interpreter_kernel`): a process of the sandbox, started
as its commands are (the sandbox, its user, a cgroup with its memory limit) and kept
by the dispatcher (:class:`~metasched.runtime.dispatch.kernels.Kernels`) until the
context is removed or the sandbox ends. Languages: ``python`` (the default) and
``bash``; each language has a default context, made at its first cell. Each cell is
one ``cpu`` action of the sandbox's trajectory (``interpreter:cell``): queued, granted
its cores, journaled and timed out like a command; it hands the cell to its kernel and
writes the kernel's events to its output, which streams as a command's does
(:mod:`.output`). The SDK's ``timeout`` ends the request; the service then cancels the
cell's action, and its kernel interrupts the cell (the context and its state stay).
The cell's action is bounded by the sandbox's remaining lifetime.

``/execute`` checks the sandbox's access token (``X-Access-Token``) as envd's calls
do; the SDK sends none with the context calls, which then need the sandbox's id alone
(unguessable, shown only to its client), or its token where one is sent.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from metasched.runtime.requests import REJECTED, Result
from metasched.serve.e2b import programs
from metasched.serve.e2b.output import Output, workspace_fd
from metasched.serve.e2b.sandboxes import Proc, Sandbox, Sandboxes
from metasched.serve.files import PIECE

if TYPE_CHECKING:
    from metasched.serve.service import Service

__all__ = ["INTERPRETER_TEMPLATE", "Interpreter", "interpreter_router"]

INTERPRETER_TEMPLATE = "code-interpreter-v1"  # the SDK's default template
LANGUAGES = {"python": "python", "python3": "python", "bash": "bash", "sh": "bash"}
KERNEL_DIR = f"{programs.CONTROL}/kernels"  # in the workspace
KERNEL_PATH = f"{KERNEL_DIR}/kernel.py"
KERNEL_SOURCE = (Path(__file__).with_name("interpreter_kernel.py")).read_text()
KERNEL_START_S = 10.0  # how long a cell waits for a kernel just started to listen
WATCH_S = 0.5  # how often a running cell's kernel is looked at (ended: the cell too)
KERNEL_LIFETIME_S = 30 * 24 * 3600.0  # its sandbox ends it first
CONTEXT_TIMEOUT_S = 30.0  # the actions that make a context
PYTHON = "python3"
END = b'{"type": "end_of_execution"}\n'  # a kernel's answer's last line, and /execute's

# A cell's action, in sh (a python3 client would cost its start-up: tens of ms): once
# the kernel's FIFO argv[1] is there (up to 10 s after its start), the request
# (argv[3:], joined) is written to argv[2].req, the FIFO argv[2].out made, the kernel
# told (this shell's pid and argv[2]), and what the kernel writes to argv[2].out
# copied to stdout as it comes. A client that ends before its cell (cancelled: the
# SDK's timeout) interrupts it.
CELL_CLIENT = r"""k=$PWD/$1 c=$PWD/$2
shift 2
n=0
while [ ! -p "$k" ]; do
  n=$((n + 1))
  if [ "$n" -gt 1000 ]; then echo "kernel: not running" >&2; exit 1; fi
  sleep 0.01
done
mkfifo -m 600 "$c.out" || exit 1
printf '%s' "$@" > "$c.req" || exit 1
printf '%s %s\n' "$$" "$c" > "$k" || exit 1
exec cat "$c.out"
"""


@dataclass
class Context:
    """One context of a sandbox: its kernel's name and socket."""

    id: str
    language: str
    cwd: str

    @property
    def fifo(self) -> str:
        return f"{KERNEL_DIR}/{self.id}.in"

    def info(self) -> dict[str, str]:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}


@dataclass
class _Contexts:
    """A sandbox's contexts."""

    by_id: dict[str, Context] = field(default_factory=dict)
    default: dict[str, str] = field(default_factory=dict)  # language -> context id
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    written: bool = False  # the kernel program is in the workspace


class Refused(Exception):
    """A call refused: its HTTP status and one line."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class Interpreter:
    """The code interpreter of the service's E2B sandboxes (see the module docstring)."""

    def __init__(self, sandboxes: Sandboxes) -> None:
        self.sandboxes = sandboxes
        self.service: Service = sandboxes.service
        self.of: dict[str, _Contexts] = {}

    def contexts(self, sb: Sandbox) -> _Contexts:
        """``sb``'s contexts (and those of sandboxes that have ended forgotten)."""
        for sid in [s for s in self.of if s not in self.sandboxes.by_id]:
            del self.of[sid]
        return self.of.setdefault(sb.id, _Contexts())

    async def _run(self, sb: Sandbox, argv: list[str], name: str) -> Result:
        return await sb.run(argv, name, timeout_s=CONTEXT_TIMEOUT_S)

    async def create(self, sb: Sandbox, language: str | None, cwd: str | None) -> Context:
        """A new context of ``sb`` with its kernel started.

        Raises:
            Refused: an unknown language, a cwd that is not a directory, a kernel that
                could not start.
        """
        lang = LANGUAGES.get((language or "python").strip().lower())
        if lang is None:
            raise Refused(400, f"language {language!r}: not offered here (one of "
                          f"{', '.join(sorted(set(LANGUAGES.values())))})")
        cwd = cwd or programs.HOME
        kept = self.contexts(sb)
        if not kept.written:
            for argv in programs.write_argvs(KERNEL_PATH, KERNEL_SOURCE.encode()):
                r = await self._run(sb, argv, "interpreter:install")
                if not r.ok:
                    raise Refused(500, f"the kernel could not be installed: {_why(r)}")
            kept.written = True
        ctx = Context(id=uuid.uuid4().hex[:16], language=lang, cwd=cwd)
        r = await self._run(sb, ["/bin/sh", "-c", 'cd "$1" && rm -f "$2"', "context", cwd,
                                 ctx.fifo], "interpreter:context")
        if not r.ok:
            raise Refused(400, f"cwd: {cwd!r} is not a directory of the sandbox")
        self._start(sb, ctx)
        kept.by_id[ctx.id] = ctx
        return ctx

    def _start(self, sb: Sandbox, ctx: Context) -> None:
        kernels = getattr(self.service.dispatcher, "kernels", None)
        if kernels is None:
            raise Refused(500, "kernels run only on a dispatcher of this process")
        why = kernels.start(sb.trajectory, python=PYTHON, name=ctx.id,
                            mem_limit_mb=sb.memory_mb, lifetime_s=KERNEL_LIFETIME_S,
                            argv=[PYTHON, KERNEL_PATH, ctx.fifo, ctx.language, ctx.cwd],
                            env={**sb.template_env(), **sb.env,
                                 "HOME": programs.HOME})
        if why is not None:
            raise Refused(500, f"the kernel could not start: {why}")

    def find(self, sb: Sandbox, context_id: str) -> Context:
        """Context ``context_id`` of ``sb``.

        Raises:
            Refused: there is none (404).
        """
        ctx = self.contexts(sb).by_id.get(context_id)
        if ctx is None:
            raise Refused(404, f"context {context_id!r} not found")
        return ctx

    async def context_for(self, sb: Sandbox, context_id: str | None,
                          language: str | None) -> Context:
        """The context a cell runs in: ``context_id``'s, or ``language``'s default one
        (Python's when neither is given), made at its first cell."""
        if context_id:
            return self.find(sb, context_id)
        lang = LANGUAGES.get((language or "python").strip().lower())
        kept = self.contexts(sb)
        async with kept.lock:
            cid = kept.default.get(lang or "")
            if cid in kept.by_id:
                return kept.by_id[cid]
            ctx = await self.create(sb, language, None)
            kept.default[ctx.language] = ctx.id
            return ctx

    def remove(self, sb: Sandbox, ctx: Context) -> None:
        """End ``ctx``'s kernel and forget it."""
        kept = self.contexts(sb)
        kept.by_id.pop(ctx.id, None)
        for lang, cid in list(kept.default.items()):
            if cid == ctx.id:
                del kept.default[lang]
        self.service.dispatcher.kernels.stop(sb.trajectory, ctx.id)

    async def restart(self, sb: Sandbox, ctx: Context) -> None:
        """A fresh kernel for ``ctx`` (its state gone)."""
        kernels = self.service.dispatcher.kernels
        kernels.stop(sb.trajectory, ctx.id)
        for _ in range(200):  # its end, so that the new one takes its name
            if not kernels.alive(sb.trajectory, ctx.id):
                break
            await asyncio.sleep(0.01)
        await self._run(sb, ["/bin/rm", "-f", ctx.fifo], "interpreter:context")
        self._start(sb, ctx)

    async def execute(self, sb: Sandbox, ctx: Context, code: str,
                      env_vars: dict[str, str]) -> AsyncIterator[bytes]:
        """Run one cell: its events (JSON lines) as they come. A context whose kernel
        ended (its memory limit, a crash) gets a fresh one first."""
        kernels = self.service.dispatcher.kernels
        if not kernels.alive(sb.trajectory, ctx.id):
            kernels.ended.pop((sb.trajectory, ctx.id), None)
            # The old kernel's FIFO goes first: a cell must not write to it.
            await self._run(sb, ["/bin/rm", "-f", ctx.fifo], "interpreter:context")
            self._start(sb, ctx)
        pid = sb.new_pid()
        ws_fd = workspace_fd(self.service.dispatcher, sb.trajectory)
        body = json.dumps({"code": code, "env_vars": env_vars})
        argv = programs.process_argv(pid, [
            "/bin/sh", "-c", CELL_CLIENT, "cell", ctx.fifo, f"{KERNEL_DIR}/c{pid}",
            *(body[i:i + PIECE] for i in range(0, len(body), PIECE))],
            files=ws_fd is not None)
        left = max(1.0, sb.end_at - time.time())
        req = sb.request(argv, "interpreter:cell", timeout_s=left + KERNEL_START_S,
                         env=sb.env)
        future = self.service.dispatcher.accept(req)
        self.service.track(req["id"], future, "cpu")
        sb.procs[pid] = Proc(pid=pid, cmd=PYTHON, args=[], envs={}, cwd=ctx.cwd, tag=None,
                             stdin=False, result=future)
        future.add_done_callback(lambda _f: sb.procs.pop(pid, None))
        output = Output(pid, ws_fd, future)
        pending = b""
        errors = b""
        ended = False  # the kernel's answer was complete
        result: Result | None = None
        try:
            async for kind, value in output.events(True, WATCH_S):
                if kind == "stdout":
                    pending += value
                    end = pending.rfind(b"\n") + 1
                    if end:
                        ended = ended or END in pending[:end]
                        yield pending[:end].replace(END, b"")  # the service's own ends it
                        pending = pending[end:]
                elif kind == "stderr":
                    errors += value
                elif kind == "keepalive" and not kernels.alive(sb.trajectory, ctx.id):
                    self.service.cancel(req["id"], "request")  # nothing would answer it
                elif kind == "end":
                    result = value
            if pending:
                yield pending + b"\n"
            if result is None or not result.ok or not ended:
                for _ in range(50):  # the kernel's end is seen a moment after the cell's
                    if not kernels.alive(sb.trajectory, ctx.id):
                        break
                    await asyncio.sleep(0.01)
                yield _failure(result, errors, kernels.ended.pop((sb.trajectory, ctx.id), None))
            yield END
        finally:
            if not future.done():  # the client left (its timeout): the cell is interrupted
                self.service.cancel(req["id"], "disconnect")


def _why(r: Result) -> str:
    return (r.stderr.strip().splitlines() or [r.reason])[-1]


def _failure(result: Result | None, errors: bytes, kernel_end: str | None) -> bytes:
    """The error event of a cell whose action failed (``kernel_end``: why its kernel
    ended under it, if it did)."""
    if kernel_end is not None:
        name, value = "KernelError", (f"the context's kernel ended: {kernel_end} (its "
                                      f"state is lost; the next cell starts a new one)")
    elif result is None:
        name, value = "SandboxError", "the service stopped while the cell ran"
    elif result.status == REJECTED:
        name, value = "SandboxError", result.reason
    elif result.ok:
        name, value = "KernelError", "the context's kernel ended while it ran the cell"
    elif result.reason.startswith("timeout"):
        name, value = "TimeoutError", f"the cell ran past the sandbox's lifetime ({result.reason})"
    else:
        lines = errors.decode(errors="replace").strip().splitlines()
        name, value = "KernelError", lines[-1] if lines else (result.reason or "it failed")
    return (json.dumps({"type": "error", "name": name, "value": value,
                        "traceback": ""}) + "\n").encode()


def interpreter_router(interpreter: Interpreter) -> APIRouter:
    """The code interpreter's routes (see the module docstring), to mount under
    ``/e2b``."""
    router = APIRouter(include_in_schema=False)
    sandboxes = interpreter.sandboxes

    def find(request: Request, *, token_required: bool) -> Sandbox:
        sid = request.headers.get("e2b-sandbox-id", "")
        token = request.headers.get("x-access-token")
        sb = sandboxes.by_token(sid, token) if token or token_required else \
            sandboxes.by_id.get(sid)
        if sb is None or not sb.alive:
            raise Refused(404, f"sandbox {sid!r} not found (killed, timed out, or "
                          f"another access token's)")
        sb.last_used = time.monotonic()
        return sb

    async def body(request: Request) -> dict[str, Any]:
        try:
            doc = json.loads(await request.body() or b"{}")
        except ValueError as e:
            raise Refused(400, f"body: not JSON ({e})") from None
        if not isinstance(doc, dict):
            raise Refused(400, "body: must be a JSON object")
        return doc

    def answer(fn: Any) -> Any:
        async def route(request: Request) -> Response:
            try:
                return await fn(request)
            except Refused as e:
                return PlainTextResponse(e.message, status_code=e.status)
        route.__name__ = fn.__name__
        return route

    async def execute(request: Request) -> Response:
        sb = find(request, token_required=True)
        doc = await body(request)
        code, cid, lang = doc.get("code"), doc.get("context_id"), doc.get("language")
        env = doc.get("env_vars") or {}
        if not isinstance(code, str):
            raise Refused(400, "code: required (a string)")
        if cid and lang:
            raise Refused(400, "context_id and language: give one of them, not both")
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                for k, v in env.items()):
            raise Refused(400, "env_vars: must map strings to strings")
        ctx = await interpreter.context_for(sb, cid, lang)
        return StreamingResponse(interpreter.execute(sb, ctx, code, env),
                                 media_type="application/x-ndjson")

    async def create(request: Request) -> Response:
        sb = find(request, token_required=False)
        doc = await body(request)
        lang, cwd = doc.get("language"), doc.get("cwd")
        if not isinstance(lang, (str, type(None))) or not isinstance(cwd, (str, type(None))):
            raise Refused(400, "language and cwd: strings")
        ctx = await interpreter.create(sb, lang, cwd)
        return JSONResponse(ctx.info())

    async def listing(request: Request) -> Response:
        sb = find(request, token_required=False)
        return JSONResponse([c.info() for c in interpreter.contexts(sb).by_id.values()])

    async def remove(request: Request) -> Response:
        sb = find(request, token_required=False)
        interpreter.remove(sb, interpreter.find(sb, request.path_params["context_id"]))
        return Response(status_code=204)

    async def restart(request: Request) -> Response:
        sb = find(request, token_required=False)
        await interpreter.restart(sb, interpreter.find(sb, request.path_params["context_id"]))
        return Response(status_code=204)

    router.add_api_route("/execute", answer(execute), methods=["POST"])
    router.add_api_route("/contexts", answer(create), methods=["POST"])
    router.add_api_route("/contexts", answer(listing), methods=["GET"])
    router.add_api_route("/contexts/{context_id}", answer(remove), methods=["DELETE"])
    router.add_api_route("/contexts/{context_id}/restart", answer(restart), methods=["POST"])
    return router
