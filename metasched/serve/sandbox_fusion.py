"""``POST /run_code``: SandboxFusion's contract, run as the dispatcher's actions.

Request (JSON): ``code`` (required), ``language`` (``python``), ``compile_timeout`` and
``run_timeout`` (seconds; not given: the dispatcher's ``limits.timeout_s``, 10 as in
SandboxFusion), ``memory_limit_MB`` (MiB; -1 or not given: the dispatcher's default
``limits.mem_mb``, never unlimited), ``stdin``,
``files`` (path -> base64, written beside the code), ``fetch_files`` (paths read back
after the run). Fields it does not know are ignored, as SandboxFusion does; the
trajectory fields ``trajectory``, ``turn``, ``task``, ``reward``, ``prompt`` (or the
headers ``X-Trajectory-Id`` ..., ``X-Prompt-Id``) say whose action it is (a prompt
only with a trajectory: 422 otherwise).

Response: ``status`` (``Success``, ``Failed`` or ``SandboxError``), ``message``,
``compile_result`` and ``run_result`` (each ``{status: Finished | Error |
TimeLimitExceeded, execution_time, return_code, stdout, stderr}`` or null), ``files``
(path -> base64 of each fetched file that could be read) and, beyond SandboxFusion's
fields (its clients ignore it), ``fetch_errors`` (path -> why not, one line, for each
other path of ``fetch_files``: a file that is missing or unreadable does not fail the
request; files larger than one command's output stream in the answer as they are
read, and those past ``max_file_mb`` in all are named there). ``SandboxError`` is a
fault of the sandbox (a command that could not start, a request the dispatcher
rejected, a language not offered here), ``Failed`` a compile error, a non-zero exit
or a time limit, and ``Success`` everything else. A compile that fails is not followed
by a run (``run_result`` null). Every answer is ``200`` but for a body that is not a
request or asks more than the dispatcher's ``limits`` allow (``422``, one line), a trajectory
of another client (``403``, with authentication on), and, with the dispatcher's
``deadlines.on_deadline: refuse``, a request that could not start in time (``504``,
one line, before its caller gives up: SandboxFusion's clients retry it).

Deadlines (:mod:`metasched.serve.deadlines`): the header ``X-Metasched-Deadline-S``, else
what the caller's own timeouts say it waits (verl: ``compile_timeout + run_timeout +
10``), else the dispatcher's ``deadlines.default_s``. Under load a step waits its turn
until its latest start; then it runs time-shared on busy cores (the default) and ends
by its own time limit, answered before the deadline.

Each step is one ``cpu`` action of one core in the request's trajectory (a fresh one,
closed at the end, unless the request names one: then its workspace and files persist
across that trajectory's requests): the files written (``<language>:write``, see
:mod:`metasched.serve.files`), the compile (``<language>:compile``), the run
(``<language>:run``) and, if asked, the fetch (``<language>:fetch``), named so for the
cost model. A time limit is the action's timeout, counted from its start: the wait in
the queue does not count against it. A client that disconnects before its answer
cancels the request: its queued step is dropped, its running one killed (its result:
``cancelled``), and no further step starts.
"""

from __future__ import annotations

import asyncio
import base64
import shutil
import time
import uuid
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import APIRouter, Request
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from metasched.errors import ConfigError
from metasched.runtime.dispatch.sharing import DEADLINE_REASON
from metasched.runtime.limits import RequestLimits
from metasched.runtime.requests import (
    DONE,
    FAILED,
    PROMPT_NEEDS_TRAJECTORY,
    REJECTED,
    Flag,
    Result,
    Seconds,
    Text,
    TrajectoryId,
    Turn,
)
from metasched.serve.bodies import JSONRoute
from metasched.serve.context import context_from
from metasched.serve.deadlines import (
    DEADLINE_PARAM,
    REFUSED_504,
    header_deadline,
    run_code_deadline,
)
from metasched.serve.disconnect import Gone, unless_disconnected
from metasched.serve.files import (
    FetchStream,
    decoded_size,
    fetch_argv,
    kept_output,
    parse_fetched,
    stdin_argv,
    stream_large,
    write_argvs,
)
from metasched.serve.languages import LANGUAGES, Language
from metasched.serve.native import error
from metasched.serve.openapi import GATED, TRAJECTORY_HEADERS, ErrorDetail, responses
from metasched.serve.ownership import scoped_prompt, with_scoped_prompt
from metasched.serve.security import CLIENT

if TYPE_CHECKING:
    from metasched.serve.service import Service

