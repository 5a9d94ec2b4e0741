"""A small client of ``metasched-serve`` (httpx): :class:`Client` (blocking) and
:class:`AsyncClient` (asyncio), with trajectory context.

::

    from metasched.client import Client

    with Client("http://127.0.0.1:8080") as client:
        with client.trajectory("t-17", task="swe") as t:
            r = t.run(argv=["python3", "-c", "print(2 ** 100)"], max_cores=4)
            print(r.status, r.stdout)
            out = t.run_code("print(1 + 1)")            # SandboxFusion's /run_code
            t.run(argv=["python3", "-m", "unittest", "-q"], reward=True)  # the last one

``run`` submits a request (the dispatcher's JSON; ``kind`` is ``cpu`` when ``argv`` is
given, ``timeout_s`` the client's default when not) and returns its
:class:`~metasched.runtime.requests.Result`; ``submit`` returns its id once it is
durable, ``result(id)`` the result or None, ``cancel(id)`` cancels it. In a trajectory
each action gets the trajectory's name, task, prompt (GRPO's responses to one prompt
share it: ``client.trajectory(name, prompt="p-3")``) and the next turn. Bad input comes back as
a ``rejected`` result, as from the dispatcher itself; a refused HTTP request (authentication, size)
raises :class:`ServiceError`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import httpx

from metasched.runtime.requests import Result

__all__ = ["AsyncClient", "AsyncTrajectory", "Client", "ServiceError", "Trajectory"]

_POLL_S = 60.0  # one long poll (the service answers sooner when the result is in)
_SLACK_S = 30.0  # HTTP timeout beyond the time the service is asked to wait


class ServiceError(Exception):
    """The service refused a request (e.g. 401: a missing token; 413: too large).

    Attributes:
        status: the HTTP status.
        detail: the service's one-line reason.
    """

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"HTTP {status}: {detail}")
        self.status, self.detail = status, detail


def _request(fields: Mapping[str, Any], default_timeout_s: float | None,
             context: Mapping[str, Any]) -> dict[str, Any]:
    doc = {**context, **fields}
    if "kind" not in doc and "argv" in doc:
        doc["kind"] = "cpu"
    if default_timeout_s is not None:
        doc.setdefault("timeout_s", default_timeout_s)
    doc.setdefault("id", uuid.uuid4().hex)
    return doc


def _parse(resp: httpx.Response) -> Result | None:
    """The result in a response, None for a request not finished yet."""
    if resp.status_code in (200, 422) and resp.headers.get("content-type", "").startswith(
            "application/json"):
        doc = resp.json()
        if isinstance(doc, dict) and "status" in doc and doc["status"] in (
                "done", "failed", "rejected", "cancelled"):
            return Result(**doc)
    if resp.status_code in (200, 202) and resp.json().get("status") in ("queued", "running"):
        return None
    _raise(resp)
    raise AssertionError("unreachable")


def _cancelled(resp: httpx.Response) -> str:
    """What a cancel answered (``status``)."""
    if resp.status_code != 200:
        _raise(resp)
    return str(resp.json()["status"])


def _raise(resp: httpx.Response) -> None:
    try:
        detail = resp.json().get("detail", resp.text)
    except ValueError:
        detail = resp.text
    raise ServiceError(resp.status_code, str(detail))


def _headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def _trajectory_headers(context: Mapping[str, Any]) -> dict[str, str]:
    out = {"X-Trajectory-Id": str(context["trajectory"]), "X-Turn": str(context["turn"])}
    if context.get("task") is not None:
        out["X-Task"] = str(context["task"])
    if context.get("prompt") is not None:
        out["X-Prompt-Id"] = str(context["prompt"])
    return out


class Client:
    """A blocking client of one service.

    Args:
        url: the service's base URL, e.g. ``http://127.0.0.1:8080``.
        token: its bearer token (None: none).
        default_timeout_s: ``timeout_s`` of a request that does not give one (None:
            the service's default, its ``limits.timeout_s``; at most its
            ``limits.max_timeout_s`` either way).
        transport: an httpx transport (tests).
    """

    def __init__(self, url: str, *, token: str | None = None,
                 default_timeout_s: float | None = 600.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.default_timeout_s = default_timeout_s
        self._http = httpx.Client(base_url=url, headers=_headers(token), transport=transport,
                                  timeout=httpx.Timeout(_SLACK_S))

    def __enter__(self) -> Client:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def submit(self, request: Mapping[str, Any] | None = None, /, **fields: Any) -> str:
        """Submit one request; returns its id once it is durable (or rejected: its
        result then says why)."""
        doc = _request({**(request or {}), **fields}, self.default_timeout_s, {})
        _parse(self._http.post("/v1/actions", json=doc))
        return doc["id"]

    def run(self, request: Mapping[str, Any] | None = None, /, *,
            wait_s: float | None = None, **fields: Any) -> Result:
        """Submit one request and wait for its result (at most ``wait_s``: then
        TimeoutError; None: as long as it takes)."""
        return self._run({**(request or {}), **fields}, {}, wait_s)

    def _run(self, fields: Mapping[str, Any], context: Mapping[str, Any],
             wait_s: float | None) -> Result:
        doc = _request(fields, self.default_timeout_s, context)
        if wait_s is not None:  # when this caller stops waiting (metasched.serve.deadlines)
            doc.setdefault("deadline_s", wait_s)
        deadline = None if wait_s is None else time.monotonic() + wait_s
        first = _POLL_S if wait_s is None else min(_POLL_S, wait_s)
        resp = self._http.post("/v1/actions", json=doc, params={"wait": first},
                               timeout=first + _SLACK_S)
        result = _parse(resp)
        return result if result is not None else self.wait(doc["id"], deadline=deadline)

    def result(self, rid: str, *, wait_s: float = 0.0) -> Result | None:
        """The result of request ``rid``, None while it is unfinished (waiting up to
        ``wait_s`` for it). Raises ServiceError (404) for an unknown id."""
        resp = self._http.get(f"/v1/actions/{rid}", params={"wait": wait_s},
                              timeout=wait_s + _SLACK_S)
        return _parse(resp)

    def wait(self, rid: str, *, deadline: float | None = None) -> Result:
        """Poll until request ``rid`` has finished (``deadline``: a time.monotonic()
        after which TimeoutError is raised)."""
        while True:
            left = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
            if left <= 0:
                raise TimeoutError(f"request {rid} did not finish in time")
            result = self.result(rid, wait_s=left)
            if result is not None:
                return result

    def cancel(self, rid: str) -> str:
        """Cancel request ``rid`` (dropped if queued, its command killed if running; its
        result then says ``cancelled``). Returns what was done: ``cancelled``,
        ``cancelling`` (killed; its result follows), ``finished`` (it had ended) or
        ``running`` (an api call or gpu batch: it runs to its end). Raises ServiceError
        (404) for an unknown id."""
        return _cancelled(self._http.post(f"/v1/actions/{rid}/cancel"))

    def run_code(self, code: str, language: str = "python", **fields: Any) -> dict[str, Any]:
        """SandboxFusion's ``/run_code``: the response as a dict (``status``,
        ``run_result`` ...)."""
        return self._run_code({"code": code, "language": language, **fields}, {})

    def _run_code(self, body: Mapping[str, Any], headers: Mapping[str, str]) -> dict[str, Any]:
        # No HTTP timeout: under load the request queues in the service for as long as
        # it takes (the compile and run timeouts bound it from its start).
        resp = self._http.post("/run_code", json=dict(body), headers=dict(headers),
                               timeout=None)
        if resp.status_code != 200:
            _raise(resp)
        return resp.json()

    def status(self) -> dict[str, Any]:
        """``GET /v1/status``: pools, queue, utilisation, the policy in use."""
        resp = self._http.get("/v1/status")
        if resp.status_code != 200:
            _raise(resp)
        return resp.json()

    def close_trajectory(self, name: str) -> None:
        """End trajectory ``name`` (its sandbox and workspace go once nothing of it
        runs)."""
        resp = self._http.post(f"/v1/trajectories/{name}/close")
        if resp.status_code != 200:
            _raise(resp)

    def trajectory(self, name: str | None = None, *, task: str | None = None,
                   turn: int = 0, prompt: str | None = None) -> Trajectory:
        """A trajectory's context (a fresh name when None): its actions carry its name,
        ``task``, ``prompt`` (the prompt it answers; GRPO's responses to one prompt
        share it) and successive turns from ``turn``; leaving the ``with`` block closes
        it."""
        return Trajectory(self, name or f"traj-{uuid.uuid4().hex[:12]}", task, turn, prompt)


class Trajectory:
    """One trajectory's actions through a :class:`Client` (see
    :meth:`Client.trajectory`)."""

    def __init__(self, client: Client, name: str, task: str | None, turn: int,
                 prompt: str | None = None) -> None:
        self.client, self.name, self.task, self.turn = client, name, task, turn
        self.prompt = prompt
        self.closed = False

    def _context(self) -> dict[str, Any]:
        ctx = {"trajectory": self.name, "turn": self.turn}
        if self.task is not None:
            ctx["task"] = self.task
        if self.prompt is not None:
            ctx["prompt"] = self.prompt
        self.turn += 1
        return ctx

    def run(self, request: Mapping[str, Any] | None = None, /, *,
            wait_s: float | None = None, **fields: Any) -> Result:
        """:meth:`Client.run` as the trajectory's next turn (``reward=True``: its
        last)."""
        fields = {**(request or {}), **fields}
        result = self.client._run(fields, self._context(), wait_s)
        self.closed = self.closed or bool(fields.get("reward"))
        return result

    def run_code(self, code: str, language: str = "python", **fields: Any) -> dict[str, Any]:
        """:meth:`Client.run_code` as the trajectory's next turn (in its workspace)."""
        return self.client._run_code({"code": code, "language": language, **fields},
                                     _trajectory_headers(self._context()))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.client.close_trajectory(self.name)

    def __enter__(self) -> Trajectory:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class AsyncClient:
    """:class:`Client` for asyncio: the same methods, awaited."""

    def __init__(self, url: str, *, token: str | None = None,
                 default_timeout_s: float | None = 600.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.default_timeout_s = default_timeout_s
        self._http = httpx.AsyncClient(base_url=url, headers=_headers(token),
                                       transport=transport, timeout=httpx.Timeout(_SLACK_S))

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    async def submit(self, request: Mapping[str, Any] | None = None, /, **fields: Any) -> str:
        doc = _request({**(request or {}), **fields}, self.default_timeout_s, {})
        _parse(await self._http.post("/v1/actions", json=doc))
        return doc["id"]

    async def run(self, request: Mapping[str, Any] | None = None, /, *,
                  wait_s: float | None = None, **fields: Any) -> Result:
        return await self._run({**(request or {}), **fields}, {}, wait_s)

    async def _run(self, fields: Mapping[str, Any], context: Mapping[str, Any],
                   wait_s: float | None) -> Result:
        doc = _request(fields, self.default_timeout_s, context)
        if wait_s is not None:  # when this caller stops waiting (metasched.serve.deadlines)
            doc.setdefault("deadline_s", wait_s)
        deadline = None if wait_s is None else time.monotonic() + wait_s
        first = _POLL_S if wait_s is None else min(_POLL_S, wait_s)
        resp = await self._http.post("/v1/actions", json=doc, params={"wait": first},
                                     timeout=first + _SLACK_S)
        result = _parse(resp)
        return result if result is not None else await self.wait(doc["id"], deadline=deadline)

    async def result(self, rid: str, *, wait_s: float = 0.0) -> Result | None:
        resp = await self._http.get(f"/v1/actions/{rid}", params={"wait": wait_s},
                                    timeout=wait_s + _SLACK_S)
        return _parse(resp)

    async def wait(self, rid: str, *, deadline: float | None = None) -> Result:
        while True:
            left = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
            if left <= 0:
                raise TimeoutError(f"request {rid} did not finish in time")
            result = await self.result(rid, wait_s=left)
            if result is not None:
                return result

    async def cancel(self, rid: str) -> str:
        return _cancelled(await self._http.post(f"/v1/actions/{rid}/cancel"))

    async def run_code(self, code: str, language: str = "python",
                       **fields: Any) -> dict[str, Any]:
        return await self._run_code({"code": code, "language": language, **fields}, {})

    async def _run_code(self, body: Mapping[str, Any],
                        headers: Mapping[str, str]) -> dict[str, Any]:
        resp = await self._http.post("/run_code", json=dict(body), headers=dict(headers),
                                     timeout=None)
        if resp.status_code != 200:
            _raise(resp)
        return resp.json()

    async def status(self) -> dict[str, Any]:
        resp = await self._http.get("/v1/status")
        if resp.status_code != 200:
            _raise(resp)
        return resp.json()

    async def close_trajectory(self, name: str) -> None:
        resp = await self._http.post(f"/v1/trajectories/{name}/close")
        if resp.status_code != 200:
            _raise(resp)

    def trajectory(self, name: str | None = None, *, task: str | None = None,
                   turn: int = 0, prompt: str | None = None) -> AsyncTrajectory:
        return AsyncTrajectory(self, name or f"traj-{uuid.uuid4().hex[:12]}", task, turn,
                               prompt)


class AsyncTrajectory(Trajectory):
    """:class:`Trajectory` for an :class:`AsyncClient` (``async with``)."""

    client: AsyncClient  # type: ignore[assignment]

    async def run(self, request: Mapping[str, Any] | None = None, /, *,  # type: ignore[override]
                  wait_s: float | None = None, **fields: Any) -> Result:
        fields = {**(request or {}), **fields}
        result = await self.client._run(fields, self._context(), wait_s)
        self.closed = self.closed or bool(fields.get("reward"))
        return result

    async def run_code(self, code: str, language: str = "python",  # type: ignore[override]
                       **fields: Any) -> dict[str, Any]:
        return await self.client._run_code({"code": code, "language": language, **fields},
                                           _trajectory_headers(self._context()))

    async def close(self) -> None:  # type: ignore[override]
        if not self.closed:
            self.closed = True
            await self.client.close_trajectory(self.name)

    async def __aenter__(self) -> AsyncTrajectory:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

