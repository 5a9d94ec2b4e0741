"""gVisor sandboxes in the sandbox server (:mod:`.server`): a sandbox is a runsc
container started detached (its bundle written by the dispatcher: :mod:`.gvisor`); its
commands are started by its exec server (:mod:`.server_gvisor_exec`).

Opening: ``runsc run --detach`` starts inside the sandbox's cgroup slot (its
descriptors come with the ``open`` request), so the sandbox's kernel (the Sentry), its
file proxy (the Gofer) and every thread running the sandbox's programs are confined by
it. The container's init is :data:`.gvisor.INIT`, its stdin a pipe only this server
writes to and its stdout the pipe it answers on: its first newline says it runs; the
exec server is started then, and the sandbox is ready once that says so. A sandbox
granted network gets its network namespace, rules and stack first (:mod:`.server_network`),
and its container is started in that namespace only once both are up: gVisor's sockets
are the namespace's (``--network=host``), and it reads the interfaces once, at its start.

Closing: the init's stdin is closed, the init exits, and with the root container's
init the sandbox ends (gVisor kills every process in it); ``runsc delete --force``
then removes the container's state, and the bundle is removed. When the server dies,
however, the pipe closes and the sandbox ends the same way.
"""

from __future__ import annotations

import os
import selectors
import shutil
import sys
from collections.abc import Callable
from typing import Any

from metasched.runtime.sandbox import syscalls
from metasched.runtime.sandbox.server_records import _close, _Sandbox
from metasched.runtime.sandbox.syscalls import CLONE_NEWNET

_RUNSC_ENV = {"PATH": "/usr/bin:/bin"}


