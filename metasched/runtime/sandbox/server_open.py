"""Opening a sandbox in the sandbox server (:mod:`.server`): its ``bwrap`` started with
the files made for it, the namespaces entered once its stub runs, its tmpfs mounted (a
template laid over it with overlayfs, or another sandbox's workspace shared), seeded by a
command inside it when asked, and the reply once it (and its network, if granted) is up.
Only the standard library and this package's :mod:`.syscalls` are imported."""

from __future__ import annotations

import json
import os
import selectors
from typing import Any

from metasched.runtime.sandbox import syscalls
from metasched.runtime.sandbox.server_records import (
    _DATA_MAX,
    _NS,
    _SHARED_MOUNTS,
    _TAIL,
    HOME,
    STAGE,
    WORKSPACE,
    _close,
    _read_all,
    _Sandbox,
)
from metasched.runtime.sandbox.syscalls import (
    CLONE_NEWNS,
    MNT_DETACH,
    MS_BIND,
    MS_NODEV,
    MS_NOSUID,
    MS_REMOUNT,
)


class Opening:
    """The sandbox server's steps of opening a sandbox (a part of
    :class:`~metasched.runtime.sandbox.server.Server`, which holds the state they use:
    ``sel``, ``sandboxes``, ``own``, ``home_dir``, ``devnull``, ``next_internal``)."""

    sel: selectors.BaseSelector
    sandboxes: dict[int, _Sandbox]
    own: dict[str, int]
    home_dir: str
    devnull: int
    next_internal: int

    def _open(self, msg: dict[str, Any]) -> None:
        """Start a sandbox's bwrap; it is ready (and the reply sent) once its stub runs
        and its workspace is mounted (and seeded). ``msg["files"]`` (path: text) are
        files made for it, bound read-only (``/etc/passwd``...)."""
        sid = msg["sid"]
        sb = _Sandbox(sid, msg["uid"], msg["gid"], workspace=msg["workspace"],
                      net=msg.get("net"))
        self.sandboxes[sid] = sb
        try:
            block_r, sb.block_fd = os.pipe()
            sb.ready_fd, ready_w = os.pipe()
            sb.info_fd, info_w = os.pipe()
            os.set_inheritable(info_w, True)
            data = self._data_files(msg.get("files") or {})
            given = msg["bwrap"]
            end = len(given) - 1 - given[::-1].index("--")  # the options' end
            argv = [given[0], "--info-fd", str(info_w), *given[1:end],
                    *(a for fd, dest in data
                      for a in ("--perms", "0444", "--ro-bind-data", str(fd), dest)),
                    *given[end:]]
            try:
                sb.bwrap_pid = os.posix_spawn(
                    argv[0], argv, msg["env"],
                    file_actions=[(os.POSIX_SPAWN_DUP2, block_r, 0),
                                  (os.POSIX_SPAWN_DUP2, ready_w, 1)],
                    setsid=True)
            finally:
                for fd in (block_r, ready_w, info_w, *(fd for fd, _ in data)):
                    _close(fd)
            sb.bwrap_fd = os.pidfd_open(sb.bwrap_pid)
        except OSError as e:
            self._fail_open(sb, f"cannot start bwrap: {e.strerror or e}")
            return
        self.sel.register(sb.ready_fd, selectors.EVENT_READ, lambda _: self._on_ready(sid))

    @staticmethod
    def _data_files(files: dict[str, str]) -> list[tuple[int, str]]:
        """A pipe holding each file's text (small: it fits the pipe's buffer), its read
        end inheritable, for bwrap's ``--ro-bind-data FD DEST``."""
        data: list[tuple[int, str]] = []
        try:
            for dest, text in files.items():
                r, w = os.pipe()
                data.append((r, dest))
                try:
                    os.write(w, text.encode()[:_DATA_MAX])
                finally:
                    _close(w)
                os.set_inheritable(r, True)
        except OSError:
            for fd, _ in data:
                _close(fd)
            raise
        return data

    def _on_ready(self, sid: int) -> None:
        sb = self.sandboxes.get(sid)
        if sb is None:
            return
        self.sel.unregister(sb.ready_fd)
        data = os.read(sb.ready_fd, 64)
        _close(sb.ready_fd)
        sb.ready_fd = -1
        if data != b"\n":
            why = self._bwrap_error(sb)
            self._fail_open(sb, f"bwrap failed: {why}")
            return
        try:
            init = sb.init_pid = json.loads(_read_all(sb.info_fd))["child-pid"]
            for name, _ in _NS:
                sb.ns[name] = os.open(f"/proc/{init}/ns/{name}", os.O_RDONLY | os.O_CLOEXEC)
        except (OSError, ValueError, KeyError) as e:
            self._fail_open(sb, f"cannot enter the sandbox: {e}")
            return
        _close(sb.info_fd)
        sb.info_fd = -1
        if sb.net is not None:
            try:
                self._start_network(sb)
            except OSError as e:
                self._fail_open(sb, f"cannot give the sandbox network: {e.strerror or e}")
                return
        try:
            seed = self._setup_mounts(sb)
        except OSError as e:
            self._fail_open(sb, f"cannot make the workspace: {e.strerror or e}")
            return
        if seed:  # a copy, an extraction or an ownership change, inside the sandbox
            self._start_seed(sb, seed)
            return
        self._ready(sb)

    def _setup_mounts(self, sb: _Sandbox) -> dict[str, Any] | None:
        """Mount the sandbox's tmpfs (and the template's overlay); the seeding command
        still to run, if any (an overlay refused by the kernel falls back to a copy)."""
        ws = sb.workspace
        seed = ws.get("seed")
        syscalls.setns(sb.ns["mnt"], CLONE_NEWNS)
        try:
            # /proc shows only the caller's own processes.
            syscalls.mount("proc", "/proc", "proc", MS_REMOUNT | MS_NOSUID | MS_NODEV,
                           "hidepid=invisible")
            if "share" in ws:
                self._share_mounts(sb, ws["share"])
                return None
            overlay = ws.get("overlay")
            try:
                _mount_tmpfs(ws["size"], sb.uid, sb.gid, template=overlay)
            except OSError:
                if overlay is None or ws.get("fallback") is None:
                    raise
                _mount_tmpfs(ws["size"], sb.uid, sb.gid, template=None)
                seed = ws["fallback"]
                sb.method = "copy"
            else:
                sb.method = "overlay" if overlay is not None else ("tar" if seed else "")
                if seed and overlay is None:
                    sb.method = "tar" if seed["argv"][0] == "tar" else "copy"
        finally:
            syscalls.setns(self.own["mnt"], CLONE_NEWNS)
            os.chdir(self.home_dir)
        return seed

    def _share_mounts(self, sb: _Sandbox, other: int) -> None:
        """Attach clones of sandbox ``other``'s workspace mounts in ``sb``'s mount
        namespace (this thread is in it)."""
        src = self.sandboxes.get(other)
        if src is None or not src.ready:
            raise OSError(0, f"sandbox {other}, whose workspace it shares, is not open")
        fds: list[int] = []
        try:
            syscalls.setns(src.ns["mnt"], CLONE_NEWNS)
            try:
                for path in _SHARED_MOUNTS:
                    fds.append(syscalls.clone_mount(path))
            finally:
                syscalls.setns(sb.ns["mnt"], CLONE_NEWNS)
            for fd, path in zip(fds, _SHARED_MOUNTS, strict=True):
                syscalls.move_mount(fd, path)
        finally:
            for fd in fds:
                _close(fd)

    def _start_seed(self, sb: _Sandbox, seed: dict[str, Any]) -> None:
        err_r, err_w = os.pipe()
        cmd = self.next_internal
        self.next_internal -= 1
        sb.ready = True  # so that _spawn enters it
        uid, gid = (0, 0) if seed.get("root") else (sb.uid, sb.gid)
        try:
            pid = self._spawn({"sid": sb.sid, "cmd": cmd, "argv": seed["argv"],
                               "cwd": WORKSPACE, "uid": uid, "gid": gid,
                               "env": {b"PATH": b"/usr/local/bin:/usr/bin:/bin"}},
                              [self.devnull, err_w])
        except OSError as e:
            sb.ready = False
            _close(err_r)
            self._fail_open(sb, f"cannot seed the workspace: {e.strerror or e}")
            return
        finally:
            _close(err_w)
        sb.ready = False
        sb.seeding, sb.seed_err_fd = cmd, err_r
        os.set_blocking(err_r, False)
        self.sel.register(err_r, selectors.EVENT_READ, lambda _: self._seed_output(sb))
        self._watch(cmd, pid, sb.sid)

    def _seed_output(self, sb: _Sandbox) -> None:
        """Keep the tail of a seeding command's stderr (read as it comes, so that a
        chatty command never blocks on a full pipe)."""
        try:
            data = os.read(sb.seed_err_fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.sel.unregister(sb.seed_err_fd)
            _close(sb.seed_err_fd)
            sb.seed_err_fd = -1
            return
        sb.seed_err += data
        del sb.seed_err[:-_TAIL]

    def _seeded(self, sid: int | None, status: int) -> None:
        sb = self.sandboxes.get(sid)
        if sb is None:
            return
        if sb.seed_err_fd >= 0:
            sb.seed_err += _read_all(sb.seed_err_fd, limit=_TAIL)
            self.sel.unregister(sb.seed_err_fd)
            _close(sb.seed_err_fd)
        err = bytes(sb.seed_err[-_TAIL:]).decode(errors="replace").strip()
        sb.seed_err_fd, sb.seeding = -1, -1
        if status != 0:
            line = err.splitlines()[-1] if err else f"wait status {status}"
            self._fail_open(sb, f"cannot seed the workspace: {line}")
            return
        self._ready(sb)

    def _ready(self, sb: _Sandbox) -> None:
        """The workspace is seeded: detach the template's bind (an overlay keeps its own
        reference to it) and say so (once its network, if granted, is up too)."""
        template = sb.workspace.get("template")
        if template:
            try:
                syscalls.setns(sb.ns["mnt"], CLONE_NEWNS)
                try:
                    syscalls.umount(template, MNT_DETACH)
                finally:
                    syscalls.setns(self.own["mnt"], CLONE_NEWNS)
                    os.chdir(self.home_dir)
            except OSError as e:
                self._fail_open(sb, f"cannot detach the template: {e.strerror or e}")
                return
        sb.mounted = True
        if not sb.net_pending:
            self._opened(sb)

    def _opened(self, sb: _Sandbox) -> None:
        sb.ready = True
        self._reply({"ev": "opened", "sid": sb.sid, "seeded": sb.method, "init": sb.init_pid})

    def _bwrap_error(self, sb: _Sandbox) -> str:
        try:
            _, status = os.waitpid(sb.bwrap_pid, 0)
        except ChildProcessError:
            return "exited"
        sb.bwrap_pid = -1
        return f"exit status {os.waitstatus_to_exitcode(status)}"

    def _fail_open(self, sb: _Sandbox, why: str) -> None:
        self._close(sb.sid)
        self._reply({"ev": "opened", "sid": sb.sid, "error": why})


def _mount_tmpfs(size: int, uid: int, gid: int, template: str | None) -> None:
    """Mount a tmpfs of ``size`` bytes and bind its parts to ``/workspace`` (owned by
    ``uid``; an overlay on ``template`` when given; bound again at ``/home/user``),
    ``/tmp`` and ``/dev/shm`` (in the current mount namespace); the staging mount is
    detached after."""
    syscalls.mount("tmpfs", STAGE, "tmpfs", MS_NOSUID | MS_NODEV,
                   f"size={int(size)},mode=0755,uid=0,gid=0")
    parts = [("ws", 0o700), ("tmp", 0o1777), ("shm", 0o1777)]
    if template is not None:
        parts += [("upper", 0o755), ("work", 0o700)]
    umask = os.umask(0)  # the modes as given (mkdir's are masked by the umask)
    try:
        for part, mode in parts:
            os.mkdir(f"{STAGE}/{part}", mode)
        os.chown(f"{STAGE}/ws", uid, gid)
        if template is not None:
            os.chown(f"{STAGE}/upper", uid, gid)
            # Copy-on-write over the template: a file is copied up when first written
            # (metacopy: a chown copies up only the metadata).
            syscalls.mount("overlay", WORKSPACE, "overlay", MS_NOSUID | MS_NODEV,
                           f"lowerdir={template},upperdir={STAGE}/upper,"
                           f"workdir={STAGE}/work,redirect_dir=on,metacopy=on")
        else:
            syscalls.mount(f"{STAGE}/ws", WORKSPACE, None, MS_BIND)
        syscalls.mount(WORKSPACE, HOME, None, MS_BIND)
        syscalls.mount(f"{STAGE}/tmp", "/tmp", None, MS_BIND)
        syscalls.mount(f"{STAGE}/shm", "/dev/shm", None, MS_BIND)
    finally:
        os.umask(umask)
        syscalls.umount(STAGE, MNT_DETACH)

