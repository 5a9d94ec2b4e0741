"""How a dispatcher's sandboxes confine commands, in words: the one line the dispatcher
logs at start (:func:`describe`) and the warning where cgroup controllers are missing
(:func:`cgroup_warning`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from metasched.runtime.sandbox.manager import Sandboxes

__all__ = ["cgroup_warning", "describe"]

# what stands in for each missing controller
_FALLBACK = {"cpuset": "CPU affinity, which a command can widen",
             "memory": "RLIMIT_AS per process",
             "pids": "RLIMIT_NPROC per user"}


def cgroup_warning(missing: Mapping[str, str]) -> str:
    """The warning where the controllers ``missing`` (name: why) cannot be used."""
    return ("cgroup confinement incomplete: "
            + "; ".join(f"{c}: {why}" for c, why in missing.items())
            + " (fallback: " + ", ".join(_FALLBACK[c] for c in missing) + ")")


def describe(boxes: Sandboxes) -> str:
    """One line: how ``boxes`` confines commands (isolation, user ids, network, user
    namespaces, cgroups)."""
    if boxes.isolated:
        net = (f"network granted: egress {', '.join(boxes.config.egress) or 'none'} "
               "through slirp4netns" if boxes.net_tools else "network refused")
        ns = f"pid, mount, ipc, uts, net ({net})"
        uid = (f"uids {boxes.uids.first}-{boxes.uids.first + boxes.uids.count - 1} (one per "
               "sandbox)" if not boxes.uids.shared else f"uid {boxes.uids.nobody}")
        iso = f"{boxes.bwrap_version} namespaces ({ns}), {uid}, minimal root"
        if boxes.gvisor is not None:
            iso = (f"gVisor ({boxes.bwrap_version}: a runsc container per sandbox, its "
                   f"exec server forking each command, gVisor's own kernel; {net}), {uid}, "
                   "minimal root")
        userns = ("refused" if boxes.gvisor is not None  # (the exec server's filter)
                  else boxes.server.userns if boxes.server is not None else "open")
        iso += (", no user namespaces" if userns == "refused"
                else f", user namespaces NOT disabled: {userns}")
    else:
        iso = f"no isolation (host, uid {os.geteuid()})"
    if boxes.tree is not None:
        cg = "cgroups " + boxes.hierarchies.describe()
        if not boxes.isolated:
            cg += (", entered before the first instruction" if boxes.spawns_on_host
                   else ", entered just after the start")
        if not boxes.hierarchies.favordynmods:  # harmless: a note, not a warning
            cg += (" (note: mounted without favordynmods, so a command started after "
                   "an idle spell may wait milliseconds for an RCU grace period to "
                   "enter its cgroup; mount -o remount,favordynmods, Linux >= 6.0, "
                   "avoids it)")
    else:
        cg = "no cgroups (affinity and rlimits)"
    return f"confinement: {iso}; {cg}"