__all__ = ["CommandRunResult", "RunCodeRequest", "RunCodeResponse", "probe_languages",
           "run_code", "run_code_router"]

RunStatus = Literal["Success", "Failed", "SandboxError"]
CommandStatus = Literal["Finished", "Error", "TimeLimitExceeded"]


def _base64(content: str | None) -> str | None:
    if content is not None:
        try:
            decoded_size(content)
        except ValueError:
            raise ValueError("must be base64") from None
    return content


class RunCodeRequest(BaseModel):
    """SandboxFusion's ``RunCodeRequest``, plus the trajectory fields.

    The fields that become fields of the dispatcher's requests have the request
    schema's types: the timeouts are ``timeout_s`` (:data:`Seconds`), and the
    trajectory fields those of :class:`~metasched.runtime.requests.Request`; a bad
    value is the same one-line message as for a request.
    """

    model_config = ConfigDict(extra="ignore")

    code: str
    language: str = "python"
    compile_timeout: Seconds | None = None  # the dispatcher's default: limits.timeout_s
    run_timeout: Seconds | None = None
    memory_limit_MB: int = Field(-1, ge=-1)  # noqa: N815 - SandboxFusion's name
    stdin: str | None = None
    files: dict[Text, Annotated[str | None, AfterValidator(_base64)]] = Field(
        default_factory=dict)
    fetch_files: list[str] = Field(default_factory=list)
    trajectory: TrajectoryId = None
    turn: Turn | None = None
    task: Text | None = None
    reward: Flag | None = None
    prompt: TrajectoryId = None


class CommandRunResult(BaseModel):
    """How one command (the compile, or the run) ended."""

    status: CommandStatus
    execution_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None


class RunCodeResponse(BaseModel):
    """SandboxFusion's ``RunCodeResponse``."""

    status: RunStatus
    message: str = ""
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    files: dict[str, str] = Field(default_factory=dict)
    fetch_errors: dict[str, str] = Field(
        default_factory=dict, description="each path of fetch_files that is not in files: "
        "why (one line: not found, not a regular file, Permission denied ...)")


FILES_TIMEOUT_S = 60.0  # writing a request's files, fetching them back
FILES_NEED_S = 2.0  # what a files step is given before its deadline (see step_deadlines)
# Failures that are the program's running out of time, not the sandbox's fault.
_TIME_LIMITS = ("timeout after", "cpu time limit exceeded")
MEMORY_REASON = "memory limit exceeded"  # how the dispatcher names an out-of-memory kill


def command_result(result: Result) -> CommandRunResult:
    """A dispatcher result as SandboxFusion reports a command: a program that ran and
    ended (any exit status or signal, a memory or process limit) is ``Finished`` with
    its return code (one killed for its memory says so in a last line of ``stderr``);
    one stopped by its time limit is ``TimeLimitExceeded``; one that could not run is
    ``Error``, its reason in ``stderr``."""
    took = (result.finished_at - result.started_at
            if result.started_at is not None and result.finished_at is not None else None)
    if result.status == DONE:
        return CommandRunResult(status="Finished", execution_time=took, return_code=0,
                                stdout=result.stdout, stderr=result.stderr)
    if result.reason.startswith(_TIME_LIMITS):
        return CommandRunResult(status="TimeLimitExceeded", execution_time=took,
                                stdout=result.stdout, stderr=result.stderr)
    if result.status != REJECTED and result.exit_code is not None:
        stderr = result.stderr
        if result.reason.startswith(MEMORY_REASON):  # killed: said where it is read
            stderr += ("\n" if stderr and not stderr.endswith("\n") else "") + \
                f"{result.reason}: killed for using more memory than its limit\n"
        return CommandRunResult(status="Finished", execution_time=took,
                                return_code=result.exit_code, stdout=result.stdout,
                                stderr=stderr)
    return CommandRunResult(status="Error", execution_time=took, stdout=result.stdout,
                            stderr=result.reason)


def run_status(*steps: CommandRunResult | None) -> tuple[RunStatus, str]:
    """SandboxFusion's status rule over the steps that ran."""
    ran = [s for s in steps if s is not None]
    for s in ran:
        if s.status == "Error":
            return "SandboxError", s.stderr or ""
    for s in ran:
        last = (s.stderr or "").rstrip("\n").rsplit("\n", 1)[-1]
        if s.return_code != 0 and last.startswith(MEMORY_REASON):
            return "Failed", last
    if any(s.status == "TimeLimitExceeded" or s.return_code != 0 for s in ran):
        return "Failed", ""
    return "Success", ""


