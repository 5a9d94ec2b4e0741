"""The dispatcher's sandboxes: one per trajectory (its workspace persists across the
trajectory's commands), one shared by trajectory-less commands (each gets a private,
throwaway workspace in it), one more per (sandbox, GPU) for the gpu commands of each
(:meth:`Sandboxes.gpu_sandbox`: the same workspace, plus that GPU's device nodes), the
sandbox server that starts commands inside them, the
cgroup slots commands run in, and the user ids they run as.

:class:`Sandboxes` is created by the dispatcher at start; :meth:`Sandboxes.describe`
is the one line it logs about sandboxes.

The parts: :mod:`.handles` (:class:`Sandbox`, :class:`Started`) and :mod:`.slots` (the
cgroup slots commands run in).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from metasched.errors import ConfigError
from metasched.runtime.sandbox import bwrap, cgroups, devices, egress, gvisor, summary
from metasched.runtime.sandbox.cgroups import Slot
from metasched.runtime.sandbox.config import SandboxConfig, allowed_env
from metasched.runtime.sandbox.connection import ServerConnection, ServerGone, spawned_pid
from metasched.runtime.sandbox.handles import Sandbox, Started
from metasched.runtime.sandbox.lifeline import Lifeline
from metasched.runtime.sandbox.slots import _MB, SlotKeeping, _bytes
from metasched.runtime.sandbox.uids import UidPool
from metasched.runtime.sandbox.warm import WarmPool
from metasched.runtime.sandbox.workspace import SANDBOX_ENV, WORKSPACE, Template

__all__ = ["Sandbox", "Sandboxes", "Slot", "Started"]

log = logging.getLogger("metasched.dispatch")


class Sandboxes(SlotKeeping, WarmPool):
    """Every sandbox of one dispatcher (see the module docstring).

    Args:
        config: the dispatcher's sandbox settings.
        hide: host directories commands must not see (the journal's), besides
            ``config.hide``.
        dev_root: where the host's device nodes are (default
            :data:`~metasched.runtime.sandbox.devices.DEV_ROOT`, ``/dev``).

    Raises:
        ConfigError: ``isolation: bwrap`` was asked for and cannot work here (the
            message says what is missing).
    """

    def __init__(self, config: SandboxConfig, *, hide: Sequence[str] = (),
                 dev_root: str | None = None) -> None:
        self.config = config
        self.hide = [*config.hide, *hide]
        self.dev_root = dev_root if dev_root is not None else devices.DEV_ROOT
        self.warnings: list[str] = []
        # The isolating tool: bwrap, or runsc where self.gvisor is set.
        self.gvisor: gvisor.Bundles | None = None
        self.bwrap_path, self.bwrap_version = self._isolation()
        self.egress = egress.parse_egress(config.egress)
        # Granted network needs these; without them it is refused, never the host's.
        self.net_tools, self.net_missing = (egress.find_tools() if self.bwrap_path
                                            else (None, ""))
        if self.bwrap_path is not None and self.net_tools is None:
            if config.network:
                raise ConfigError("sandbox.network", self.net_missing)
            self.warnings.append(f"{self.net_missing}: commands granted network fail")
        self.hierarchies = cgroups.discover(config.cgroups, config.cgroup_parent)
        self.tree: cgroups.CgroupTree | None = None
        if self.hierarchies.v2 is not None or self.hierarchies.v1:
            try:
                self.tree = cgroups.CgroupTree(self.hierarchies)
            except OSError as e:
                self.hierarchies.missing = dict.fromkeys(cgroups.CONTROLLERS,
                                                         f"cannot make cgroups: {e}")
                self.hierarchies.v2, self.hierarchies.v1 = None, {}
                self.hierarchies.v2_controllers = set()
        missing = self.hierarchies.missing
        if missing and config.cgroups != "none":
            self.warnings.append(summary.cgroup_warning(missing))
        first, count = config.uid_range if config.uid_range else (0, 0)
        self.uids = UidPool(first, count, config.nobody_uid)
        # The server starts sandboxed commands, and host commands too where there are
        # cgroups: it enters a command's cgroups before the spawn, which a multi-threaded
        # dispatcher cannot do for one child alone.
        self.server: ServerConnection | None = None
        if self.bwrap_path is not None or (self.tree is not None and os.geteuid() == 0):
            try:
                # (runsc makes user namespaces itself: gVisor refuses them to commands)
                self.server = ServerConnection(self._home_cgroups(), refuse_userns=(
                    self.bwrap_path is not None and self.gvisor is None))
            except ServerGone as e:
                if config.isolation in ("bwrap", "gvisor"):
                    self.close()
                    raise ConfigError("sandbox.isolation", str(e)) from None
                self.warnings.append(f"isolation off: {e}")
                self.bwrap_path = None
        self._sandboxes: dict[str, Sandbox] = {}
        self._shared: dict[bool, Sandbox] = {}
        self._warm: dict[int, list[Sandbox]] = {}  # gVisor's started ahead, by size
        self._pool_init()  # gVisor's wiped ones and the turns to start (:mod:`.warm`)
        self._next_sid = 1
        self._next_cmd = 1
        self._loop: asyncio.AbstractEventLoop | None = None
        self._host_slots: list[Slot] = []  # free slots of commands run without isolation
        self._stuck: list[Slot] = []  # slots that would not empty: removed at close
        # Commands on the host end with this process through the lifeline (sandboxed
        # ones through the kernel: see metasched.runtime.sandbox.lifeline).
        self.lifeline: Lifeline | None = None
        if self.bwrap_path is None:
            try:
                self.lifeline = Lifeline(self.directories())
            except OSError as e:
                self.close()
                raise ConfigError("sandbox", f"cannot start the process that ends "
                                  f"commands with the dispatcher: {e.strerror or e}") from None

    # --- setup --------------------------------------------------------------------------

    def _isolation(self) -> tuple[str | None, str]:
        mode = self.config.isolation
        if mode == "none":
            return None, "off"
        if mode == "gvisor":
            path, why = gvisor.find_runsc()
            if path is None:
                raise ConfigError("sandbox.isolation", f"gvisor: {why}")
            self.gvisor = gvisor.Bundles(path)
            return path, why
        if os.geteuid() != 0:
            why = ("the sandbox needs root (to enter namespaces and switch users); the "
                   "dispatcher runs as uid " + str(os.geteuid()))
        else:
            path, why = bwrap.find_bwrap()
            if path is not None:
                return path, why
        if mode == "bwrap":
            raise ConfigError("sandbox.isolation", f"bwrap: {why}")
        self.warnings.append(f"isolation off: {why}; commands run on the host as uid "
                             f"{os.geteuid()}")
        return None, "off"

    def _home_cgroups(self) -> list[int]:
        """This process's own cgroup.procs in each hierarchy slots use (the server
        returns to the cgroups it started in after each spawn)."""
        if self.tree is None:
            return []
        return [os.open(os.path.join(os.path.dirname(d), "cgroup.procs"),
                        os.O_WRONLY | os.O_CLOEXEC) for d in self.tree.dirs.values()]

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start delivering the server's events on ``loop``."""
        self._loop = loop
        if self.server is not None:
            self.server.attach(loop)
            self._warm_fill()

    @property
    def isolated(self) -> bool:
        """Whether commands run in sandboxes (else on the host)."""
        return self.bwrap_path is not None and self.server is not None and self.server.alive

    @property
    def spawns_on_host(self) -> bool:
        """Whether host commands are started by the server, inside their cgroup slot
        from their first instruction (else the caller spawns and moves them in)."""
        return self.server is not None and self.server.alive and self.tree is not None

    @property
    def controllers(self) -> set[str]:
        return self.tree.controllers if self.tree is not None else set()

    def describe(self) -> str:
        """One line: how commands are confined (:func:`.summary.describe`)."""
        return summary.describe(self)

    def directories(self) -> list[str]:
        """The directories made for this dispatcher (for its crash-recovery record)."""
        return self.tree.directories() if self.tree is not None else []

    # --- sandboxes ----------------------------------------------------------------------

    def get(self, key: str) -> Sandbox | None:
        """The open (or opening) sandbox of trajectory ``key``."""
        return self._sandboxes.get(key)

    def open(self, key: str, *, size_mb: float, template: Template | None,
             network: bool) -> Sandbox:
        """Start making trajectory ``key``'s sandbox (or take a warm one: :mod:`.warm`);
        await its ``ready`` before use."""
        sb = self._warm_take(size_mb, template, network)
        if sb is not None:
            sb.key = key
        else:
            sb = self._new(key, size_mb, template, network)
        self._sandboxes[key] = sb
        return sb

    def shared(self, network: bool) -> Sandbox:
        """The sandbox of trajectory-less commands (made on first use)."""
        if self.gvisor is not None:  # a container per trajectory-less command (or reused)
            sb = (self._warm_take(self.config.scratch_mb, None, network)
                  or self._new("", self.config.scratch_mb, None, network))
            sb.throwaway = True
            return sb
        sb = self._shared.get(network)
        if sb is None or sb.closed:
            sb = self._shared[network] = self._new("", self.config.scratch_mb, None, network)
        return sb

    def gpu_sandbox(self, sb: Sandbox | None, minor: int | None) -> Sandbox | None:
        """Where a gpu command of ``sb`` (ready) runs on the GPU of minor number
        ``minor``: a sandbox of its own per (``sb``, GPU), made on first use, that binds
        that GPU's ``/dev/nvidia<minor>`` and the driver's control nodes that exist
        (:func:`~metasched.runtime.sandbox.devices.gpu_nodes`) and no other GPU's. A
        trajectory's shares its workspace (the same ``/workspace``, ``/tmp`` and
        ``/dev/shm``) and user; the shared sandbox's gives each command a private
        workspace, as it does. It ends with ``sb``. ``sb`` itself where there is nothing
        to bind (a stand-in device, ``minor`` None, no such node), or where ``sb`` is
        None or not ready (the command then fails as it would there); await the
        result's ``ready`` before use."""
        if (sb is None or minor is None or sb.closed or not sb.ready.done()
                or self.gvisor is not None):  # (no device in a gVisor sandbox)
            return sb
        if sb.ready.exception() is not None:
            return sb
        nodes = devices.gpu_nodes(minor, self.dev_root)
        if not nodes:
            return sb
        box = sb.gpus.get(minor)
        if box is None or box.closed:
            box = sb.gpus[minor] = self._new(sb.key, sb.size_bytes / _MB, None, sb.network,
                                             parent=sb, minor=minor, nodes=nodes)
        return box

    def _new(self, key: str, size_mb: float, template: Template | None,
             network: bool, *, parent: Sandbox | None = None, minor: int | None = None,
             nodes: Sequence[str] = ()) -> Sandbox:
        assert self._loop is not None and self.server is not None
        sid = self._next_sid
        self._next_sid += 1
        share = parent is not None and not parent.shared  # a trajectory's workspace
        uid = (parent.uid if share else self.uids.nobody
               if key == "" and self.gvisor is None else self.uids.take())
        size = int(size_mb * _MB)
        sb = Sandbox(sid, key, uid, network, size, template, self._loop.create_future(),
                     parent=parent, minor=minor, devices=tuple(nodes))
        workspace = (template.workspace_request(size, uid, uid) if template is not None
                     else {"share": parent.sid} if share else {"size": size})
        extra = list(template.bwrap_args()) if template else []
        for name in nodes:
            extra += ["--dev-bind", os.path.join(self.dev_root, name), f"/dev/{name}"]
        if network and self.net_tools is None:
            self._loop.call_soon(self._opened, sb, {"error": self.net_missing})
            return sb
        if self.gvisor is not None:  # (in its turn: it may be given a wiped one instead)
            self._start_turn(sb, lambda: self._open_gvisor(sb, network))
            return sb
        self.server.on("opened", sid, lambda ev: self._opened(sb, ev))
        try:
            self.server.open({"sid": sid, "uid": uid, "gid": uid, "workspace": workspace,
                              "env": {"PATH": "/usr/bin:/bin"},
                              "files": bwrap.identity_files(uid, uid),
                              "bwrap": bwrap.sandbox_argv(
                                  self.bwrap_path, network=network, hide=self.hide,
                                  extra=extra,
                                  system_paths=[*self.config.system_paths,
                                                *(devices.gpu_sys_paths() if nodes else [])]),
                              "net": self._net_spec() if network else None})
        except ServerGone as e:
            sb.ready.set_exception(OSError(0, str(e)))
        return sb

    def _open_gvisor(self, sb: Sandbox, network: bool) -> None:
        assert self._loop is not None and self.server is not None and self.gvisor
        self.server.on("opened", sb.sid, lambda ev: self._opened(sb, ev))
        try:
            if self.tree is not None:
                sb.box_slot = self._take_slot([])
                self._confine_box(sb)
            request, fds = self.gvisor.open_request(
                sb, hide=self.hide, system_paths=self.config.system_paths,
                env=({**allowed_env(self.config.env_allow), **SANDBOX_ENV}
                     if self.config.gvisor_zygote else None))
            request["net"] = self._net_spec() if network else None
            self.server.open(request, fds)
        except (OSError, ServerGone) as e:
            self._loop.call_soon(self._opened, sb, {"error": f"cannot open a gVisor "
                                                             f"sandbox: {e}"})

    def _net_spec(self) -> dict[str, Any]:
        """What the server needs to give a sandbox network (:mod:`.egress`); the host's
        addresses are read now, so an address added since the last sandbox counts."""
        assert self.net_tools is not None
        slirp, nft = self.net_tools
        return {"slirp": egress.slirp_argv(slirp), "nft": nft,
                "rules": egress.ruleset(self.egress, egress.host_addresses())}

    def _opened(self, sb: Sandbox, ev: dict[str, Any]) -> None:
        self._start_ended(sb)
        if sb.ready.done():
            return
        if ev.get("error"):
            sb.ready.set_exception(OSError(0, ev["error"]))
            sb.ready.exception()  # retrieved: a sandbox nobody waits for is not an error
            self._forget(sb)
        else:
            sb.seeded = ev.get("seeded", "")
            sb.init_pid = ev.get("init", -1)
            sb.ready.set_result(None)

    def close_sandbox(self, sb: Sandbox) -> None:
        """End ``sb`` and everything running in it, its GPUs' sandboxes too; its
        workspace is gone after this."""
        if sb.closed:
            return
        for box in list(sb.gpus.values()):
            self.close_sandbox(box)
        if self.server is not None:
            self.server.close_sandbox(sb.sid)
        if not sb.ready.done():
            sb.ready.set_exception(OSError(0, "the sandbox was closed"))
            sb.ready.exception()
        self._forget(sb)

    def close_trajectory(self, key: str) -> None:
        """End trajectory ``key``'s sandbox: wiped for another where it can be
        (:mod:`.warm`), else closed."""
        sb = self._sandboxes.get(key)
        if sb is None:
            return
        if sb.running == 0 and not sb.gpus and self._reusable(sb):
            self._recycle(sb)
        else:
            self.close_sandbox(sb)

    def _forget(self, sb: Sandbox) -> None:
        sb.closed = True
        self._start_ended(sb)
        if sb.parent is not None and sb.parent.gpus.get(sb.minor) is sb:
            del sb.parent.gpus[sb.minor]
        if self._sandboxes.get(sb.key) is sb:
            del self._sandboxes[sb.key]
        if sb.shared and self._shared.get(sb.network) is sb:
            del self._shared[sb.network]
        if sb.running == 0:
            self._retire(sb)

    def _retire(self, sb: Sandbox) -> None:
        """Its processes are gone (the namespace's init took them): free its id and
        slots (once: two commands' ends may both find it closed and empty)."""
        if sb.retired:
            return
        sb.retired = True
        if (not sb.shared or self.gvisor is not None) and sb.parent is None:
            self.uids.give(sb.uid)  # (a GPU's sandbox has its parent's)
        if sb.box_slot is not None:
            self._release(sb.box_slot, lambda s: s is not None and self._drop_slot(s))
            sb.box_slot = None
        for slot in sb.free_slots:
            self._drop_slot(slot)
        sb.free_slots.clear()

    # --- commands -----------------------------------------------------------------------

    def start(self, sb: Sandbox | None, *, argv: Sequence[str], env: dict[bytes, bytes],
              cores: Sequence[int], mem_limit_mb: float | None, pids_max: int | None,
              out_w: int, err_w: int, cwd: str | None = None, wait: bool = True,
              wipe: bool = False) -> Started:
        """Start one command in ``sb`` (ready), or on the host (``sb`` None: as this
        process's user, in ``cwd``; only where :attr:`spawns_on_host`), inside a cgroup
        slot configured for it.

        ``wipe`` (a gVisor sandbox): the command is the sandbox's wipe (``argv`` unused:
        :func:`.gvisor_exec.wipe`), not a program.

        ``wait=False`` (on the attached loop): the request is sent and this returns; the
        Started's ``spawned`` future then says its pid, or why it did not start (its
        slot and user are taken back by :meth:`finished`, as after an exit).

        Raises:
            OSError: it could not start (the errno and message name why).
        """
        pool = sb.free_slots if sb is not None else self._host_slots
        slot = self._take_slot(pool)
        uid = sb.uid if sb is not None else os.geteuid()
        gid = uid if sb is not None else os.getegid()
        try:
            if slot is not None:
                slot.configure(cores, _bytes(mem_limit_mb), pids_max)
            if sb is not None and sb.shared and not self.uids.shared and not sb.throwaway:
                uid = gid = self.uids.take()  # each trajectory-less command as its own user
            cmd = self._next_cmd
            self._next_cmd += 1
            request: dict[str, Any] = {
                "cmd": cmd, "argv": list(argv), "env": env, "uid": uid, "gid": gid,
                "sid": sb.sid if sb is not None else None,
                "cwd": WORKSPACE if sb is not None else cwd,
                "cores": (None if "cpuset" in self.controllers and self.gvisor is None
                          else list(cores)),  # (gVisor: its own affinity per command)
                "private": sb.size_bytes if sb is not None and sb.shared else None,
                "wipe": wipe}
            fds = [out_w, err_w, *(slot.procs_fds if slot is not None else ())]
            started = Started(cmd, None, slot, uid, in_gvisor=sb is not None
                              and self.gvisor is not None, wipe=wipe)
            if slot is not None:
                slot.enforced_by = None
            if sb is not None and sb.box_slot is not None:
                sb.grants[cmd] = (tuple(cores), _bytes(mem_limit_mb) or 0)
                self._confine_box(sb)
                if slot is not None:
                    slot.enforced_by = (sb.box_slot, sb.box_slot.oom_kills())
            try:
                if wait or self._loop is None:
                    started.pid = self.server.spawn(request, fds)
                else:
                    started.spawned = self._loop.create_future()
                    self.server.spawn_later(request, fds,
                                            lambda reply: _spawned(started.spawned, reply))
            except ServerGone as e:
                raise OSError(0, str(e)) from None
        except BaseException:
            if sb is not None and sb.grants.pop(self._next_cmd - 1, None) is not None:
                self._confine_box(sb)
            if sb is not None and uid != sb.uid:
                self.uids.give(uid)
            if slot is not None:
                self._give_slot(sb, slot)
            raise
        if sb is not None:
            sb.running += 1
            if sb.parent is not None:  # its user is the parent's: kept until this ends
                sb.parent.running += 1
        return started

    def on_exit(self, started: Started, handler: Callable[[dict[str, Any]], None]) -> None:
        """Call ``handler(event)`` when the command exits (``event``: ``status`` (a
        wait status, -1 if lost), ``maxrss_kb``, ``cpu_s``)."""
        self.server.on("exit", started.cmd, handler)

    def kill(self, started: Started) -> None:
        """SIGKILL every process of the command: its whole slot, or its process group
        when there are no cgroups."""
        if started.slot is not None and not started.in_gvisor:
            started.slot.kill()
        elif self.server is not None:
            self.server.kill(started.cmd)

    def finished(self, sb: Sandbox | None, started: Started) -> None:
        """The command's leader exited: kill what is left of it (daemons included) and
        give its slot and id back once nothing of it is left."""
        if sb is None:
            self._release(started.slot, lambda s: s is not None and self._host_slots.append(s))
            return
        sb.running -= 1
        if sb.parent is not None:
            sb.parent.running -= 1
        if sb.grants.pop(started.cmd, None) is not None and not sb.closed:
            self._confine_box(sb)
        if sb.throwaway and not started.wipe and not self._reusable(sb):
            self.close_sandbox(sb)
        self._release(started.slot, lambda slot: self._done(sb, started, slot))

    def _done(self, sb: Sandbox, started: Started, slot: Slot | None) -> None:
        if started.uid != sb.uid:
            self.uids.give(started.uid)
        if slot is not None:
            self._give_slot(sb, slot)
        if sb.closed and sb.running == 0:
            self._retire(sb)
        parent = sb.parent
        if parent is not None and parent.closed and parent.running == 0:
            self._retire(parent)
        if sb.throwaway and not started.wipe and sb.running == 0 and self._reusable(sb):
            self._recycle(sb)  # (its slot is back: the wipe takes it)

    # --- end ----------------------------------------------------------------------------

    def close(self) -> None:
        """End every sandbox and the server, remove the cgroups."""
        for sb in [*self._sandboxes.values(), *self._shared.values()]:
            sb.closed = True
        self._sandboxes.clear()
        self._shared.clear()
        self._pool_close()
        if self.server is not None:
            self.server.close()  # it kills every command and ends every sandbox
        if self.tree is not None:
            # Every slot, wherever it is (free, stuck, or of a command still ending).
            self.tree.close()
            self._host_slots.clear()
            self._stuck.clear()
        if self.gvisor is not None:
            self.gvisor.close()
        if getattr(self, "lifeline", None) is not None:  # (made last in __init__)
            self.lifeline.close()
            self.lifeline = None


def _spawned(fut: asyncio.Future[int], reply: dict[str, Any]) -> None:
    """The server's reply to a spawn sent without waiting, into ``fut``."""
    if fut.done():
        return
    try:
        fut.set_result(spawned_pid(reply))
    except OSError as e:
        fut.set_exception(e)
        fut.exception()  # retrieved: the command's child reads it from here

