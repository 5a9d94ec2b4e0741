"""gVisor (``runsc``) sandboxes: the OCI bundle of a trajectory's container, the
``runsc`` command lines, and the check that runsc is here and works.

A gVisor sandbox is one runsc container per sandbox (trajectory), started detached when
the sandbox opens; each command is started in it by the sandbox's exec server (see
:mod:`.server_gvisor` and :mod:`.server_gvisor_exec`).
Its root is the same minimal root as bubblewrap's (:mod:`.bwrap`): an empty read-only
directory with the same system paths bound read-only at the same places
(:data:`~.bwrap.SYSTEM_PATHS` but ``/sys``, which gVisor makes its own;
:data:`~.bwrap.ETC_PATHS`; ``sandbox.system_paths``), the sandbox's own ``/etc/passwd``,
``/etc/group`` and ``/etc/hosts``, hidden paths covered, and gVisor's own ``/proc``,
``/dev`` and ``/sys``. ``/workspace``, ``/tmp`` and ``/dev/shm`` are tmpfs mounts inside
the sandbox's kernel, of the sandbox's size each; the workspace is owned by the sandbox's
user, and ``/home/user`` (E2B's home) is a symlink to it in the root, so that a path or
a symbolic link through either leads to the same files, as in a bubblewrap sandbox
(where it is a second mount of the workspace). No network (``--network=none``: a
loopback device only), or, where granted,
``--network=host`` in the namespace the sandbox server made for the sandbox, its rules
loaded and its stack up (:mod:`.egress`; the spec then has no network namespace of its
own).

The container's init (:data:`INIT`) is a root process holding only ``CAP_KILL``: it
prints a newline once running, then reads requests from its stdin, a pipe only the
sandbox server writes to: ``all SID`` or ``- SID`` kills the process group ``SID`` (a
command's: ``-`` for none) and, with ``all``, every process of the sandbox but itself
(``kill(-1)``), answering a newline when done. It reaps every child it is given: the
orphans of commands are its children, and none of them is left a zombie that a later
command would see (gVisor has no ``PR_SET_CHILD_SUBREAPER``). When the pipe closes (the server
ended, however), the init exits, and with it the whole sandbox
ends (gVisor kills every process in it). (The sandbox server sends no kill request
today: the sandbox's exec server, :mod:`.gvisor_exec`, kills what is left of each
command itself; the init's pipe is what ends the sandbox with the server.)
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from typing import Any

from metasched.runtime.sandbox import egress, gvisor_exec
from metasched.runtime.sandbox.bwrap import ETC_PATHS, SYSTEM_PATHS, identity_files, within
from metasched.runtime.sandbox.handles import Sandbox
from metasched.runtime.sandbox.server_records import HOME

__all__ = ["INIT", "Bundles", "find_runsc", "oci_config", "prepare_root", "runsc_argv"]

# The container's init (see the module docstring): the sandbox's own python3, the
# standard library only.
INIT = ("/usr/bin/python3", "-I", "-S", "-c", """
import os, selectors, signal, sys
r, w = os.pipe()
os.set_blocking(w, False)
signal.set_wakeup_fd(w)
signal.signal(signal.SIGCHLD, lambda *_: None)
sel = selectors.DefaultSelector()
sel.register(0, selectors.EVENT_READ)
sel.register(r, selectors.EVENT_READ)
os.write(1, b"\\n")
buf = b""
while True:
    for key, _ in sel.select():
        if key.fd == r:
            os.read(r, 4096)
            try:
                while os.waitpid(-1, os.WNOHANG)[0] > 0:
                    pass
            except ChildProcessError:
                pass
            continue
        data = os.read(0, 4096)
        if not data:
            sys.exit(0)
        buf += data
        while b"\\n" in buf:
            line, buf = buf.split(b"\\n", 1)
            a, s = (line.split() + [b"", b"-"])[:2]
            for target in ([-int(s)] if s != b"-" else []) + ([-1] if a == b"all" else []):
                try:
                    os.kill(target, signal.SIGKILL)
                except OSError:
                    pass
            os.write(1, b"\\n")