def trajectory_fields(req: BaseModel, context: dict[str, Any]) -> dict[str, Any]:
    """The trajectory fields of a request: the headers' (``context``), overridden by
    the body's (``req``: a body with the trajectory fields, ``/run_code``'s or
    ``/run_jupyter``'s).

    Raises:
        ConfigError: a prompt without a trajectory (a request alone is no sibling).
    """
    given = {**context, **{k: getattr(req, k) for k in _TRAJECTORY_FIELDS
                           if getattr(req, k) is not None}}
    if "prompt" in given and "trajectory" not in given:
        raise ConfigError("prompt", PROMPT_NEEDS_TRAJECTORY)
    return given


_TRAJECTORY_FIELDS = ("trajectory", "turn", "task", "reward", "prompt")


def check_caps(limits: RequestLimits, req: RunCodeRequest) -> None:
    """Refuse a request asking more than the dispatcher's caps, naming its own field.

    Raises:
        ConfigError: e.g. ``memory_limit_MB: 20000 MiB asked; a request may ask at most
            16384 (limits.max_mem_mb)``.
    """
    if req.memory_limit_MB > 0:
        limits.cap(req.memory_limit_MB, "memory_limit_MB", "max_mem_mb", " MiB")
    limits.cap(req.compile_timeout, "compile_timeout", "max_timeout_s", " s")
    limits.cap(req.run_timeout, "run_timeout", "max_timeout_s", " s")


class DeadlineMissed(Exception):
    """A step was refused at its latest start (``deadlines.on_deadline: refuse``):
    the route answers 504, which SandboxFusion's clients retry."""


def step_deadlines(deadline_at: float | None, req: RunCodeRequest, compiles: bool,
                   default_timeout_s: float, files_s: float) -> dict[str, float | None]:
    """Each step's deadline (``time.monotonic()``): the request's, less the time
    reserved for the steps after it (a run's timeout before the run, ``FILES_NEED_S``
    before a fetch), so each step starts by when the rest can still be answered in
    time. A files step (write, fetch) is expected to take ``FILES_NEED_S`` at most,
    not its ``files_s`` limit: its deadline is moved by the difference, so that its
    latest start (deadline less limit) leaves it that long."""
    if deadline_at is None:
        return dict.fromkeys(("write", "compile", "run", "fetch"))
    run_at = deadline_at - (FILES_NEED_S if req.fetch_files else 0.0)
    compile_at = run_at - (req.run_timeout or default_timeout_s)
    write_at = compile_at - ((req.compile_timeout or default_timeout_s) if compiles else 0.0)
    files = files_s - FILES_NEED_S
    return {"write": write_at + files, "compile": compile_at, "run": run_at,
            "fetch": deadline_at + files}