class GvisorSandboxes:
    """The sandbox server's gVisor steps (a part of
    :class:`~metasched.runtime.sandbox.server.Server`, which holds the state they use)."""

    sel: selectors.BaseSelector
    sandboxes: dict[int, _Sandbox]
    home_cgroups: list[int]
    devnull: int

    own: dict[str, int]
    # (the Server's, Opening's and Networking's)
    _reply: Callable[[dict[str, Any]], None]
    _close: Callable[[int], None]
    _opened: Callable[[_Sandbox], None]
    _start_network: Callable[[_Sandbox], None]
    _reap_slirp: Callable[[_Sandbox], None]
    _start_exec: Callable[[_Sandbox, dict[str, str]], None]

    # --- opening ------------------------------------------------------------------------

    def _open_gvisor(self, msg: dict[str, Any], cgroups: list[int]) -> None:
        gv = msg["gvisor"]
        sid = msg["sid"]
        sb = _Sandbox(sid, msg["uid"], msg["gid"], workspace={}, net=msg.get("net"))
        sb.gvisor = gv
        self.sandboxes[sid] = sb
        if sb.net is None:
            self._run_container(sb, cgroups)
            return
        # Granted network: the sandbox's namespace, its rules and its stack first; the
        # container starts in it once both are up (gVisor's sockets are the namespace's,
        # and it reads the namespace's interfaces and routes once, at its start).
        entered = False
        try:
            try:
                syscalls.unshare(CLONE_NEWNET)
                entered = True
                sb.ns["net"] = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            finally:
                self._back_home(False, entered)
            sb.cgroup_fds = [os.dup(fd) for fd in cgroups]  # (the request's close after it)
            self._start_network(sb)  # each part reports: _network_up once both are done
        except OSError as e:
            self._fail_gvisor(sb, f"cannot give the sandbox network: {e.strerror or e}")

    def _network_up(self, sb: _Sandbox) -> None:
        """``sb``'s rules are loaded and its stack is up (``tap0`` configured): start its
        container in its namespace."""
        cgroups, sb.cgroup_fds = sb.cgroup_fds, []
        try:
            self._run_container(sb, cgroups)
        finally:
            for fd in cgroups:
                _close(fd)

    def _run_container(self, sb: _Sandbox, cgroups: list[int]) -> None:
        """``runsc run --detach`` of ``sb``'s container, in its cgroup slot (and its
        network namespace, where it has one); ready once its init and exec server run."""
        gv = sb.gvisor
        assert gv is not None
        err_path = os.path.join(gv["bundle"], "runsc.err")
        try:
            block_r, sb.block_fd = os.pipe()
            sb.ready_fd, ready_w = os.pipe()
            err = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC,
                          0o600)
            argv = [*gv["runsc"], "run", "--detach", "--bundle", gv["bundle"], gv["cid"]]
            moved = entered = False
            try:
                for fd in cgroups:
                    os.write(fd, b"0")
                moved = bool(cgroups)
                entered = self._enter_net(sb)
                sb.bwrap_pid = os.posix_spawn(
                    argv[0], argv, _RUNSC_ENV,
                    file_actions=[(os.POSIX_SPAWN_DUP2, block_r, 0),
                                  (os.POSIX_SPAWN_DUP2, ready_w, 1),
                                  (os.POSIX_SPAWN_DUP2, err, 2)],
                    setsid=True)
            finally:
                self._back_home(moved, entered)
                for fd in (block_r, ready_w, err):
                    _close(fd)
            sb.bwrap_fd = os.pidfd_open(sb.bwrap_pid)
        except OSError as e:
            self._fail_gvisor(sb, f"cannot start runsc: {e.strerror or e}")
            return
        # runsc run --detach exits once the container runs: reap it then.
        self.sel.register(sb.bwrap_fd, selectors.EVENT_READ,
                          lambda _, s=sb: self._reap_runsc(s))
        os.set_blocking(sb.ready_fd, False)
        self.sel.register(sb.ready_fd, selectors.EVENT_READ,
                          lambda _, s=sb: self._agent_said(s))

    def _enter_net(self, sb: _Sandbox) -> bool:
        """Enter ``sb``'s network namespace, where it has one of its own (runsc reaches
        a sandbox through an abstract unix socket: in the sandbox's namespace)."""
        if "net" not in sb.ns:
            return False
        syscalls.setns(sb.ns["net"], CLONE_NEWNET)
        return True

    def _back_home(self, moved: bool, entered: bool) -> None:
        """Back to this process's own cgroups and network namespace (else exit: it
        cannot go on safely)."""
        try:
            if entered:
                syscalls.setns(self.own["net"], CLONE_NEWNET)
            if moved:
                for fd in self.home_cgroups:
                    os.write(fd, b"0")
        except OSError as e:
            print(f"sandbox server: cannot return to its own state: {e}", file=sys.stderr)
            os._exit(1)

    def _reap_runsc(self, sb: _Sandbox) -> None:
        if sb.bwrap_fd < 0:
            return
        self.sel.unregister(sb.bwrap_fd)
        _close(sb.bwrap_fd)
        sb.bwrap_fd = -1
        try:
            _, status = os.waitpid(sb.bwrap_pid, 0)
            sb.runsc_status = os.waitstatus_to_exitcode(status)
        except ChildProcessError:
            pass

    def _agent_said(self, sb: _Sandbox) -> None:
        """The init's first newline says the container runs (its exec server is
        started then). End of file: the sandbox is gone (its commands are reported when
        the exec server's events end)."""
        if sb.ready_fd < 0:  # closed by an earlier event of the same batch
            return
        try:
            data = os.read(sb.ready_fd, 4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.sel.unregister(sb.ready_fd)
            _close(sb.ready_fd)
            sb.ready_fd = -1
            if not sb.mounted:
                self._fail_gvisor(sb, f"runsc failed: {self._runsc_error(sb)}")
            return
        if b"\n" in data and not sb.mounted and sb.exec_pid < 0 and sb.exec_fd < 0:
            self._start_exec(sb, _RUNSC_ENV)  # the init runs: its exec server next

    def _runsc_error(self, sb: _Sandbox) -> str:
        if sb.bwrap_fd >= 0:  # not reaped yet: it is exiting
            try:
                os.waitpid(sb.bwrap_pid, 0)
            except ChildProcessError:
                pass
        try:
            with open(os.path.join(sb.gvisor["bundle"], "runsc.err"), "rb") as f:
                lines = f.read()[-4096:].decode(errors="replace").strip().splitlines()
        except OSError:
            lines = []
        return lines[-1] if lines else "it exited before the sandbox ran"

    def _fail_gvisor(self, sb: _Sandbox, why: str) -> None:
        self._close(sb.sid)
        self._reply({"ev": "opened", "sid": sb.sid, "error": why})

    # --- closing ------------------------------------------------------------------------

    def _close_gvisor(self, sb: _Sandbox) -> None:
        """End ``sb``: the init's stdin closes (the sandbox ends), then runsc deletes
        the container and the bundle goes."""
        if sb.ready_fd >= 0:
            self.sel.unregister(sb.ready_fd)
            _close(sb.ready_fd)
            sb.ready_fd = -1
        _close(sb.block_fd)
        sb.block_fd = -1
        _close(sb.exec_fd)  # the exec server kills what runs and exits (and its events
        sb.exec_fd = -1     # end: its commands are reported then)
        self._delete_container(sb)
        if sb.slirp_ready_fd >= 0:
            self.sel.unregister(sb.slirp_ready_fd)
        for fd in (sb.slirp_ready_fd, sb.slirp_exit_fd, *sb.ns.values(),  # (its stack ends)
                   *sb.cgroup_fds):
            _close(fd)
        sb.cgroup_fds = []
        sb.slirp_ready_fd = sb.slirp_exit_fd = -1
        if sb.slirp_fd >= 0:
            self.sel.register(sb.slirp_fd, selectors.EVENT_READ,
                              lambda _, s=sb: self._reap_slirp(s))

    def _delete_container(self, sb: _Sandbox) -> None:
        """``runsc delete --force`` (in the sandbox's network namespace), then the
        bundle is removed."""
        gv = sb.gvisor
        argv = [*gv["runsc"], "delete", "--force", gv["cid"]]
        entered = False
        try:
            entered = self._enter_net(sb)
            pid = os.posix_spawn(argv[0], argv, _RUNSC_ENV,
                                 file_actions=[(os.POSIX_SPAWN_DUP2, self.devnull, 0),
                                               (os.POSIX_SPAWN_DUP2, self.devnull, 1),
                                               (os.POSIX_SPAWN_DUP2, self.devnull, 2)],
                                 setsid=True)
            pidfd = os.pidfd_open(pid)
        except OSError:
            shutil.rmtree(gv["bundle"], ignore_errors=True)
            return
        finally:
            self._back_home(False, entered)

        def deleted(_: Any) -> None:
            self.sel.unregister(pidfd)
            _close(pidfd)
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
            shutil.rmtree(gv["bundle"], ignore_errors=True)
        self.sel.register(pidfd, selectors.EVENT_READ, deleted)


def _seen(path: str, seen: list[str]) -> bool:
    """Whether host ``path`` is in a gVisor sandbox, at the same place, for anyone: under
    a bound path and every directory down to it searchable by others."""
    path = os.path.realpath(path)  # (/bin: a symlink to usr/bin there as here)
    root = next((b for b in seen if path == b or path.startswith(b.rstrip("/") + "/")), None)
    if root is None:
        return False
    d = path
    while True:
        try:
            if not os.stat(d).st_mode & 0o001:
                return False
        except OSError:
            return False
        if len(d) <= len(root):
            return True
        d = os.path.dirname(d)


def _searchable(path: bytes, seen: list[str]) -> bytes:
    """The entries of a command's ``PATH`` it may search in its gVisor sandbox (the
    bound system directories it can reach, and its own ``/workspace`` and ``/tmp``);
    ``/usr/bin:/bin`` where none is (as :func:`.server._searchable` in a bubblewrap
    sandbox)."""
    kept = []
    for d in path.split(b":"):
        name = os.fsdecode(d)
        if name.startswith("/") and (name.split("/")[1] in ("workspace", "tmp")
                                     or (_seen(name, seen) and os.path.isdir(name))):
            kept.append(d)
    return b":".join(kept) or b"/usr/bin:/bin"


def _check_program(program: bytes | str, path: bytes, seen: list[str]) -> None:
    """Raise ENOENT where ``program`` is certainly not in the sandbox (as a spawn in a
    bubblewrap sandbox does): a name found in none of the system directories of
    ``path``, or a path under a bound one that does not exist. Names in the workspace
    or ``/tmp`` are left to runsc."""
    name = os.fsdecode(program)
    if "/" in name:
        if _seen(os.path.dirname(os.path.normpath(name)) or "/", seen) and not os.path.exists(
                name):
            raise FileNotFoundError(2, "No such file or directory")
        return
    dirs = [os.fsdecode(d) for d in path.split(b":")]
    if any(d.split("/")[1:2] in (["workspace"], ["tmp"]) for d in dirs):
        return
    if not any(os.access(os.path.join(d, name), os.X_OK) for d in dirs):
        raise FileNotFoundError(2, "No such file or directory")