""")
# Loaded by gVisor into every process of the container (``--oci-seccomp``): no user
# namespaces, as in a bubblewrap sandbox (:mod:`.userns`): ``unshare`` and ``clone`` with
# CLONE_NEWUSER fail with EPERM, ``clone3`` (whose flags a filter cannot see) with ENOSYS.
_NEWUSER = 0x10000000
_WITH_NEWUSER = {"index": 0, "value": _NEWUSER, "valueTwo": _NEWUSER, "op": "SCMP_CMP_MASKED_EQ"}
USERNS_SECCOMP: dict[str, Any] = {
    "defaultAction": "SCMP_ACT_ALLOW", "architectures": ["SCMP_ARCH_X86_64"],
    "syscalls": [{"names": ["unshare", "clone"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1,
                  "args": [_WITH_NEWUSER]},
                 {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38}]}
# where runsc is looked for (a release installed by hand before the distribution's)
SEARCH = "/usr/local/bin:/usr/local/sbin:/usr/bin:/bin:/usr/sbin:/sbin"
_GVISOR_OWN = ("/sys",)  # gVisor's sysfs (its own CPU topology) replaces these binds


def find_runsc() -> tuple[str | None, str]:
    """``(path, version)`` of a runsc that can start a container here, or ``(None, why
    not)``: missing, not root, or present but refused."""
    path = shutil.which("runsc", path=SEARCH)
    if path is None:
        return None, ("gVisor's runsc is not installed (Debian/Ubuntu: apt-get install "
                      "runsc; `make install` does it when run as root)")
    if os.geteuid() != 0:
        return None, f"runsc needs root; the dispatcher runs as uid {os.geteuid()}"
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True,
                             timeout=10).stdout
        version = (out.splitlines() or ["runsc"])[0].strip()
        with tempfile.TemporaryDirectory(prefix="metasched-runsc-probe-") as d:
            probe = subprocess.run(
                [*runsc_argv(path, os.path.join(d, "state")), "do", "/bin/true"],
                capture_output=True, text=True, timeout=60, cwd=d)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{path} cannot run: {e}"
    if probe.returncode != 0:
        why = (probe.stderr.strip().splitlines() or [f"exit status {probe.returncode}"])[-1]
        return None, f"{path} cannot start a sandbox here: {why}"
    return path, version


def runsc_argv(runsc: str, state: str) -> list[str]:
    """runsc and its global flags: container state under ``state``, no network, the
    bundle's seccomp filter loaded (:data:`USERNS_SECCOMP`), cgroups left to the caller
    (the sandbox's processes inherit the cgroup slot they are started in)."""
    return [runsc, f"--root={state}", "--network=none", "--ignore-cgroups", "--oci-seccomp"]


def prepare_root(directory: str) -> str:
    """Make the containers' root under ``directory``: an empty directory holding the
    mount points of every bind (and ``/bin``, ``/lib*``, ``/sbin`` as the symlinks
    they are on the host; ``/home/user`` a symlink to ``/workspace``); returns its
    path. Every container's root is this one, read-only."""
    root = os.path.join(directory, "rootfs")
    os.makedirs(root, mode=0o755, exist_ok=True)
    for point in ("/proc", "/dev", "/sys", "/etc", "/workspace", "/tmp", "/home"):
        os.makedirs(root + point, mode=0o755, exist_ok=True)
    if not os.path.lexists(root + HOME):
        os.symlink("/workspace", root + HOME)
    return root


def _mount_point(root: str, path: str) -> None:
    """Make ``path``'s mount point in ``root`` (a directory, or an empty file for a
    file; a host symlink is made as the same symlink)."""
    target = root + path
    if os.path.lexists(target):
        return
    os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
    if os.path.islink(path):
        os.symlink(os.readlink(path), target)
    elif os.path.isdir(path):
        os.makedirs(target, mode=0o755, exist_ok=True)
    else:
        with open(target, "w"):
            pass


def _bind(path: str, root: str, mounts: list[dict[str, Any]], bound: list[str]) -> None:
    if not os.path.lexists(path) or within(path, _GVISOR_OWN):
        return
    _mount_point(root, path)
    if not os.path.islink(path):
        mounts.append({"destination": path, "type": "bind", "source": path,
                       "options": ["rbind", "ro", "nosuid", "nodev"]})
        bound.append(path)


def oci_config(*, root: str, files: dict[str, str], uid: int, gid: int, size: int,
               hide: Sequence[str] = (), system_paths: Sequence[str] = (),
               network: bool = False) -> dict[str, Any]:
    """The OCI ``config.json`` of one sandbox's container.

    Args:
        root: the containers' root (:func:`prepare_root`).
        files: host paths of the sandbox's own files, by their place in it
            (``/etc/passwd``...), bound read-only.
        uid, gid: the sandbox's user (owner of ``/workspace``).
        size: bytes of each of ``/workspace``, ``/tmp`` and ``/dev/shm``.
        hide: host paths to make invisible where they lie under a bound path.
        system_paths: more host paths bound read-only.
        network: granted network: no network namespace of its own in the spec, so that
            runsc (``--network=host``) keeps the sandbox in the namespace it is started
            in, the one the sandbox server made for it (a ``network`` entry without a
            path would make runsc start the sandbox in a new, empty one).
    """
    mounts: list[dict[str, Any]] = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/workspace", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "nodev", "mode=0700", f"size={size}",
                     f"uid={uid}", f"gid={gid}"]},
        {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "nodev", "mode=1777", f"size={size}"]},
        {"destination": "/dev/shm", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "nodev", "mode=1777", f"size={size}"]}]
    bound: list[str] = []
    for path in SYSTEM_PATHS:
        _bind(path, root, mounts, bound)
    etc = sorted({p for pattern in ETC_PATHS for p in glob.glob(os.path.join("/etc", pattern))})
    for path in [*etc, *system_paths]:
        _bind(path, root, mounts, bound)
    for dest, source in files.items():
        _empty_file(root + dest)
        mounts.append({"destination": dest, "type": "bind", "source": source,
                       "options": ["bind", "ro", "nosuid", "nodev"]})
    for path in hide:
        real = os.path.realpath(path)
        if not within(real, [os.path.realpath(b) for b in bound]):
            continue
        if os.path.isdir(path):
            mounts.append({"destination": real, "type": "tmpfs", "source": "tmpfs",
                           "options": ["ro", "size=4096", "mode=0755"]})
        elif os.path.exists(path):
            mounts.append({"destination": real, "type": "bind", "source": "/dev/null",
                           "options": ["bind", "ro"]})
    kill = ["CAP_KILL"]
    return {
        "ociVersion": "1.0.2",
        "process": {"user": {"uid": 0, "gid": 0}, "args": list(INIT),
                    "env": ["PATH=/usr/bin:/bin"], "cwd": "/", "noNewPrivileges": True,
                    "capabilities": {"bounding": kill, "effective": kill,
                                     "permitted": kill}},
        "root": {"path": root, "readonly": True},
        "hostname": "sandbox",
        "mounts": mounts,
        "linux": {"namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")
                                 if not (network and t == "network")],
                  "seccomp": USERNS_SECCOMP},
    }