async def run_code(service: Service, req: RunCodeRequest, context: dict[str, Any], *,
                   language: Language | None = None,
                   ids: list[str] | None = None,
                   deadline_at: float | None = None,
                   streams: list[FetchStream] | None = None) -> RunCodeResponse:
    """Run one ``/run_code`` request through the service's dispatcher: its files
    written, its code compiled (if the language compiles) and run, its ``fetch_files``
    read back, each step an action of the request's trajectory (see :mod:`.files`).

    Args:
        service: the service (its dispatcher and settings).
        req: the request.
        context: trajectory fields from the headers (the request's own override them).
        language: run as this language, offered or not (the start-up probes).
        ids: the id of each action submitted is appended here (what a cancel names).
        deadline_at: when the caller stops waiting (``time.monotonic()``; None: the
            dispatcher's default deadline, if any): each step gets its share of it.
        streams: where fetched files too large for one command's output go, as a
            :class:`~metasched.serve.files.FetchStream` to answer with (the answer's
            ``files`` then empty; the trajectory then ends with the stream); None: such
            files are named in ``fetch_errors`` instead.

    Raises:
        DeadlineMissed: a step was refused at its latest start.
    """
    lang = language or service.languages.get(req.language)
    if lang is None:
        why = service.unavailable.get(req.language)
        offered = ", ".join(sorted(service.languages)) or "none"
        return RunCodeResponse(status="SandboxError", message=(
            f"language: {req.language!r} is not offered here"
            + (f" ({why})" if why else "") + f" (offered: {offered})"))
    given = trajectory_fields(req, context)
    trajectory = given.get("trajectory") or f"run-{uuid.uuid4().hex}"
    layout = lang.layout(uuid.uuid4().hex[:12])
    inputs = {path: content for path, content in req.files.items() if content is not None}
    inputs[layout.source] = base64.b64encode(req.code.encode()).decode()
    if req.stdin:
        inputs[layout.stdin] = base64.b64encode(req.stdin.encode()).decode()
    common: dict[str, Any] = {
        "kind": "cpu", "trajectory": trajectory, "turn": given.get("turn", 0),
        "task": given.get("task") or service.config.task, "prompt": given.get("prompt")}
    if req.memory_limit_MB > 0:  # else the dispatcher's default (limits.mem_mb)
        common["mem_limit_mb"] = req.memory_limit_MB
    files_s = min(FILES_TIMEOUT_S, service.limits.max_timeout_s)
    deadlines = step_deadlines(deadline_at, req, lang.compile_argv(layout) is not None,
                               service.limits.timeout_s, files_s)
    compiled: CommandRunResult | None = None
    ran: CommandRunResult | None = None
    fetched: dict[str, str] = {}
    unfetched: dict[str, str] = {}
    # A request's own trajectory ends with it (its workspace too); a named one stays.
    close = (lambda _: None) if "trajectory" in given else service.dispatcher.close_trajectory
    streaming = False  # the trajectory then ends with the answer's stream


    async def step(argv: list[str], name: str, timeout_s: float, **extra: Any) -> Result:
        rid = uuid.uuid4().hex
        if ids is not None:
            ids.append(rid)
        at = deadlines[name]
        if at is not None:  # what is left of it (a step past it starts when it can)
            extra["deadline_s"] = max(1e-3, at - time.monotonic())
        r = await service.submit({**common, "argv": argv, "name": f"{lang.name}:{name}",
                                  "timeout_s": timeout_s, "id": rid, **extra})
        if r.status == FAILED and r.reason.startswith(DEADLINE_REASON):
            raise DeadlineMissed(f"{lang.name}:{name}: {r.reason}")
        return r

    try:
        for argv in write_argvs(inputs):
            r = await step(argv, "write", files_s)
            if not r.ok:
                return RunCodeResponse(status="SandboxError", message=(
                    f"files: could not be written: {r.reason}: {r.stderr.strip()[-300:]}"
                    if r.stderr.strip() else f"files: could not be written: {r.reason}"))
        argv = lang.compile_argv(layout)
        if argv is not None:
            r = await step(argv, "compile", req.compile_timeout)
            if r.status == REJECTED:
                return RunCodeResponse(status="SandboxError", message=r.reason)
            compiled = command_result(r)
        if compiled is None or (compiled.status == "Finished" and compiled.return_code == 0):
            argv = lang.run_argv(layout)
            r = await step(stdin_argv(layout.stdin, argv) if req.stdin else argv, "run",
                           req.run_timeout, reward=bool(given.get("reward")))
            if r.status == REJECTED:
                return RunCodeResponse(status="SandboxError", message=r.reason,
                                       compile_result=compiled)
            ran = command_result(r)
        if req.fetch_files:
            kept = kept_output(service.dispatcher)
            r = await step(fetch_argv(list(req.fetch_files), answer_chars=kept - 64,
                                      cap=service.config.max_file_bytes), "fetch", files_s)
            try:
                if not r.ok:  # the command's last line only: never a traceback
                    last = (r.stderr.strip().splitlines() or [""])[-1][-300:]
                    raise ValueError(f"{r.reason}: {last}" if last else r.reason)
                got = parse_fetched(r.stdout)
            except ValueError as e:
                return RunCodeResponse(status="SandboxError", message=f"fetch_files: {e}",
                                       compile_result=compiled, run_result=ran)
            fetched, unfetched = got.files, got.errors
            # No deadline for the pieces: the answer has begun, its caller reads it.
            streaming = stream_large(got, list(req.fetch_files), streams, lambda argv: (
                service.submit({**common, "argv": argv, "name": f"{lang.name}:fetch",
                                "id": uuid.uuid4().hex, "timeout_s": files_s})),
                kept, lambda: close(trajectory))
            fetched = {} if streaming else fetched
    finally:
        if not streaming:
            close(trajectory)
    status, message = run_status(compiled, ran)
    return RunCodeResponse(status=status, message=message, compile_result=compiled,
                           run_result=ran, files=fetched, fetch_errors=unfetched)


