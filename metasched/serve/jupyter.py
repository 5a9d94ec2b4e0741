"""``POST /run_jupyter``: SandboxFusion's stateful route, its cells run in a kernel kept
per trajectory (:mod:`metasched.runtime.dispatch.kernels`).

Request (JSON): ``cells`` (the code of each cell, required), ``cell_timeout`` (seconds
one cell may run; 0: bounded only by the total), ``total_timeout`` (seconds for all the
cells, 45 as in SandboxFusion), ``memory_limit_MB`` (the kernel's; -1: the dispatcher's
``limits.mem_mb``), ``kernel`` (``python3``), ``files`` (path -> base64, written into
the workspace first), ``fetch_files`` (read back after the cells), and the trajectory
fields of ``/run_code`` (``trajectory``, ``turn``, ``task``, ``reward``, ``prompt``, or
the ``X-Trajectory-Id`` ... headers).

Without a trajectory, the cells run in a fresh kernel, ended with the request (as
SandboxFusion does). With one, the kernel, its variables and its workspace persist
across that trajectory's requests (a notebook of 50-100 cells sent a few at a time), and
end with the trajectory (its close, its reward action, or its idle time); ``reward``
true closes it once the request is answered.

Response: ``status`` (``Success``: every cell ran, errors in a cell included;
``Failed``: a cell ran out of time or the kernel died; ``SandboxError``: the sandbox
could not run it), ``message``, ``driver`` (how the run as a whole ended: ``status``
``Finished``, ``TimeLimitExceeded`` or ``Error``, ``execution_time``), ``cells`` (each
cell run: ``stdout``, ``stderr``, ``display`` (a last bare expression's value,
``{"text/plain": repr}``), ``error`` (Jupyter's error content: ``ename``, ``evalue``,
``traceback``)), ``files`` and ``fetch_errors`` as ``/run_code``'s.

Each cell is one ``cpu`` action of the trajectory (``jupyter:cell``): queued, granted a
core, journaled and timed out as any other; the writes and the fetch are actions too.
A cell's output is cut to what a command keeps (the dispatcher's ``tail_bytes``),
keeping its end. A client that disconnects cancels the request as for ``/run_code``.
"""

from __future__ import annotations

import asyncio
import base64
import json
import uuid
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import APIRouter, Request
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from metasched.errors import ConfigError
from metasched.runtime.dispatch.kernels import CELL_CLIENT, DRIVER, DRIVER_PATH, SOCKET
from metasched.runtime.requests import Flag, Result, Text, TrajectoryId, Turn
from metasched.serve.bodies import JSONRoute
from metasched.serve.context import context_from
from metasched.serve.disconnect import Gone, unless_disconnected
from metasched.serve.files import (
    FetchStream,
    fetch_argv,
    kept_output,
    parse_fetched,
    stream_large,
    write_argvs,
)
from metasched.serve.native import error
from metasched.serve.openapi import GATED, TRAJECTORY_HEADERS, responses
from metasched.serve.ownership import scoped_prompt, with_scoped_prompt
from metasched.serve.sandbox_fusion import (
    FILES_TIMEOUT_S,
    CommandRunResult,
    RunStatus,
    _base64,
    trajectory_fields,
)
from metasched.serve.security import CLIENT

if TYPE_CHECKING:
    from metasched.serve.service import Service

__all__ = ["CellRunResult", "RunJupyterRequest", "RunJupyterResponse", "jupyter_router",
           "run_jupyter"]

PYTHON = "python3"
KERNEL_START_S = 10.0  # how long a cell waits for a kernel just started to listen
KERNEL_LIFETIME_S = 7 * 24 * 3600.0  # a kernel's bound (its trajectory ends it first)


class RunJupyterRequest(BaseModel):
    """SandboxFusion's ``RunJupyterRequest``, plus the trajectory fields."""

    model_config = ConfigDict(extra="ignore")

    cells: list[str]
    cell_timeout: float = Field(0.0, ge=0.0, le=30 * 24 * 3600.0)
    total_timeout: float = Field(45.0, gt=0.0, le=30 * 24 * 3600.0)
    memory_limit_MB: int = Field(-1, ge=-1)  # noqa: N815 - SandboxFusion's name
    kernel: Literal["python3"] = "python3"
    files: dict[Text, Annotated[str | None, AfterValidator(_base64)]] = Field(
        default_factory=dict)
    fetch_files: list[str] = Field(default_factory=list)
    trajectory: TrajectoryId = None
    turn: Turn | None = None
    task: Text | None = None
    reward: Flag | None = None
    prompt: TrajectoryId = None