def _empty_file(path: str) -> None:
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    if not os.path.lexists(path):
        with open(path, "w"):
            pass


class Bundles:
    """Where one dispatcher's gVisor containers live: runsc's state directory, the
    containers' common root, and one bundle per sandbox (all under one temporary
    directory named with the dispatcher's pid, removed by :meth:`close`, or by the next
    dispatcher's start once that pid is gone: its containers ended with it).

    Args:
        runsc: the runsc executable (:func:`find_runsc`).
    """

    def __init__(self, runsc: str) -> None:
        self.runsc = runsc
        _remove_dead()
        self.directory = tempfile.mkdtemp(prefix=f"metasched-gvisor-{os.getpid()}-")
        os.chmod(self.directory, 0o711)
        self.state = os.path.join(self.directory, "state")
        self.root = prepare_root(self.directory)
        self.argv = runsc_argv(runsc, self.state)
        # container ids: unique on the host (runsc's control sockets are abstract ones)
        self.prefix = f"metasched-{os.getpid()}-{os.path.basename(self.directory)[-8:]}-"

    def bundle(self, sid: int, *, uid: int, gid: int, size: int, files: dict[str, str],
               hide: Sequence[str], system_paths: Sequence[str],
               network: bool = False) -> dict[str, Any]:
        """Write sandbox ``sid``'s bundle (its ``config.json`` and own files); the
        sandbox server's ``gvisor`` request: runsc's argv (``network``: gVisor's
        sockets are the host kernel's, in the network namespace the server makes for
        the sandbox and connects as bubblewrap's: :mod:`.egress`), the bundle and the
        container id."""
        bundle = os.path.join(self.directory, f"sandbox-{sid}")
        os.makedirs(bundle, mode=0o700)
        sources = {}
        for n, (dest, text) in enumerate(files.items()):
            source = os.path.join(bundle, f"file{n}")
            with open(source, "w") as f:
                f.write(text)
            os.chmod(source, 0o444)
            sources[dest] = source
        config = oci_config(root=self.root, files=sources, uid=uid, gid=gid, size=size,
                            hide=hide, system_paths=system_paths, network=network)
        with open(os.path.join(bundle, "config.json"), "w") as f:
            json.dump(config, f)
        cid = f"{self.prefix}{sid}"
        argv = [("--network=host" if a == "--network=none" and network else a)
                for a in self.argv]
        seen = [m["destination"] for m in config["mounts"]
                if m["type"] == "bind" and m["source"] == m["destination"]]
        return {"runsc": argv, "bundle": bundle, "cid": cid, "seen": seen}

    def open_request(self, sb: Sandbox, *, hide: Sequence[str], system_paths: Sequence[str],
                     env: dict[str, str] | None) -> tuple[dict[str, Any], list[int]]:
        """The sandbox server's ``open`` request for ``sb`` (its bundle written) and the
        descriptors that go with it (its slot's ``cgroup.procs``: the container starts
        in it); ``env``: the environment its commands get where a request adds none
        (its zygote's Python environment: :mod:`.gvisor_zygote`; None: no zygote)."""
        files = identity_files(sb.uid, sb.uid)
        if sb.network:  # names the user-mode stack's resolver (see .egress)
            with open(egress.RESOLV_CONF) as f:
                files["/etc/resolv.conf"] = f.read()
        request = self.bundle(sb.sid, uid=sb.uid, gid=sb.uid, size=sb.size_bytes,
                              files=files, hide=hide, system_paths=system_paths,
                              network=sb.network)
        if env is not None:
            request["python_env"] = gvisor_exec.python_env(env)
        fds = list(sb.box_slot.procs_fds) if sb.box_slot is not None else []
        return {"sid": sb.sid, "uid": sb.uid, "gid": sb.uid, "gvisor": request}, fds

    def close(self) -> None:
        """Remove every bundle and runsc's state (the containers have ended)."""
        shutil.rmtree(self.directory, ignore_errors=True)


def _remove_dead() -> None:
    """Remove what dispatchers that are gone (killed) left: their bundles' directories."""
    for d in glob.glob(os.path.join(tempfile.gettempdir(), "metasched-gvisor-*-*")):
        try:
            pid = int(os.path.basename(d).split("-")[2])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except (ValueError, IndexError, PermissionError):
            pass