async def probe_languages(service: Service, names: list[str] | None
                          ) -> tuple[dict[str, Language], dict[str, str]]:
    """Which languages work here: each one's tools on PATH, then its probe program run
    as a request would be. Returns the working ones and, for the others, why not.

    Raises:
        ConfigError: a language asked for by name (``names``) is unknown or does not
            work here.
    """
    wanted = list(LANGUAGES) if names is None else names
    for name in wanted:
        if name not in LANGUAGES:
            raise ConfigError("languages", f"unknown language {name!r} (known: "
                              f"{', '.join(LANGUAGES)})")
    works: dict[str, Language] = {}
    why: dict[str, str] = {}
    if service.dispatcher.stats().get("trajectory_workspaces") is False:
        # A request's steps (files written, compile, run, fetch) are separate commands.
        why = dict.fromkeys(wanted, "commands have no trajectory workspace here (no "
                            "sandboxes: sandbox.isolation=none), so a request's steps "
                            "would not share its files")
    candidates = []
    for name in wanted:
        if name in why:
            continue
        missing = LANGUAGES[name].missing_tools()
        if missing:
            why[name] = f"not installed: {', '.join(missing)} not found on PATH"
        else:
            candidates.append(LANGUAGES[name])

    async def probe(lang: Language) -> None:
        resp = await run_code(service, RunCodeRequest(
            code=lang.probe, language=lang.name,
            compile_timeout=min(120.0, service.limits.max_timeout_s),
            run_timeout=min(60.0, service.limits.max_timeout_s),
            task="probe"), {}, language=lang)
        out = (resp.run_result.stdout or "") if resp.run_result is not None else ""
        if resp.status == "Success" and "ok" in out:
            works[lang.name] = lang
            return
        step = resp.run_result or resp.compile_result
        detail = resp.message or (step.stderr if step is not None else "") or resp.status
        if "command not found" in detail:  # on the host's PATH, not in the sandbox's
            found = [p for p in map(shutil.which, lang.tools) if p]
            detail += (f" in the sandbox (the host has {', '.join(found)}: install it under "
                       f"/usr, or add its directory to sandbox.system_paths)")
        why[lang.name] = f"its probe failed: {' '.join(detail.split())[:400]}"

    await asyncio.gather(*(probe(lang) for lang in candidates))
    if names is not None:
        for name in names:
            if name in why:
                raise ConfigError("languages", f"{name} does not work here: {why[name]}")
    return works, why


def run_code_router(service: Service) -> APIRouter:
    """The ``/run_code`` route (see the module docstring)."""
    router = APIRouter(route_class=JSONRoute)

    @router.post("/run_code", response_model=RunCodeResponse,
                 responses={**responses(*GATED, 403, 422),
                            504: {**REFUSED_504, "model": ErrorDetail}},
                 openapi_extra={"parameters": [*TRAJECTORY_HEADERS, DEADLINE_PARAM]})
    async def run_code_route(req: RunCodeRequest, request: Request):
        """SandboxFusion's run_code: compile and run one program (its files, stdin,
        compile and run timeouts) in the trajectory's sandbox; its answer as SandboxFusion
        gives it."""
        received = time.monotonic()
        try:
            context = context_from(request.headers).fields()
            given = trajectory_fields(req, context)
            check_caps(service.limits, req)
            wait_s = header_deadline(request.headers)
        except ConfigError as e:
            return error(422, str(e))
        if wait_s is None:
            wait_s = run_code_deadline(req.compile_timeout, req.run_timeout,
                                       service.limits.timeout_s)
        # None: each step gets the dispatcher's deadlines.default_s, if any.
        try:
            service.owners.claim(given.get("trajectory"), request.scope.get(CLIENT))
        except ConfigError as e:
            return error(403, str(e))
        await service.probed()  # the languages offered are known from then on
        client = request.scope.get(CLIENT)
        context = with_scoped_prompt(context, client)
        if req.prompt is not None:
            req = req.model_copy(update={"prompt": scoped_prompt(req.prompt, client)})
        ids: list[str] = []
        streams: list[FetchStream] = []
        try:
            resp = await unless_disconnected(
                request, run_code(service, req, context, ids=ids,
                                  deadline_at=None if wait_s is None else received + wait_s,
                                  streams=streams),
                lambda: [service.cancel(rid, "disconnect") for rid in ids])
        except Gone:
            return error(499, "client disconnected: its actions were cancelled")
        except DeadlineMissed as e:
            service.metrics.run_code.labels(req.language if req.language in LANGUAGES
                                            else "other", "Timeout").inc()
            return error(504, str(e))
        except BaseException:  # the handler cancelled (the server stops)
            for stream in streams:
                stream.close()
            raise
        service.metrics.run_code.labels(req.language if req.language in LANGUAGES
                                        else "other", resp.status).inc()
        # Files larger than one command's output: the answer streams as they are read.
        return streams[0].response(resp) if streams else resp

    return router