class CellRunResult(BaseModel):
    """One cell's output, as Jupyter's messages give it."""

    stdout: str = ""
    stderr: str = ""
    display: list[dict[str, Any]] = Field(default_factory=list)
    error: list[dict[str, Any]] = Field(default_factory=list)


class RunJupyterResponse(BaseModel):
    """SandboxFusion's ``RunJupyterResponse``."""

    status: RunStatus
    message: str = ""
    driver: CommandRunResult | None = None
    cells: list[CellRunResult] = Field(default_factory=list)
    files: dict[str, str] = Field(default_factory=dict)
    fetch_errors: dict[str, str] = Field(default_factory=dict)


def _cell(result: Result) -> tuple[CellRunResult, str]:
    """A cell action's result: the cell's output, and how it ended (``ok``, ``error``,
    ``timeout``; ``died``: the kernel ended under it; ``stuck``: the action's own time
    limit ended it)."""
    if result.ok:
        try:
            doc = json.loads(result.stdout)
            status = doc.pop("status")
            return CellRunResult(**doc), status
        except (ValueError, KeyError, TypeError):
            why = "its answer was cut (more output than the dispatcher keeps)"
    else:
        why = (result.stderr.strip().splitlines() or [result.reason])[-1]
    stuck = result.reason.startswith("timeout")
    return CellRunResult(error=[{"ename": "TimeoutError" if stuck else "KernelError",
                                 "evalue": why, "traceback": []}]), \
        "stuck" if stuck else "died"


async def run_jupyter(service: Service, req: RunJupyterRequest, context: dict[str, Any], *,
                      ids: list[str] | None = None,
                      streams: list[FetchStream] | None = None) -> RunJupyterResponse:
    """Run one ``/run_jupyter`` request (see the module docstring); ``ids`` collects the
    ids of the actions submitted (what a cancel names), ``streams`` the fetched files
    too large for one command's output, as ``/run_code``'s
    (:func:`~metasched.serve.sandbox_fusion.run_code`)."""
    kernels = getattr(service.dispatcher, "kernels", None)
    if kernels is None:
        return RunJupyterResponse(status="SandboxError", message="kernels run only on a "
                                  "dispatcher of this process (the local backend)")
    given = trajectory_fields(req, context)
    trajectory = given.get("trajectory") or f"jupyter-{uuid.uuid4().hex}"
    common: dict[str, Any] = {"kind": "cpu", "trajectory": trajectory,
                              "turn": given.get("turn", 0),
                              "task": given.get("task") or service.config.task,
                              "prompt": given.get("prompt")}
    tail = kept_output(service.dispatcher)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    files_s = min(FILES_TIMEOUT_S, service.limits.max_timeout_s)

    async def step(argv: list[str], name: str, timeout_s: float) -> Result:
        rid = uuid.uuid4().hex
        if ids is not None:
            ids.append(rid)
        return await service.submit({**common, "argv": argv, "name": f"jupyter:{name}",
                                     "timeout_s": timeout_s, "id": rid})

    def close() -> None:
        if "trajectory" not in given or given.get("reward"):
            service.dispatcher.close_trajectory(trajectory)  # the kernel goes with it

    streaming = False  # the trajectory then ends with the answer's stream
    inputs = {p: c for p, c in req.files.items() if c is not None}
    inputs[DRIVER_PATH] = base64.b64encode(DRIVER.encode()).decode()
    cells: list[CellRunResult] = []
    driver = "Finished"
    message = ""
    fetched: dict[str, str] = {}
    unfetched: dict[str, str] = {}
    try:
        for argv in write_argvs(inputs, PYTHON):
            r = await step(argv, "write", files_s)
            if not r.ok:
                return RunJupyterResponse(status="SandboxError", message=(
                    f"files: could not be written: {r.reason}"))
        why = kernels.start(trajectory, python=PYTHON, lifetime_s=KERNEL_LIFETIME_S,
                            mem_limit_mb=req.memory_limit_MB if req.memory_limit_MB > 0
                            else None)
        if why is not None:
            return RunJupyterResponse(status="SandboxError", message=f"kernel: {why}")
        for code in req.cells:
            left = req.total_timeout - (loop.time() - t0)
            if left <= 0:
                driver, message = "TimeLimitExceeded", "total_timeout: the cells ran past it"
                break
            limit = min(req.cell_timeout, left) if req.cell_timeout > 0 else left
            body = json.dumps({"code": code, "timeout": limit, "max_bytes": tail})
            r = await step([PYTHON, "-c", CELL_CLIENT, body, str(KERNEL_START_S), SOCKET],
                           "cell", min(limit + KERNEL_START_S + 2.0,
                                       service.limits.max_timeout_s))
            cell, how = _cell(r)
            cells.append(cell)
            if how in ("timeout", "stuck"):
                driver = "TimeLimitExceeded"
                message = f"cell {len(cells) - 1}: ran past its time limit ({limit:g} s)"
                if how == "stuck":
                    kernels.stop(trajectory, "")  # deaf to its alarm: a new kernel next time
                break
            if how == "died":
                driver, message = "Error", f"cell {len(cells) - 1}: {cell.error[0]['evalue']}"
                break
        if req.fetch_files:
            r = await step(fetch_argv(list(req.fetch_files), PYTHON, answer_chars=tail - 64,
                                      cap=service.config.max_file_bytes), "fetch", files_s)
            try:
                if not r.ok:
                    raise ValueError(r.reason)
                got = parse_fetched(r.stdout)
            except ValueError as e:
                return RunJupyterResponse(status="SandboxError", message=f"fetch_files: {e}",
                                          cells=cells)
            fetched, unfetched = got.files, got.errors
            streaming = stream_large(got, list(req.fetch_files), streams,
                                     lambda argv: step(argv, "fetch", files_s), tail, close,
                                     PYTHON)
            fetched = {} if streaming else fetched
    finally:
        if not streaming:
            close()
    took = loop.time() - t0
    return RunJupyterResponse(
        status="Success" if driver == "Finished" else "Failed", message=message,
        driver=CommandRunResult(status=driver, execution_time=took,
                                return_code=0 if driver == "Finished" else None,
                                stdout="", stderr=message),
        cells=cells, files=fetched, fetch_errors=unfetched)


