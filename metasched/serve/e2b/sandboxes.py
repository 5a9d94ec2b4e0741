"""E2B sandboxes over the dispatcher: each :class:`Sandbox` is one trajectory
(``e2b-<id>``), its workspace the sandbox's filesystem, each of its commands and file
calls an action of it (:meth:`Sandbox.run`). :class:`Sandboxes` keeps them: it creates
them, finds them for a client, and ends them when killed, at their timeout (E2B's: so
many seconds from creation or the last ``set_timeout``) or when idle for the
dispatcher's ``trajectory_idle_s``. Ending one signals its running processes to die
(through their watchers, :mod:`.programs`) and closes its trajectory: the dispatcher
then removes its sandbox and workspace once nothing of it runs.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import math
import secrets
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from metasched.runtime.requests import REJECTED, Result
from metasched.serve.e2b import programs
from metasched.serve.e2b.templates import E2BTemplate, template_env

if TYPE_CHECKING:
    from metasched.serve.e2b.output import Output
    from metasched.serve.service import Service

__all__ = ["BUILT_IN_TEMPLATES", "CREATE_S", "DEFAULT_TEMPLATE", "ENVD_VERSION", "AtCap", "Busy",
           "Proc", "Sandbox", "Sandboxes"]

log = logging.getLogger("metasched.serve")

ENVD_VERSION = "0.5.7"  # the envd contract served (stdin, close_stdin, octet-stream upload)
DEFAULT_TEMPLATE = "base"  # E2B's default: a plain workspace
# Built in: plain workspaces too (code-interpreter-v1 also serves the code interpreter,
# see .interpreter), unless the operator configures a template of the same name.
BUILT_IN_TEMPLATES = (DEFAULT_TEMPLATE, "code-interpreter-v1")
DEFAULT_TIMEOUT_S = 300  # E2B's default sandbox timeout
MAX_TIMEOUT_S = 24 * 3600
CORES_ENV = "METASCHED_CORES"  # sandbox env vars that size its commands
MEMORY_ENV = "METASCHED_MEMORY_MB"
FILES_TIMEOUT_S = 60.0
CREATE_S = 10.0  # a create answers within this: a sandbox, or 503 (busy)


class Busy(Exception):
    """A sandbox could not be created in time (503, with the reason)."""


class AtCap(Exception):
    """A client runs as many commands as it may (the reason: one line)."""


@dataclass
class Proc:
    """A process of a sandbox: one running action."""

    pid: int
    cmd: str
    args: list[str]
    envs: dict[str, str]
    cwd: str
    tag: str | None
    stdin: bool
    result: asyncio.Future[Result]
    output: Output | None = None  # its output as it comes (None: with its result)


@dataclass
class Sandbox:
    """One E2B sandbox (see the module docstring)."""

    id: str
    template: str
    client: str | None
    token: str | None  # the envd access token (None: authentication off)
    metadata: dict[str, str]
    env: dict[str, str]
    started_at: float  # wall clock
    end_at: float  # wall clock: its timeout
    cores: int
    memory_mb: float | None
    service: Service
    procs: dict[int, Proc] = field(default_factory=dict)
    last_used: float = field(default_factory=time.monotonic)
    _pids: Any = field(default_factory=lambda: itertools.count(1000))
    turn: int = 0  # its commands so far: each starts a turn, file calls are in it
    alive: bool = True
    door: bool = False  # made through SDK 1.x's door (see .sdk1_door)

    @property
    def trajectory(self) -> str:
        return f"e2b-{self.id}"

    @property
    def spec(self) -> E2BTemplate | None:
        """Its template's packages, network and env, where the operator wrote them
        (``e2b_templates``)."""
        return getattr(self.service.config, "e2b_templates", {}).get(self.template)

    def template_env(self) -> dict[str, str]:
        """What its template gives its commands' environment (its packages' paths)."""
        return template_env(self.template, self.spec,
                            getattr(self.service.config, "e2b_cache", None))

    def new_pid(self) -> int:
        """A new process id; the process starts the sandbox's next turn."""
        self.turn += 1
        return next(self._pids)

    def request(self, argv: list[str], name: str, *, timeout_s: float,
                env: Mapping[str, str] | None = None) -> dict[str, Any]:
        """The dispatcher request of one action of this sandbox."""
        self.last_used = time.monotonic()
        req: dict[str, Any] = {
            "kind": "cpu", "argv": argv, "trajectory": self.trajectory,
            "turn": self.turn, "task": f"e2b:{self.template}", "name": name,
            "timeout_s": min(timeout_s, self.service.limits.max_timeout_s),
            "min_cores": self.cores, "max_cores": self.cores,
            "id": uuid.uuid4().hex,
            # The sandbox lives in the service's memory: one that did not survive a
            # crash is gone with its commands, none of which runs again.
            "on_restart": "cancel"}
        spec = self.spec
        env = {**self.template_env(), **(env or {})}
        if env:
            req["env"] = env
        if spec is not None and spec.network:
            req["network"] = True
        if self.memory_mb is not None:
            req["mem_limit_mb"] = self.memory_mb
        # A workspace template: one configured (an E2B template's files among them), or
        # an unknown name (the dispatcher says so); built-in or files-less: none.
        if self.template in _configured(self.service) or (
                self.template not in BUILT_IN_TEMPLATES and spec is None):
            req["workspace_template"] = self.template
        return req

    async def run(self, argv: list[str], name: str, *,
                  timeout_s: float = FILES_TIMEOUT_S) -> Result:
        """Run one action of this sandbox and wait for its result."""
        return await self.service.submit(self.request(argv, name, timeout_s=timeout_s))

    def start(self, argv: list[str], name: str, *, timeout_s: float,
              env: Mapping[str, str] | None = None) -> asyncio.Future[Result]:
        """Submit one action of this sandbox; its result's future."""
        req = self.request(argv, name, timeout_s=timeout_s, env=env)
        future = self.service.dispatcher.accept(req)
        self.service.track(req["id"], future, "cpu")
        return future

    def info(self) -> dict[str, Any]:
        """As E2B's API describes a running sandbox (``SandboxDetail``)."""
        return {"templateID": self.template, "alias": self.template,
                "sandboxID": self.id, "clientID": "metasched",
                "startedAt": _iso(self.started_at), "endAt": _iso(self.end_at),
                "envdVersion": ENVD_VERSION, "cpuCount": self.cores,
                "memoryMB": int(self.memory_mb or self.service.limits.mem_mb),
                "diskSizeMB": 0,
                "metadata": self.metadata, "state": "running"}

    def created(self) -> dict[str, Any]:
        """As E2B's API answers a create or connect (``Sandbox``)."""
        out = {"templateID": self.template, "sandboxID": self.id, "clientID": "metasched",
               "envdVersion": ENVD_VERSION, "alias": self.template}
        if self.token is not None:
            out["envdAccessToken"] = self.token
        return out


