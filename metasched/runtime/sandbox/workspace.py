"""What a trajectory's workspace starts with: nothing, a template directory (laid under
the workspace with overlayfs, copy-on-write, or copied where overlayfs is refused), or a
tar archive (extracted). The seeding commands run inside the sandbox: the copy and the
extraction as the sandbox's user, so they can neither read what that user cannot nor
write outside the workspace; only the ownership change of an overlay, which needs root,
runs as root (``chown -R -h``: symbolic links are not followed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from metasched.errors import ConfigError

__all__ = ["ARCHIVE_SUFFIXES", "Template", "template_from"]

ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz",
                    ".tar.zst", ".tzst")
_OVERLAY_UNSAFE = (",", ":", "\\", "\n")  # characters overlayfs options cannot carry
WORKSPACE = "/workspace"
# What a command in a sandbox sees as its home and identity (its workspace, its own /tmp).
SANDBOX_ENV = {"HOME": WORKSPACE, "TMPDIR": "/tmp", "USER": "sandbox", "LOGNAME": "sandbox"}
MOUNT_POINT = "/.template"  # where the template is bound (read-only) inside the sandbox


@dataclass(frozen=True)
class Template:
    """A checked workspace template: ``kind`` is ``"dir"`` or ``"tar"``, ``path``
    absolute, ``name`` what requests call it (``sandbox.templates``)."""

    kind: str
    path: str
    name: str = ""

    def bwrap_args(self) -> list[str]:
        """Bind the template into the sandbox (it may lie where commands cannot see,
        e.g. the host's /tmp); the server detaches it once the workspace is seeded."""
        return ["--ro-bind", self.path, MOUNT_POINT]

    def workspace_request(self, size: int, uid: int, gid: int) -> dict[str, Any]:
        """The server's ``workspace`` description: overlay first, copy as a fallback."""
        if self.kind == "tar":
            return {"size": size, "template": MOUNT_POINT,
                    "seed": {"argv": ["tar", "-x", "-f", MOUNT_POINT, "-C", WORKSPACE,
                                      "--no-same-owner"], "root": False}}
        copy = {"argv": ["cp", "-R", "--preserve=mode,timestamps,links", "--",
                         f"{MOUNT_POINT}/.", WORKSPACE], "root": False}
        if any(c in self.path for c in _OVERLAY_UNSAFE):
            # The bound copy's path is fixed, but overlayfs refuses some host paths as
            # its lower layer all the same: keep to what is known to work.
            return {"size": size, "template": MOUNT_POINT, "seed": copy}
        return {"size": size, "template": MOUNT_POINT, "overlay": MOUNT_POINT,
                "fallback": copy,
                "seed": {"argv": ["chown", "-R", "-h", f"{uid}:{gid}", WORKSPACE],
                         "root": True}}


def template_from(value: str, field: str = "workspace_template") -> Template:
    """Check a configured template's path (``sandbox.templates``; requests name
    templates, never paths): an existing directory, or a readable regular file named
    like a tar archive.

    Raises:
        ConfigError: one line naming ``field``.
    """
    path = os.path.abspath(value)
    if os.path.isdir(path):
        if not os.access(path, os.R_OK | os.X_OK):
            raise ConfigError(field, f"{path}: cannot read the directory")
        return Template("dir", path)
    if not os.path.exists(path):
        raise ConfigError(field, f"{path}: no such file or directory")
    if not os.path.isfile(path):
        raise ConfigError(field, f"{path}: neither a directory nor a file")
    if not path.endswith(ARCHIVE_SUFFIXES):
        raise ConfigError(field, f"{path}: not a directory or a tar archive (one of "
                          f"{', '.join(ARCHIVE_SUFFIXES)})")
    if not os.access(path, os.R_OK):
        raise ConfigError(field, f"{path}: cannot read the file")
    return Template("tar", path)