def jupyter_router(service: Service) -> APIRouter:
    """The ``/run_jupyter`` route (see the module docstring)."""
    router = APIRouter(route_class=JSONRoute)

    @router.post("/run_jupyter", response_model=RunJupyterResponse,
                 responses=responses(*GATED, 403, 422),
                 openapi_extra={"parameters": TRAJECTORY_HEADERS})
    async def run_jupyter_route(req: RunJupyterRequest, request: Request):
        """SandboxFusion's run_jupyter: run cells in order in one Python kernel, each
        cell's output and the kernel's state kept across them."""
        try:
            context = context_from(request.headers).fields()
            given = trajectory_fields(req, context)
            limits = service.limits
            if req.memory_limit_MB > 0:
                limits.cap(req.memory_limit_MB, "memory_limit_MB", "max_mem_mb", " MiB")
            limits.cap(req.total_timeout, "total_timeout", "max_timeout_s", " s")
        except ConfigError as e:
            return error(422, str(e))
        try:
            service.owners.claim(given.get("trajectory"), request.scope.get(CLIENT))
        except ConfigError as e:
            return error(403, str(e))
        context = with_scoped_prompt(context, request.scope.get(CLIENT))
        if req.prompt is not None:
            req = req.model_copy(update={"prompt": scoped_prompt(
                req.prompt, request.scope.get(CLIENT))})
        ids: list[str] = []
        streams: list[FetchStream] = []
        try:
            resp = await unless_disconnected(
                request, run_jupyter(service, req, context, ids=ids, streams=streams),
                lambda: [service.cancel(rid, "disconnect") for rid in ids])
        except Gone:
            return error(499, "client disconnected: its actions were cancelled")
        except BaseException:  # the handler cancelled (the server stops)
            for stream in streams:
                stream.close()
            raise
        return streams[0].response(resp) if streams else resp

    return router
