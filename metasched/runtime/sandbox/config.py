"""How the dispatcher confines commands (:class:`SandboxConfig`), checked in one place."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator

from metasched.core.schema import Checked, Count, Flag, Number, parse
from metasched.errors import ConfigError, short
from metasched.runtime.sandbox.bwrap import NOT_SYSTEM_PATHS, OWN_MOUNTS, within
from metasched.runtime.sandbox.egress import DEFAULT_EGRESS, parse_egress
from metasched.runtime.sandbox.workspace import Template, template_from

__all__ = ["ENV_ALLOW", "ISOLATION_MODES", "CGROUP_MODES", "SandboxConfig", "allowed_env"]

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
ISOLATION_MODES = ("auto", "bwrap", "gvisor", "none")
CGROUP_MODES = ("auto", "v2", "v1", "none")

# Variables a command gets from the dispatcher's environment; everything else it is
# given comes from its request's ``env``. None of these is a credential.
ENV_ALLOW = ("PATH", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "LC_NUMERIC", "LC_TIME",
             "LC_COLLATE", "LC_MONETARY", "LC_MESSAGES", "TZ", "TERM")


def _egress(entries: tuple[Any, ...]) -> tuple[str, ...]:
    try:
        return tuple(str(a) for a in parse_egress(entries))
    except ConfigError as e:  # named by the validator (sandbox.egress)
        raise ConfigError("", e.problem) from None


def _uid_range(r: tuple[int, int]) -> tuple[int, int]:
    first, count = r
    if first < 1000 or count < 1 or first + count > 2**32 - 2:
        raise ConfigError("", f"must be [first >= 1000, count >= 1] within 32-bit ids "
                          f"(got {short(list(r))})")
    return r


def _checked_templates(value: Any) -> dict[str, str]:
    """``sandbox.templates``: names (letters, digits, ``.``, ``_``, ``-``) to the
    absolute paths of existing directories or tar archives."""
    if value is None:
        return {}
    out = {}
    for name, path in value.items():
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ConfigError("", f"{short(name)}: a name is letters, digits, '.', '_' "
                              "and '-'")
        if not isinstance(path, str) or not path:
            raise ConfigError(name, f"must be a path (got {short(path)})")
        out[name] = template_from(path, name).path
    return out


def _system_path(path: Any) -> str:
    """A configured system path, normalised; ConfigError where it is not one."""
    field = ""  # the validator's: sandbox.system_paths
    if not isinstance(path, str) or not path.startswith("/"):
        raise ConfigError(field, f"must be absolute host paths (got {path!r})")
    norm = os.path.normpath(path)
    if norm in NOT_SYSTEM_PATHS:
        raise ConfigError(field, f"{path!r} would expose the host (name the paths a "
                          "toolchain needs)")
    if within(norm, OWN_MOUNTS):
        raise ConfigError(field, f"{path!r} would cover the sandbox's own "
                          f"{', '.join(OWN_MOUNTS)}")
    if not os.path.lexists(norm):
        raise ConfigError(field, f"{path!r} does not exist")
    return norm


class SandboxConfig(Checked):
    """How commands are confined.

    Attributes:
        isolation: ``"bwrap"`` (namespaces made by bubblewrap: see the docs' Sandboxes page for
            what it guarantees), ``"gvisor"`` (each sandbox a gVisor container: the
            same root, workspace and users, commands started by the sandbox's exec
            server against gVisor's own kernel; refused, never downgraded, where runsc cannot run),
            ``"none"`` (commands run on the host as the dispatcher's
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
        hide: more host paths commands must not see (the journal's files always are),
            where they lie under a path sandboxes see.
        system_paths: more host paths (absolute) a sandbox sees, read-only, at the same
            place, besides the system's programs and libraries (``/usr``, ``/bin``,
            ``/lib*``...) and the files of ``/etc`` programs need: e.g. a toolchain in
            ``/opt``. Nothing else of the host is in a sandbox.
        workspace_mb: size of a trajectory's workspace (a tmpfs holding ``/workspace``,
            ``/tmp`` and ``/dev/shm``): the sandbox memory the scheduler accounts for
            the trajectory; a request's ``workspace_mb`` overrides it.
        scratch_mb: size of a trajectory-less command's private workspace.
        pids_max: processes (and threads) one command may have at once; a request's
            ``pids_max`` overrides it.
        templates: the workspace templates requests may name (``workspace_template``):
            name -> a directory or tar archive on this host, checked at construction.
            A request names one of these; it never gives a path.
        gvisor_warm: with ``isolation: gvisor``, how many sandboxes of each common kind
            (a trajectory's without network or template, a trajectory-less command's)
            are kept started ahead, so that a first command does not wait for a
            container's start (see :mod:`~metasched.runtime.sandbox.warm`); 0: none.
        gvisor_starts: with ``isolation: gvisor``, how many containers may be starting
            at once on this node; more wait their turn (a burst of starts on a few cores
            slows every one of them).
        gvisor_reuse: with ``isolation: gvisor``, whether a sandbox without network or
            template, its trajectory closed (or its trajectory-less command ended), is
            wiped (every process killed, ``/workspace``, ``/tmp`` and ``/dev/shm``
            emptied, checked) and serves the next one asked instead of a new container
            (:mod:`~metasched.runtime.sandbox.warm`; the docs' Sandboxes page says when
            that is as safe as a new one).
        gvisor_zygote: with ``isolation: gvisor``, whether a ``python3 FILE`` or
            ``python3 -c CODE`` command runs in a fork of the sandbox's warm interpreter
            instead of an exec and an interpreter start-up
            (:mod:`~metasched.runtime.sandbox.gvisor_zygote`; the docs' Sandboxes page
            says what differs: every such command of a container shares its
            interpreter's hash seed and address layout).
    """

    isolation: Literal[ISOLATION_MODES] = "auto"  # type: ignore[valid-type]
    cgroups: Literal[CGROUP_MODES] = "auto"  # type: ignore[valid-type]
    cgroup_parent: str | None = None
    uid_range: Annotated[tuple[Count(0), Count(0)], AfterValidator(_uid_range)] | None = (
        1_500_000_000, 65_536)
    nobody_uid: Count(1, 2**32 - 2) = 65534
    network: Flag = False
    egress: Annotated[tuple[Any, ...], AfterValidator(_egress)] = DEFAULT_EGRESS
    env_allow: tuple[Annotated[str, BeforeValidator(str)], ...] = ENV_ALLOW
    hide: tuple[Annotated[str, BeforeValidator(lambda p: os.path.abspath(str(p)))], ...] = ()
    system_paths: Annotated[tuple[str, ...], AfterValidator(
        lambda paths: tuple(_system_path(p) for p in paths))] = ()
    workspace_mb: Number(ge=1.0, le=2.0**40) = 1024.0
    scratch_mb: Number(ge=1.0, le=2.0**40) = 512.0
    pids_max: Count(1, 4_194_304) = 1024
    templates: Annotated[dict[Any, Any] | None, AfterValidator(_checked_templates)] = {}
    gvisor_warm: Count(0, 64) = 1
    gvisor_starts: Count(1, 1024) = 4
    gvisor_reuse: Flag = True
    gvisor_zygote: Flag = True

    one_line_at = ("sandbox",)

    def template(self, name: str, field_: str = "workspace_template") -> Template:
        """The configured template called ``name``, checked again (it may have gone since
        the start).

        Raises:
            ConfigError: one line naming ``field_``: an unknown name (listing the known
                ones), or a template that is no longer readable.
        """
        path = self.templates.get(name)
        if path is None:
            known = ", ".join(sorted(self.templates)) or "none: sandbox.templates is empty"
            raise ConfigError(field_, f"unknown template {short(name)} (configured: {known})")
        t = template_from(path, f"sandbox.templates.{name}")
        return Template(t.kind, t.path, name)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> SandboxConfig:
        """From the ``sandbox:`` settings group (unknown keys are an error; null: the
        default, but for ``uid_range``, whose null is "no range")."""
        if isinstance(d, Mapping):
            d = {k: v for k, v in d.items() if v is not None or k == "uid_range"}
        return parse(cls, {} if d is None else d, "sandbox")


def allowed_env(allow: tuple[str, ...], environ: Mapping[str, str] | None = None
                ) -> dict[str, str]:
    """The variables of ``environ`` (default: this process's) named in ``allow``."""
    src = os.environ if environ is None else environ
    return {k: src[k] for k in allow if k in src}

