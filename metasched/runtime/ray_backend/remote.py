"""The dispatcher actor behind the interface the apps use of a local dispatcher, so that
``metasched-dispatch backend=ray`` and ``metasched-serve backend=ray`` run on a Ray
cluster with the code that runs them on one machine.

:func:`open_dispatcher` connects to the cluster (``ray.init(address=...)``), attaches to
the dispatcher actor of the given name if one runs (after checking that it is a
dispatcher of this version with the settings asked for) or starts it, and returns a
:class:`RemoteDispatcher`: ``start`` / ``close`` / ``accept`` / ``enqueue`` / ``stats``
/ ``status`` / ``find`` / ``close_trajectory`` / ``run_result``, as
:class:`~metasched.runtime.dispatch.Dispatcher` has them. A dispatcher it started is
stopped when it closes (unless ``keep``); one it attached to goes on serving its other
clients.

``stats()`` and ``status()`` are read without a round trip: they are the actor's, as
last fetched (every ``POLL_S`` while the dispatcher is open, and at its close).
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import ray
from pydantic import StringConstraints

from metasched import __version__
from metasched.core.schema import Checked, Count, Flag
from metasched.errors import ConfigError
from metasched.runtime.dispatch import DispatcherConfig
from metasched.runtime.gpu import LiveService
from metasched.runtime.ray_backend.client import (
    DEFAULT_NAME,
    NAMESPACE,
    DispatcherHandle,
    start_dispatcher,
)
from metasched.runtime.ray_backend.cluster import DEFAULT_SUBMIT, SUBMIT_MODES, check_submit
from metasched.runtime.ray_backend.commands import lost
from metasched.runtime.requests import Request, Result

log = logging.getLogger("metasched.dispatch")

POLL_S = 0.25  # how often the actor's status is fetched while open
READY_TIMEOUT_S = 30.0  # how long a running actor may take to answer who it is


_Name = Annotated[str, StringConstraints(strict=True, strip_whitespace=True, min_length=1)]
"""A name or an address: not empty, nor only spaces."""


class RaySettings(Checked):
    """Where the dispatcher actor is and how it is started (the apps' ``ray:`` group).

    Attributes:
        address: the cluster, as ``ray.init`` takes it (``auto``: the one started on this
            machine with ``ray start``, or ``RAY_ADDRESS``).
        name: the actor's name: attached to if it runs, else started.
        namespace: the Ray namespace the name is found in.
        submit: how a started dispatcher's commands reach their node (``task`` | ``daemon``
            | ``batch``).
        cores_per_node: a started dispatcher grants at most this many cores per node.
        ahead_per_core: a started dispatcher hands each node up to this many commands per
            core ahead of its free cores (None: the backend's default; 0: none).
        keep: leave a dispatcher this process started running when it closes.
    """

    one_line_at = ("ray",)

    address: _Name = "auto"
    name: _Name = DEFAULT_NAME
    namespace: _Name = NAMESPACE
    submit: Literal[SUBMIT_MODES] = DEFAULT_SUBMIT  # type: ignore[valid-type]
    cores_per_node: Count(1) | None = None
    ahead_per_core: Count(0) | None = None
    keep: Flag = False


def _recorded_cluster() -> str | None:
    """The address ``ray start`` recorded on this machine (Ray's default temp dir), if any."""
    try:
        root = os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()
        with open(os.path.join(root, "ray", "ray_current_cluster")) as f:
            return f.read().strip() or None
    except OSError:
        return None


def init_ray(address: str, namespace: str) -> None:
    """Connect this process to the Ray cluster at ``address`` (once).

    Raises:
        ConfigError: no Ray cluster is reachable there (``ray.address``).
    """
    if ray.is_initialized():
        return
    # "auto" is RAY_ADDRESS, else the cluster `ray start` recorded: probe that one.
    probe = address
    if address == "auto":
        probe = os.environ.get("RAY_ADDRESS") or _recorded_cluster() or address
    host, _, port = probe.rpartition(":")
    listens = False
    if host and port.isdigit() and "://" not in probe:
        # An address where nothing listens: say so at once (Ray retries for a minute).
        import socket

        try:
            socket.create_connection((host, int(port)), timeout=5).close()
            listens = True
        except OSError as e:
            shown = repr(address) if probe == address else f"{address!r} ({probe})"
            raise ConfigError("ray.address", f"no Ray cluster reachable at {shown} "
                              f"({e.strerror or e}); start one with `ray start --head`, or "
                              f"give ray.address=<host>:<port>") from None
    try:
        ray.init(address=address, namespace=namespace, log_to_driver=False,
                 logging_level="ERROR")
    except (ConnectionError, TimeoutError, ValueError) as e:
        why = " ".join(str(e).split())[:160]
        if listens:  # something answers there, but not as a cluster this process may join
            raise ConfigError("ray.address", f"{address!r} listens but Ray could not join it "
                              f"as a cluster (not a Ray head, or one with token "
                              f"authentication: set RAY_AUTH_MODE=token, with its token in "
                              f"~/.ray/auth_token or RAY_AUTH_TOKEN): {why}") from None
        raise ConfigError("ray.address", f"no Ray cluster reachable at {address!r} (start one "
                          f"with `ray start --head`, or give ray.address=<host>:<port>): "
                          f"{why}") from None
    except ray.exceptions.AuthenticationError as e:  # a cluster with token authentication
        why = " ".join(str(e).split())[:200]
        raise ConfigError("ray.address", f"the Ray cluster at {address!r} refused this "
                          f"process ({why})") from None


def open_dispatcher(settings: RaySettings, config: DispatcherConfig,
                    services: Mapping[str, LiveService] | None = None, *,
                    journal_given: bool = True, endpoints: list[str] | None = None
                    ) -> RemoteDispatcher:
    """Attach to the dispatcher actor ``settings.name``, or start it with ``config``.

    Args:
        settings: where the actor is (see :class:`RaySettings`).
        config: the dispatcher's settings, for one started here (its paths are on this
            node, where the actor is pinned); an attached one must have the same
            scheduler, submission mode and ``cores_per_node`` (and journal, if
            ``journal_given``).
        services: GPU services, for a dispatcher started here.
        journal_given: ``config.journal`` was asked for (not a default for this run).
        endpoints: API endpoints the caller needs the dispatcher to have.

    Raises:
        ConfigError: no cluster at the address, the name held by an actor that is not a
            compatible dispatcher, or a dispatcher that cannot start (one line each).
    """
    check_submit(settings.submit)
    init_ray(settings.address, settings.namespace)
    try:
        actor = ray.get_actor(settings.name, namespace=settings.namespace)
    except ValueError:
        actor = None
    if actor is not None:
        info = _check_running(actor, settings, config, journal_given)
        handle = DispatcherHandle(actor, settings.name)
        started = False
    else:
        if settings.ahead_per_core is not None:
            config = config.replace(ahead_per_core=settings.ahead_per_core)
        try:
            handle = start_dispatcher(config, name=settings.name, services=services,
                                      cores_per_node=settings.cores_per_node,
                                      submit=settings.submit, namespace=settings.namespace)
        except BaseException:  # e.g. interrupted while it starts: it must not stay
            try:
                ray.kill(ray.get_actor(settings.name, namespace=settings.namespace),
                         no_restart=True)
            except (ValueError, ray.exceptions.RayError):
                pass  # never made, or gone
            raise
        info = ray.get(handle.actor.ready.remote())
        started = True
    missing = [e for e in endpoints or () if e not in info.get("endpoints", ())]
    if missing:
        if started and not settings.keep:
            _stop(handle.actor)
        have = ", ".join(info.get("endpoints", ())) or "none"
        raise ConfigError(f"endpoints.{missing[0]}", f"the running dispatcher "
                          f"{settings.name!r} has no such endpoint (its endpoints: {have}); "
                          f"stop it, or give ray.name= another name")
    return RemoteDispatcher(handle, info, started=started, keep=settings.keep)


def _check_running(actor: Any, settings: RaySettings, config: DispatcherConfig,
                   journal_given: bool) -> dict[str, Any]:
    """The running actor's description, if it is a dispatcher this one can use."""
    name = settings.name
    where = f"the Ray actor {name!r} (namespace {settings.namespace!r})"
    other = "stop it, or give ray.name= another name"
    try:
        info = ray.get(actor.ready.remote(), timeout=READY_TIMEOUT_S)
    except AttributeError:  # no such method: some other actor holds the name
        raise ConfigError("ray.name", f"{where} is not a metasched dispatcher; {other}") from None
    except ray.exceptions.GetTimeoutError:
        raise ConfigError("ray.name", f"{where} did not answer within {READY_TIMEOUT_S:g} s; "
                          f"{other}") from None
    except ray.exceptions.RayError as e:
        raise ConfigError("ray.name", f"{where} does not answer as a metasched dispatcher "
                          f"({lost(e)}); {other}") from None
    if not isinstance(info, dict) or "settings" not in info:
        raise ConfigError("ray.name", f"{where} is not a metasched dispatcher of this version "
                          f"({__version__}); {other}")
    if info.get("version") != __version__:
        raise ConfigError("ray.name", f"{where} runs metasched {info.get('version')}, this is "
                          f"{__version__}; {other}")
    if "error" in info:
        raise ConfigError("ray.name", f"{where} could not start its dispatcher: "
                          f"{info['error']}")
    theirs = info["settings"]
    wanted = {"scheduler": ("scheduler", config.scheduler),
              "submit": ("ray.submit", settings.submit),
              "cores_per_node": ("ray.cores_per_node", settings.cores_per_node)}
    if journal_given:
        wanted["journal"] = ("journal", str(config.journal))
    for key, (field, value) in wanted.items():
        if theirs.get(key) != value:
            raise ConfigError(field, f"the running dispatcher {name!r} has {key} "
                              f"{theirs.get(key)}, not {value}; {other}")
    return info


def _stop(actor: Any, drain: bool = False) -> dict[str, Any] | None:
    try:
        return ray.get(actor.close.remote(drain))
    finally:
        ray.kill(actor, no_restart=True)


class RemoteDispatcher:
    """A dispatcher actor with the interface of a local dispatcher (see the module
    docstring); made by :func:`open_dispatcher`.

    Args:
        handle: the actor's handle (bound to the event loop of the first call).
        info: what the actor said of itself (its ``ready()``).
        started: this process started it (and stops it at :meth:`close`, unless ``keep``).
        keep: leave a started dispatcher running at :meth:`close`.
    """

    remote = True  # its API calls run in the actor: a call must be picklable

    def __init__(self, handle: DispatcherHandle, info: Mapping[str, Any], *, started: bool,
                 keep: bool = False) -> None:
        self.handle = handle
        self.info = dict(info)
        self.started = started
        self.keep = keep
        self._status: dict[str, Any] = {}
        self._final: dict[str, Any] | None = None
        self._run = None
        self._poll: asyncio.Task | None = None

    @property
    def name(self) -> str:
        return self.handle.name

    def describe(self) -> str:
        """One line: which dispatcher, where, over what."""
        i = self.info
        how = "started" if self.started else "attached to"
        return (f"{how} dispatcher {self.name!r} on Ray: {i.get('nodes')} nodes x "
                f"{i.get('cores_per_node')} cores, {i.get('gpus')} GPUs, "
                f"scheduler {i['settings']['scheduler']}, journal {i['settings']['journal']}")

    async def start(self) -> None:
        """Fetch the actor's status, then keep it fresh while open."""
        await self.refresh()
        self._poll = asyncio.ensure_future(self._poll_status())

    async def refresh(self) -> None:
        """Fetch the actor's status now."""
        self._status = await self.handle.actor.status.remote()

    async def _poll_status(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            try:
                await self.refresh()
            except ray.exceptions.RayError as e:  # restarting: the handle waits for it too
                log.debug("status of dispatcher %s: %s", self.name, lost(e))

    async def close(self, *, drain: bool = True) -> None:
        """Stop using the actor: one started here (and not ``keep``) closes (with
        ``drain``, after what it accepted has finished) and is removed; an attached one
        goes on. Its final stats and measurements are kept for :meth:`stats` and
        :meth:`run_result`."""
        if self._poll is not None:
            self._poll.cancel()
            await asyncio.gather(self._poll, return_exceptions=True)
            self._poll = None
        actor = self.handle.actor
        await self.handle.aclose()
        if self.started and not self.keep:
            try:
                self._final = await actor.close.remote(drain)
                self._run = await actor.run_result.remote()
            finally:
                ray.kill(actor, no_restart=True)
        else:
            self._final = await actor.stats.remote()
            self._run = await actor.run_result.remote()

    def discard(self) -> None:
        """Stop a dispatcher started here that was never closed (blocking; nothing if
        it was closed, attached to, or ``keep``)."""
        if self.started and not self.keep and self._final is None:
            self._final = {}
            try:
                _stop(self.handle.actor)
            except ray.exceptions.RayError:
                pass  # gone already

    async def __aenter__(self) -> RemoteDispatcher:
        await self.start()
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        await self.close(drain=exc_type is None)

    # ----------------------------------------------------- the dispatcher's interface

    def accept(self, request: Request | Mapping[str, Any], *, call: Any = None
               ) -> asyncio.Future[Result]:
        return self.handle.accept(request, call=call)

    async def enqueue(self, request: Request | Mapping[str, Any], *, call: Any = None
                      ) -> asyncio.Future[Result]:
        return await self.handle.enqueue(request, call=call)

    async def submit(self, request: Request | Mapping[str, Any], *, call: Any = None
                     ) -> Result:
        return await self.handle.submit(request, call=call)

    def stats(self) -> dict[str, Any]:
        """The actor's counters as last fetched (final ones once closed)."""
        return self._final if self._final is not None else self._status

    def status(self) -> dict[str, Any]:
        """The actor's status (pools now) as last fetched."""
        return self._status

    async def find(self, rid: str) -> tuple[str, Result | None] | None:
        """Where request ``rid`` stands (asked of the actor)."""
        return await self.handle.actor.find.remote(rid)

    def close_trajectory(self, name: str) -> None:
        self.handle.actor.close_trajectory.remote(name)  # nothing waits for it

    def run_result(self):
        """What the dispatcher measured (at its close, once closed)."""
        return self._run if self._run is not None else self.handle.run_result()


__all__ = ["POLL_S", "RaySettings", "RemoteDispatcher", "init_ray", "open_dispatcher"]
