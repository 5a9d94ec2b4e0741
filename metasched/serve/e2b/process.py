"""envd's process service (Connect RPC ``process.Process``) over a sandbox's actions:
``Start`` runs a command as one action (its watcher, :func:`.programs.process_argv`),
``Connect`` follows a running one, ``List`` names them, ``SendSignal`` and
``SendInput`` / ``CloseStdin`` reach them through their watcher (each one more small
action of the sandbox).

A command's output streams while it runs (:mod:`.output`): a ``Start`` stream
answers the start event at once, then each piece of stdout and stderr as the command
writes it (keep-alive events when there is none for a while), then its end; a
``Connect`` stream the same from when it connects. Where the workspace cannot be seen
from the service, the output comes at the end (the last ``tail_bytes`` of each stream).
The stream's deadline (the SDK's command ``timeout``) is the action's ``timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from protobuf import Oneof

from metasched.runtime.requests import REJECTED, Result
from metasched.serve.e2b import programs
from metasched.serve.e2b.envd import process_pb as pb
from metasched.serve.e2b.output import Output, workspace_fd
from metasched.serve.e2b.sandboxes import AtCap, Proc, Sandbox, Sandboxes
from metasched.serve.e2b.users import user_from_basic, user_refusal
from metasched.serve.sandbox_fusion import MEMORY_REASON

__all__ = ["ProcessService", "sandbox_of"]

KEEPALIVE_S = 30.0  # when the client names no interval (Keepalive-Ping-Interval)
INPUT_TIMEOUT_S = 60.0


def sandbox_of(sandboxes: Sandboxes, ctx: Any) -> Sandbox:
    """The sandbox an envd call is for (header ``E2b-Sandbox-Id``), checked against its
    access token (``X-Access-Token``).

    Raises:
        ConnectError: no such sandbox for this token (``not_found``).
    """
    headers = ctx.request_headers
    sid = headers.get("e2b-sandbox-id")
    if not sid:
        raise ConnectError(Code.INVALID_ARGUMENT, "E2b-Sandbox-Id: header required (set "
                           "E2B_SANDBOX_URL to this service's /e2b)")
    sb = sandboxes.by_token(sid, headers.get("x-access-token"))
    if sb is None:
        raise ConnectError(Code.NOT_FOUND, f"sandbox {sid!r} not found (killed, timed "
                           f"out, or another access token's)")
    why = user_refusal(user_from_basic(headers.get("authorization")))
    if why is not None:
        raise ConnectError(Code.PERMISSION_DENIED, why)
    return sb


def _end_event(result: Result) -> pb.ProcessEvent:
    code = result.exit_code
    if code is None:
        return _event("end", pb.ProcessEvent.EndEvent(
            exit_code=-1, exited=False, status="error", error=result.reason or "failed"))
    if code < 0:
        try:
            name = signal.Signals(-code).name[3:].lower()
        except ValueError:
            name = str(-code)
        status = "signal: killed" if name == "kill" else f"signal: {name}"
        error = f"{status} ({result.reason})" if result.reason.startswith(MEMORY_REASON) \
            else status
        return _event("end", pb.ProcessEvent.EndEvent(
            exit_code=-1, exited=False, status=status, error=error))
    return _event("end", pb.ProcessEvent.EndEvent(
        exit_code=code, exited=True, status=f"exit status {code}"))


def _event(kind: str, value: Any) -> pb.ProcessEvent:
    return pb.ProcessEvent(event=Oneof(kind, value))


def _info(p: Proc) -> pb.ProcessInfo:
    return pb.ProcessInfo(pid=p.pid, tag=p.tag, config=pb.ProcessConfig(
        cmd=p.cmd, args=p.args, envs=p.envs, cwd=p.cwd or None))


def _select(sb: Sandbox, selector: pb.ProcessSelector | None) -> Proc:
    proc = None
    match selector.selector if selector is not None else None:
        case Oneof(field="pid", value=pid):
            proc = sb.procs.get(pid)
        case Oneof(field="tag", value=tag):
            proc = next((p for p in sb.procs.values() if p.tag == tag), None)
    if proc is None or proc.result.done():
        raise ConnectError(Code.NOT_FOUND, "process not found (it has ended, or never ran)")
    return proc


class ProcessService:
    """The ``process.Process`` service over ``sandboxes`` (see the module docstring)."""

    def __init__(self, sandboxes: Sandboxes) -> None:
        self.sandboxes = sandboxes

    async def _events(self, proc: Proc, ctx: Any, wrap: type, from_start: bool
                      ) -> AsyncIterator[Any]:
        interval = KEEPALIVE_S
        with contextlib.suppress(TypeError, ValueError):
            interval = max(1.0, float(ctx.request_headers.get("keepalive-ping-interval")))
        assert proc.output is not None
        events = proc.output.events(from_start, interval)  # its reader from now
        result: Result | None = None
        async with contextlib.aclosing(events):
            yield wrap(event=_event("start", pb.ProcessEvent.StartEvent(pid=proc.pid)))
            async for kind, value in events:
                if kind == "end":
                    result = value
                    break
                if kind == "keepalive":
                    yield wrap(event=_event("keepalive", pb.ProcessEvent.KeepAlive()))
                else:
                    yield wrap(event=_event("data", pb.ProcessEvent.DataEvent(
                        output=Oneof(kind, value))))
        if result is None:
            raise ConnectError(Code.UNAVAILABLE, "the process's action has no result "
                               "(the service is stopping)")
        if result.status == REJECTED:
            raise ConnectError(Code.INVALID_ARGUMENT, result.reason)
        if result.reason.startswith(MEMORY_REASON):  # the kill said where it is read
            yield wrap(event=_event("data", pb.ProcessEvent.DataEvent(output=Oneof(
                "stderr", f"{result.reason}: killed for using more memory than its "
                f"limit\n".encode()))))
        yield wrap(event=_end_event(result))

    async def start(self, request: pb.StartRequest, ctx: Any) -> AsyncIterator[pb.StartResponse]:
        sb = sandbox_of(self.sandboxes, ctx)
        cfg = request.process
        if cfg is None or not cfg.cmd:
            raise ConnectError(Code.INVALID_ARGUMENT, "process.cmd: required")
        if request.has_field("pty"):
            raise ConnectError(Code.UNIMPLEMENTED, "pty: terminals are not supported here")
        if request.tag and any(p.tag == request.tag and not p.result.done()
                               for p in sb.procs.values()):
            raise ConnectError(Code.ALREADY_EXISTS, f"tag {request.tag!r} is in use")
        try:
            programs.checked_cwd(cfg.cwd or "")
        except ValueError as e:
            raise ConnectError(Code.INVALID_ARGUMENT, str(e)) from None
        try:
            self.sandboxes.check_share(sb.client)
        except AtCap as e:
            raise ConnectError(Code.RESOURCE_EXHAUSTED, str(e)) from None
        pid = sb.new_pid()
        remaining = ctx.timeout_ms
        timeout_s = (remaining / 1000.0 if remaining is not None
                     else self.sandboxes.service.limits.max_timeout_s)
        if timeout_s <= 0:
            raise ConnectError(Code.DEADLINE_EXCEEDED, "the deadline passed before the start")
        ws_fd = workspace_fd(self.sandboxes.service.dispatcher, sb.trajectory)
        argv = programs.process_argv(pid, [cfg.cmd, *cfg.args], cwd=cfg.cwd or "",
                                     stdin=bool(request.stdin), files=ws_fd is not None)
        envs = dict(cfg.envs)
        try:
            future = sb.start(argv, "process", timeout_s=timeout_s, env={**sb.env, **envs})
        except BaseException:
            if ws_fd is not None:
                os.close(ws_fd)
            raise
        proc = Proc(pid=pid, cmd=cfg.cmd, args=list(cfg.args), envs=envs,
                    cwd=cfg.cwd or "", tag=request.tag or None, stdin=bool(request.stdin),
                    result=future, output=Output(pid, ws_fd, future))
        sb.procs[pid] = proc
        future.add_done_callback(lambda _f: sb.procs.pop(pid, None))
        async for event in self._events(proc, ctx, pb.StartResponse, True):
            yield event

    async def connect(self, request: pb.ConnectRequest, ctx: Any
                      ) -> AsyncIterator[pb.ConnectResponse]:
        sb = sandbox_of(self.sandboxes, ctx)
        proc = _select(sb, request.process)
        async for event in self._events(proc, ctx, pb.ConnectResponse, False):
            yield event

    async def list(self, request: pb.ListRequest, ctx: Any) -> pb.ListResponse:
        sb = sandbox_of(self.sandboxes, ctx)
        return pb.ListResponse(processes=[_info(p) for p in sb.procs.values()
                                          if not p.result.done()])

    async def update(self, request: pb.UpdateRequest, ctx: Any) -> pb.UpdateResponse:
        raise ConnectError(Code.UNIMPLEMENTED, "pty: terminals are not supported here")

    async def stream_input(self, request: Any, ctx: Any) -> pb.StreamInputResponse:
        sb = sandbox_of(self.sandboxes, ctx)
        proc: Proc | None = None
        async for message in request:
            match message.event:
                case Oneof(field="start", value=start):
                    proc = _select(sb, start.process)
                case Oneof(field="data", value=data) if proc is not None:
                    await self._input(sb, proc, data.input)
        return pb.StreamInputResponse()

    async def _input(self, sb: Sandbox, proc: Proc, given: pb.ProcessInput | None) -> None:
        match given.input if given is not None else None:
            case Oneof(field="stdin", value=data):
                pass
            case _:
                raise ConnectError(Code.UNIMPLEMENTED, "pty: terminals are not supported here")
        if not proc.stdin:
            raise ConnectError(Code.FAILED_PRECONDITION, "stdin: the process was started "
                               "without it (stdin=True)")
        r = await sb.run(programs.input_argv(proc.pid, data), "stdin",
                         timeout_s=INPUT_TIMEOUT_S)
        if not r.ok:
            raise ConnectError(Code.INTERNAL, f"stdin: {r.reason}")

    async def send_input(self, request: pb.SendInputRequest, ctx: Any
                         ) -> pb.SendInputResponse:
        sb = sandbox_of(self.sandboxes, ctx)
        await self._input(sb, _select(sb, request.process), request.input)
        return pb.SendInputResponse()

    async def close_stdin(self, request: pb.CloseStdinRequest, ctx: Any
                          ) -> pb.CloseStdinResponse:
        sb = sandbox_of(self.sandboxes, ctx)
        proc = _select(sb, request.process)
        r = await sb.run(programs.input_argv(proc.pid, None), "stdin", timeout_s=INPUT_TIMEOUT_S)
        if not r.ok:
            raise ConnectError(Code.INTERNAL, f"stdin: {r.reason}")
        return pb.CloseStdinResponse()

    async def send_signal(self, request: pb.SendSignalRequest, ctx: Any
                          ) -> pb.SendSignalResponse:
        sb = sandbox_of(self.sandboxes, ctx)
        proc = _select(sb, request.process)
        signum = {pb.Signal.SIGTERM: signal.SIGTERM}.get(request.signal, signal.SIGKILL)
        r = await sb.run(programs.signal_argv(proc.pid, int(signum)), "signal",
                         timeout_s=INPUT_TIMEOUT_S)
        if not r.ok:
            raise ConnectError(Code.INTERNAL, f"signal: {r.reason}")
        # Answered once it has ended: the SDK's kill() means the process is gone.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(proc.result), INPUT_TIMEOUT_S)
        return pb.SendSignalResponse()
