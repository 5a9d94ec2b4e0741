"""How a dispatcher's sandboxes confine commands, in words: the one line the dispatcher
logs at start (:func:`describe`) and the warning where cgroup controllers are missing
(:func:`cgroup_warning`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Protocol

from metasched.runtime.sandbox import cgroups, gvisor
from metasched.runtime.sandbox.cgroup_discovery import Hierarchies
from metasched.runtime.sandbox.config import SandboxConfig
from metasched.runtime.sandbox.connection import ServerConnection
from metasched.runtime.sandbox.uids import UidPool

__all__ = ["Confinement", "cgroup_warning", "describe"]


class Confinement(Protocol):
    """What :func:`describe` reads of a sandbox manager
    (:class:`~metasched.runtime.sandbox.manager.Sandboxes`)."""

    config: SandboxConfig
    net_tools: tuple[str, str] | None
    uids: UidPool
    bwrap_version: str | None
    gvisor: gvisor.Bundles | None
    server: ServerConnection | None
    tree: cgroups.CgroupTree | None
    hierarchies: Hierarchies

    @property
    def isolated(self) -> bool: ...

    @property
    def spawns_on_host(self) -> bool: ...

# what stands in for each missing controller
_FALLBACK = {"cpuset": "CPU affinity, which a command can widen",
             "memory": "RLIMIT_AS per process",
             "pids": "RLIMIT_NPROC per user"}


def cgroup_warning(missing: Mapping[str, str]) -> str:
    """The warning where the controllers ``missing`` (name: why) cannot be used."""
    return ("sandbox cgroups incomplete: "
            + "; ".join(f"{c}: {why}" for c, why in missing.items())
            + " (fallback: " + ", ".join(_FALLBACK[c] for c in missing) + ")")


def describe(sandboxes: Confinement) -> str:
    """One line: how ``sandboxes`` confines commands (isolation, user ids, network, user
    namespaces, cgroups)."""
    if sandboxes.isolated:
        net = (f"network granted: egress {', '.join(sandboxes.config.egress) or 'none'} "
               "through slirp4netns" if sandboxes.net_tools else "network refused")
        ns = f"pid, mount, ipc, uts, net ({net})"
        uids = sandboxes.uids
        uid = (f"uids {uids.first}-{uids.first + uids.count - 1} (one per sandbox)"
               if not uids.shared else f"uid {uids.nobody}")
        iso = f"{sandboxes.bwrap_version} namespaces ({ns}), {uid}, minimal root"
        if sandboxes.gvisor is not None:
            if sandboxes.net_tools:  # (runsc --network=host in the sandbox's namespace)
                net += ", gVisor's sockets in the sandbox's own net namespace"
            iso = (f"gVisor ({sandboxes.bwrap_version}: a runsc container per sandbox, its "
                   f"exec server forking each command, gVisor's own kernel; {net}), {uid}, "
                   "minimal root")
        userns = ("refused" if sandboxes.gvisor is not None  # (the exec server's filter)
                  else sandboxes.server.userns if sandboxes.server is not None else "open")
        iso += (", no user namespaces" if userns == "refused"
                else f", user namespaces NOT disabled: {userns}")
    else:
        iso = f"no isolation (host, uid {os.geteuid()})"
    if sandboxes.tree is not None:
        cg = "cgroups " + sandboxes.hierarchies.describe()
        if not sandboxes.isolated:
            cg += (", entered before the first instruction" if sandboxes.spawns_on_host
                   else ", entered just after the start")
        if not sandboxes.hierarchies.favordynmods:  # harmless: a note, not a warning
            cg += (" (note: mounted without favordynmods, so a command started after "
                   "an idle spell may wait milliseconds for an RCU grace period to "
                   "enter its cgroup; mount -o remount,favordynmods, Linux >= 6.0, "
                   "avoids it)")
    else:
        cg = "no cgroups (affinity and rlimits)"
    return f"sandboxes: {iso}; {cg}"