def _configured(service: Service) -> Any:
    """The workspace templates the operator configured (none known: empty)."""
    config = getattr(service.dispatcher, "config", None)
    return getattr(getattr(config, "sandbox", None), "templates", None) or {}


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"


class Sandboxes:
    """The service's E2B sandboxes (see the module docstring).

    Args:
        service: the service (its dispatcher runs the sandboxes' actions).
        idle_s: a sandbox with no call and no running process for this long ends
            (None: the dispatcher's ``trajectory_idle_s``, else never).
    """

    def __init__(self, service: Service, idle_s: float | None = None) -> None:
        self.service = service
        self.idle_s = idle_s
        self.by_id: dict[str, Sandbox] = {}
        self._reaper: asyncio.Task[None] | None = None
        self._ending: set[asyncio.Task[None]] = set()

    # ---------------------------------------------------------------- lifecycle

    async def create(self, *, template: str, timeout_s: float, client: str | None,
                     metadata: Mapping[str, str], env: Mapping[str, str],
                     door: bool = False) -> Sandbox:
        """A new sandbox: its trajectory opened by a first action (its workspace made,
        its template checked: a ``ValueError`` says why it could not be). One made
        through SDK 1.x's door (``door``) always gets an access token: the door finds
        it by the token; with ``e2b_sdk1_replace`` it ends the door's earlier ones.

        Raises:
            ValueError: the sandbox could not be made (one line).
        """
        cores, memory = _sizes(env)
        now = time.time()
        sb = Sandbox(id=f"ms{uuid.uuid4().hex[:18]}", template=template, client=client,
                     token=secrets.token_urlsafe(24) if self.service.config.clients or door
                     else None,
                     metadata=dict(metadata), env=dict(env), started_at=now,
                     end_at=now + timeout_s, cores=cores, memory_mb=memory,
                     service=self.service, door=door)
        # Its trajectory is its client's: no other reaches it through /v1 or /run_code.
        self.service.owners.claim(sb.trajectory, client)
        # An empty sandbox needs no memory yet (each command is capped by its own
        # mem_limit_mb): with its caller's deadline CREATE_S, the dispatcher opens it past
        # the memory pool and starts its first command time-shared rather than let it
        # wait (its deadline rule); one still not created by then is refused, before the
        # SDK's request timeout (60 s), and never served late.
        req = sb.request(["/bin/mkdir", "-p", programs.CONTROL], "create",
                         timeout_s=CREATE_S)
        req["deadline_s"] = CREATE_S
        future = self.service.dispatcher.accept(req)
        self.service.track(req["id"], future, "cpu")
        try:
            r = await asyncio.wait_for(asyncio.shield(future), CREATE_S)
        except asyncio.TimeoutError:
            self.service.cancel(req["id"], "request")
            self.service.dispatcher.close_trajectory(sb.trajectory)
            raise Busy(f"sandbox could not be created within {CREATE_S:g} s (its first "
                       f"command had not run by then: the host is busy); retry later"
                       ) from None
        if not r.ok:
            self.service.dispatcher.close_trajectory(sb.trajectory)
            why = r.reason if r.status == REJECTED else (r.stderr.strip() or r.reason)
            raise ValueError(f"sandbox could not be created: {why}")
        self.by_id[sb.id] = sb
        if door and getattr(self.service.config, "e2b_sdk1_replace", False):
            for old in self.door_sandboxes():
                if old is not sb:
                    self.kill(old, "replaced by a newer sandbox through SDK 1.x's door")
        self._start_reaper()
        return sb

    def get(self, sandbox_id: str, client: str | None) -> Sandbox | None:
        """The live sandbox ``sandbox_id`` if ``client`` may use it (with
        authentication on, only the client that created it)."""
        sb = self.by_id.get(sandbox_id)
        if sb is None or not sb.alive or (self.service.config.clients
                                          and sb.client != client):
            return None
        return sb

    def by_token(self, sandbox_id: str, token: str | None) -> Sandbox | None:
        """The live sandbox ``sandbox_id`` if ``token`` is its envd access token (any
        token when authentication is off)."""
        sb = self.by_id.get(sandbox_id)
        if sb is None or not sb.alive:
            return None
        if sb.token is not None and not hmac.compare_digest(
                (token or "").encode(), sb.token.encode()):
            return None
        sb.last_used = time.monotonic()
        return sb

    def by_access_token(self, token: str) -> Sandbox | None:
        """The live sandbox whose envd access token is ``token`` (None: none)."""
        found = None
        for sb in list(self.by_id.values()):  # all of them: the time tells nothing
            if sb.alive and sb.token is not None and hmac.compare_digest(
                    token.encode(), sb.token.encode()):
                found = sb
        if found is not None:
            found.last_used = time.monotonic()
        return found

    def door_sandboxes(self) -> list[Sandbox]:
        """The live sandboxes made through SDK 1.x's door."""
        return [sb for sb in self.by_id.values() if sb.alive and sb.door]

    def running(self, client: str | None) -> int:
        """Commands running in ``client``'s sandboxes (every sandbox's, with
        authentication off: one client)."""
        return sum(not p.result.done() for sb in self.by_id.values() if sb.client == client
                   for p in sb.procs.values())

    def check_share(self, client: str | None) -> None:
        """Raise :class:`AtCap` if ``client`` runs as many commands as it may
        (``ServeConfig.client_commands``)."""
        from metasched.serve.connections import default_client_commands

        cap = self.service.config.client_commands or default_client_commands()
        n = self.running(client)
        if n >= cap:
            who = "this client" if client is None else f"client {client!r}"
            raise AtCap(f"{who} has {n} commands running, as many as a client may "
                        f"(client_commands: {cap}); wait for one to end, or kill one")

    def listed(self, client: str | None) -> list[Sandbox]:
        """The live sandboxes ``client`` may see."""
        return [sb for sb in self.by_id.values()
                if sb.alive and (not self.service.config.clients or sb.client == client)]

    def set_timeout(self, sb: Sandbox, timeout_s: float) -> None:
        """The sandbox now ends ``timeout_s`` from now."""
        sb.end_at = time.time() + timeout_s

    def kill(self, sb: Sandbox, why: str = "killed") -> None:
        """End the sandbox now: later calls find it no more; its running processes are
        killed and its trajectory closed (its workspace goes once they have died)."""
        if not sb.alive:
            return
        sb.alive = False
        self.by_id.pop(sb.id, None)
        log.debug("e2b sandbox %s ends (%s)", sb.id, why)
        task = asyncio.get_running_loop().create_task(self._end(sb))
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)

    async def _end(self, sb: Sandbox) -> None:
        running = [p for p in sb.procs.values() if not p.result.done()]
        try:
            if running:
                await sb.run(programs.signal_argv(None, 9), "kill")
        finally:
            self.service.dispatcher.close_trajectory(sb.trajectory)

    async def close(self) -> None:
        """Stop the reaper and end every sandbox (the service stops)."""
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
        for sb in list(self.by_id.values()):
            sb.alive = False
            self.service.dispatcher.close_trajectory(sb.trajectory)
        self.by_id.clear()

    # ------------------------------------------------------------------ reaping

    def _start_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._reap())

    def _idle_s(self) -> float:
        if self.idle_s is not None:
            return self.idle_s
        config = getattr(self.service.dispatcher, "config", None)
        return float(getattr(config, "trajectory_idle_s", math.inf))

    async def _reap(self) -> None:
        while self.by_id:
            await asyncio.sleep(0.25)
            now, mono, idle_s = time.time(), time.monotonic(), self._idle_s()
            for sb in list(self.by_id.values()):
                if now >= sb.end_at:
                    self.kill(sb, "its timeout passed")
                elif mono - sb.last_used > idle_s and all(
                        p.result.done() for p in sb.procs.values()):
                    self.kill(sb, f"idle for {idle_s:g} s")


def _sizes(env: Mapping[str, str]) -> tuple[int, float | None]:
    """Cores and memory (MiB) of the sandbox's commands, from its env vars (default:
    one core, the dispatcher's memory default).

    Raises:
        ValueError: a value that is not a positive number.
    """
    cores, memory = 1, None
    try:
        if CORES_ENV in env:
            cores = int(env[CORES_ENV])
            if cores < 1:
                raise ValueError
        if MEMORY_ENV in env:
            memory = float(env[MEMORY_ENV])
            if not memory > 0 or not math.isfinite(memory):
                raise ValueError
    except ValueError:
        raise ValueError(f"envVars: {CORES_ENV} must be a whole number >= 1 and "
                         f"{MEMORY_ENV} a number > 0") from None
    return cores, memory
