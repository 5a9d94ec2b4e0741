"""How the dispatcher confines commands (:class:`SandboxConfig`), checked in one place."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from metasched.errors import ConfigError, one_of
from metasched.runtime.sandbox.egress import DEFAULT_EGRESS, parse_egress

__all__ = ["ENV_ALLOW", "ISOLATION_MODES", "CGROUP_MODES", "SandboxConfig", "allowed_env"]

ISOLATION_MODES = ("auto", "bwrap", "none")
CGROUP_MODES = ("auto", "v2", "v1", "none")

# Variables a command gets from the dispatcher's environment; everything else it is
# given comes from its request's ``env``. None of these is a credential.
ENV_ALLOW = ("PATH", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "LC_NUMERIC", "LC_TIME",
             "LC_COLLATE", "LC_MONETARY", "LC_MESSAGES", "TZ", "TERM")


@dataclass
class SandboxConfig:
    """How commands are confined.

    Attributes:
        isolation: ``"bwrap"`` (namespaces made by bubblewrap: see the README for what
            it guarantees), ``"none"`` (commands run on the host as the dispatcher's
            user, with their own scratch directory), or ``"auto"`` (bwrap where it is
            installed and works, else none, with a one-line warning saying why).
        cgroups: ``"auto"`` (each controller from cgroup v2 where it is delegated, else
            from v1), ``"v2"``, ``"v1"``, or ``"none"`` (affinity and rlimits only).
        cgroup_parent: a cgroup v2 directory delegated to the dispatcher (default: the
            one it runs in, when usable).
        uid_range: ``(first, count)``: the user ids commands run as, one per trajectory
            (and one per trajectory-less command); none of them may be a real user's.
            None: every command runs as ``nobody_uid``.
        nobody_uid: the user (and group) id when no range is given.
        network: whether commands may reach the network when their request does not say.
            A sandbox granted network reaches what ``egress`` allows, never the host.
        egress: where a sandbox granted network may connect (see
            :mod:`~metasched.runtime.sandbox.egress`): ``"public"`` (IPv4 outside the
            private and special ranges; the default) and CIDRs, each optionally with
            ``:port`` or ``:port-port``. Host-local addresses are never reachable.
        env_allow: variables passed from the dispatcher's environment.
        hide: more host paths commands must not see (the journal's files always are).
        workspace_mb: size of a trajectory's workspace (a tmpfs holding ``/workspace``,
            ``/tmp`` and ``/dev/shm``): the sandbox memory the scheduler accounts for
            the trajectory; a request's ``workspace_mb`` overrides it.
        scratch_mb: size of a trajectory-less command's private workspace.
        pids_max: processes (and threads) one command may have at once; a request's
            ``pids_max`` overrides it.
    """

    isolation: str = "auto"
    cgroups: str = "auto"
    cgroup_parent: str | None = None
    uid_range: tuple[int, int] | None = (1_500_000_000, 65_536)
    nobody_uid: int = 65534
    network: bool = False
    egress: tuple[str, ...] = DEFAULT_EGRESS
    env_allow: tuple[str, ...] = ENV_ALLOW
    hide: tuple[str, ...] = ()
    workspace_mb: float = 1024.0
    scratch_mb: float = 512.0
    pids_max: int = 1024

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise :class:`ConfigError` (one line, naming the field) on a bad value."""
        one_of(self.isolation, ISOLATION_MODES, "sandbox.isolation")
        one_of(self.cgroups, CGROUP_MODES, "sandbox.cgroups")
        if self.uid_range is not None:
            try:
                first, count = (int(x) for x in self.uid_range)
            except (TypeError, ValueError):
                raise ConfigError("sandbox.uid_range", f"must be [first, count] or null "
                                  f"(got {self.uid_range!r})") from None
            if first < 1000 or count < 1 or first + count > 2**32 - 2:
                raise ConfigError("sandbox.uid_range", "must be [first >= 1000, count >= 1] "
                                  f"within 32-bit ids (got {self.uid_range!r})")
            self.uid_range = (first, count)
        if not isinstance(self.nobody_uid, int) or not 0 < self.nobody_uid < 2**32 - 1:
            raise ConfigError("sandbox.nobody_uid", f"must be a user id > 0 (got "
                              f"{self.nobody_uid!r})")
        for name in ("workspace_mb", "scratch_mb"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 1 <= v <= 2**40:
                raise ConfigError(f"sandbox.{name}", f"must be a size in MB >= 1 (got {v!r})")
        if (not isinstance(self.pids_max, int) or isinstance(self.pids_max, bool)
                or not 1 <= self.pids_max <= 4_194_304):
            raise ConfigError("sandbox.pids_max", f"must be an integer in [1, 4194304] "
                              f"(got {self.pids_max!r})")
        self.env_allow = tuple(str(x) for x in self.env_allow)
        self.hide = tuple(os.path.abspath(str(p)) for p in self.hide)
        self.network = bool(self.network)
        self.egress = tuple(str(a) for a in parse_egress(self.egress))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> SandboxConfig:
        """From the ``sandbox:`` settings group (unknown keys are an error)."""
        d = dict(d or {})
        known = {f for f in cls.__dataclass_fields__}
        for key in d:
            if key not in known:
                raise ConfigError(f"sandbox.{key}", f"unknown setting (known: "
                                  f"{', '.join(sorted(known))})")
        for key in ("uid_range", "env_allow", "hide", "egress"):
            v = d.get(key)
            if v is None:
                if key != "uid_range":
                    d.pop(key, None)
                continue
            if not isinstance(v, (list, tuple)) or isinstance(v, str):
                raise ConfigError(f"sandbox.{key}", f"must be a list (got {v!r})")
            d[key] = tuple(v)
        return cls(**d)


def allowed_env(allow: tuple[str, ...], environ: Mapping[str, str] | None = None
                ) -> dict[str, str]:
    """The variables of ``environ`` (default: this process's) named in ``allow``."""
    src = os.environ if environ is None else environ
    return {k: src[k] for k in allow if k in src}

