"""The sandbox server: a small, single-threaded root process that holds every sandbox's
namespaces and starts each command inside them.

Why a separate process: entering a mount namespace (``setns``) is refused to a
multi-threaded process, and changing user ids in one thread of a threaded process
changes them in all; the dispatcher has threads. Why not a fresh ``bwrap`` or
``unshare`` per command: making namespaces costs 4-8 ms per command here (see
``benchmarks/sandbox_cost.py``), entering existing ones costs tens of µs.

A sandbox is made once, by ``bwrap`` (the mounts, and new pid, ipc, uts and net
namespaces), running a stub (``cat`` on a pipe only this server writes to) as the
namespaces' long-lived process. A sandbox granted network then gets its rule set
(``nft``, run as root in its net namespace) and its user-mode network stack
(``slirp4netns``, ended with it), both started here (see :mod:`.egress`); it is ready
once both are. Then the server mounts the sandbox's
tmpfs: ``/workspace``, ``/tmp`` and ``/dev/shm`` all live on it, so its size is the
sandbox's memory; a template is laid over it with overlayfs (copy-on-write) or copied.

A command is started by ``posix_spawn`` (``vfork``: no copy of this process) after the
server has, for the duration of that one call, moved itself into the command's cgroups
(``0`` written to each slot's ``cgroup.procs``), entered the sandbox's namespaces, taken
the command's ids as its real ids (``setresuid(uid, 0, 0)``, and ``POSIX_SPAWN_RESETIDS``
makes them the child's effective ones: after ``execve`` all three are the unprivileged
ones and no capability is left) and changed to its working directory; then it returns to
its own. The child is therefore confined from its first instruction. A sandboxed
command's ``PATH`` keeps only the absolute directories its user may search there (so
that a missing program reads as missing, not as a refused directory). A throwaway
(trajectory-less) command gets, in addition, a private copy of the sandbox's mount
namespace with a fresh tmpfs of its own on ``/workspace``, ``/tmp`` and ``/dev/shm``;
it disappears with the command's last process.

A GPU's sandbox (its bwrap binds that GPU's device nodes) may share another sandbox's
workspace: instead of a tmpfs of its own, it gets clones (``open_tree``) of the other's
``/workspace``, ``/tmp`` and ``/dev/shm`` mounts, taken in that sandbox's mount
namespace and attached (``move_mount``) in its own: the same files, seen from both.

Every process of a sandbox dies with it: when the server exits, however it exits, the
stubs' pipes close, the stubs exit and with them each pid namespace's init, which makes
the kernel kill everything left in the namespace. The server exits when the dispatcher's
end of the socket closes (the dispatcher exited, or was killed), and when its parent
dies (``PR_SET_PDEATHSIG``).

With ``--refuse-userns`` the server first loads a seccomp filter into itself that
refuses new user namespaces (:mod:`.userns`), which every process it starts inherits;
its reply to ``hello`` says whether that worked (``userns``: ``"refused"``, or why not).

Run as ``python -m metasched.runtime.sandbox.server FD [--refuse-userns]`` with ``FD``
its end of a ``SOCK_SEQPACKET`` pair (see :mod:`.protocol` for the messages); only the
standard library and this package's :mod:`.syscalls`, :mod:`.protocol`,
:mod:`.userns` and the server's parts are imported: :mod:`.server_open` (opening a
sandbox), :mod:`.server_network` (its granted network) and :mod:`.server_records` (what
the server keeps of each sandbox and command).
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import sys
from typing import Any

from metasched.runtime.sandbox import protocol, syscalls, userns
from metasched.runtime.sandbox.server_gvisor import GvisorSandboxes
from metasched.runtime.sandbox.server_gvisor_exec import GvisorExec
from metasched.runtime.sandbox.server_network import Networking
from metasched.runtime.sandbox.server_open import Opening, _mount_tmpfs
from metasched.runtime.sandbox.server_records import _NS, _close, _Command, _Sandbox
from metasched.runtime.sandbox.syscalls import CLONE_NEWNS, MS_PRIVATE, MS_REC


class Server(Opening, Networking, GvisorSandboxes, GvisorExec):
    """The server's state and event loop (see the module docstring): requests, commands
    and a sandbox's end here; opening one in :class:`~.server_open.Opening`, its network
    in :class:`~.server_network.Networking`."""

    def __init__(self, sock: socket.socket, userns_state: str = "open") -> None:
        self.sock = sock
        self.userns = userns_state  # "refused", or why new user namespaces are open
        self.sel = selectors.DefaultSelector()
        self.sandboxes: dict[int, _Sandbox] = {}
        self.commands: dict[int, _Command] = {}
        self.execs: dict[int, Any] = {}  # commands in gVisor sandboxes (.server_gvisor_exec)
        self.home_cgroups: list[int] = []
        self.own = {name: os.open(f"/proc/self/ns/{name}", os.O_RDONLY | os.O_CLOEXEC)
                    for name, _ in _NS}
        self.home_dir = os.getcwd()
        self.devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        self.next_internal = -1  # ids of the server's own commands (template copies)
        sock.setblocking(False)
        self.sel.register(sock, selectors.EVENT_READ, self._on_request)

    # --- loop ---------------------------------------------------------------------------

    def serve(self) -> None:
        """Handle requests and exits until the dispatcher's end closes."""
        self.running = True
        while self.running:
            for key, _ in self.sel.select():
                key.data(key.fileobj)
        self.shutdown()

    def _reply(self, message: dict[str, Any]) -> None:
        try:
            self.sock.setblocking(True)
            protocol.send(self.sock, message)
        except OSError:
            self.running = False
        finally:
            self.sock.setblocking(False)

    def _on_request(self, _: Any) -> None:
        for _ in range(64):  # a bounded batch, then exits get their turn
            try:
                msg, fds = protocol.receive(self.sock)
            except BlockingIOError:
                return
            except OSError:
                msg, fds = None, []
            if msg is None:
                self.running = False
                return
            op = msg.get("op")
            try:
                if op == "spawn":
                    self._spawn_request(msg, fds)
                elif op == "open" and msg.get("gvisor"):
                    self._open_gvisor(msg, fds)
                elif op == "open":
                    self._open(msg)
                elif op == "close":
                    self._close(msg["sid"])
                elif op == "kill":
                    self._kill(msg["cmd"])
                elif op == "hello":
                    self.home_cgroups = fds
                    fds = []
                    self._reply({"re": "hello", "pid": os.getpid(), "userns": self.userns})
                else:
                    self._reply({"re": op, "error": f"unknown request {op!r}"})
            finally:
                for fd in fds:
                    _close(fd)

    # --- commands -----------------------------------------------------------------------

    def _spawn_request(self, msg: dict[str, Any], fds: list[int]) -> None:
        cmd = msg["cmd"]
        try:
            sandbox = self.sandboxes.get(msg.get("sid"))
            if sandbox is not None and sandbox.gvisor is not None and sandbox.ready:
                self._spawn_gvisor(sandbox, msg, fds)  # the reply follows its start
                return
            pid = self._spawn(msg, fds)
        except OSError as e:
            self._reply({"re": "spawn", "cmd": cmd, "errno": e.errno or 0,
                         "error": e.strerror or str(e)})
            return
        except Exception as e:  # noqa: BLE001 - answer, whatever went wrong
            self._reply({"re": "spawn", "cmd": cmd, "errno": 0,
                         "error": f"{type(e).__name__}: {e}"})
            return
        self._watch(cmd, pid, msg.get("sid"))
        self._reply({"re": "spawn", "cmd": cmd, "pid": pid})

    def _watch(self, cmd: int, pid: int, sid: int | None) -> None:
        pidfd = os.pidfd_open(pid)
        self.commands[cmd] = _Command(cmd, pid, pidfd, sid)
        self.sel.register(pidfd, selectors.EVENT_READ, lambda _, c=cmd: self._on_exit(c))

    def _spawn(self, msg: dict[str, Any], fds: list[int]) -> int:
        """Start one command; fds: stdout, stderr, then the slot's cgroup.procs files."""
        sandbox = self.sandboxes.get(msg.get("sid"))  # None: on the host (no isolation)
        if msg.get("sid") is not None and (sandbox is None or not sandbox.ready):
            raise OSError(0, f"sandbox {msg.get('sid')} is not open")
        out, err, *cgroups = fds
        uid, gid = msg["uid"], msg["gid"]
        affinity = msg.get("cores")
        home_affinity = os.sched_getaffinity(0) if affinity else None
        entered: list[str] = []
        moved = False
        try:
            for fd in cgroups:
                os.write(fd, b"0")
            moved = bool(cgroups)
            if affinity:
                os.sched_setaffinity(0, affinity)
            if sandbox is not None:
                for name, flag in _NS:
                    syscalls.setns(sandbox.ns[name], flag)
                    entered.append(name)
                if msg.get("private"):
                    syscalls.unshare(CLONE_NEWNS)  # the command's own copy of the mounts
                    syscalls.mount("none", "/", None, MS_REC | MS_PRIVATE)
                    _mount_tmpfs(msg["private"], uid, gid, template=None)
            os.chdir(msg["cwd"])
            os.umask(msg.get("umask", 0o022))
            os.setresgid(gid, 0, 0)
            os.setresuid(uid, 0, 0)
            try:
                path = msg["env"].get(b"PATH")
                if path is not None:  # posix_spawnp searches this process's PATH
                    if sandbox is not None:
                        path = msg["env"][b"PATH"] = _searchable(path)
                    os.environb[b"PATH"] = path
                return os.posix_spawnp(
                    msg["argv"][0], msg["argv"], msg["env"],
                    file_actions=[(os.POSIX_SPAWN_DUP2, self.devnull, 0),
                                  (os.POSIX_SPAWN_DUP2, out, 1),
                                  (os.POSIX_SPAWN_DUP2, err, 2)],
                    setsid=True, resetids=True,
                    setsigdef=(signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD,
                               signal.SIGTERM, signal.SIGINT, signal.SIGHUP))
            finally:
                os.setresuid(0, 0, 0)
                os.setresgid(0, 0, 0)
        finally:
            # Back to this process's own namespaces, directory and cgroups. If any of
            # these fails the server cannot go on safely: exit (everything dies with it).
            try:
                if entered:
                    for name, flag in _NS:
                        syscalls.setns(self.own[name], flag)
                os.chdir(self.home_dir)
                if home_affinity is not None:
                    os.sched_setaffinity(0, home_affinity)
                if moved:
                    for fd in self.home_cgroups:
                        os.write(fd, b"0")
            except OSError as e:
                print(f"sandbox server: cannot return to its own state: {e}", file=sys.stderr)
                os._exit(1)

    def _on_exit(self, cmd: int) -> None:
        c = self.commands.pop(cmd)
        self.sel.unregister(c.pidfd)
        _close(c.pidfd)
        try:
            os.killpg(c.pid, signal.SIGKILL)  # what is left of its group (the leader is
        except OSError:                       # a zombie, so the group id is still its)
            pass
        try:
            _, status, usage = os.wait4(c.pid, 0)
        except ChildProcessError:
            status, usage = -1, None
        event = {"ev": "exit", "cmd": cmd, "status": status,
                 "maxrss_kb": usage.ru_maxrss if usage else 0,
                 "cpu_s": (usage.ru_utime + usage.ru_stime) if usage else 0.0}
        if cmd < 0:
            self._seeded(c.sid, status)
            return
        self._reply(event)

    def _kill(self, cmd: int) -> None:
        if self._kill_gvisor(cmd):
            return
        c = self.commands.get(cmd)
        if c is not None:
            try:
                os.killpg(c.pid, signal.SIGKILL)
            except OSError:
                pass

    # --- a sandbox's end ---------------------------------------------------------------

    def _close(self, sid: int) -> None:
        """End a sandbox: its stub's stdin closes, the stub and the namespaces' init
        exit, and the kernel kills whatever is left in its pid namespace."""
        sb = self.sandboxes.pop(sid, None)
        if sb is None:
            return
        if sb.gvisor is not None:
            self._close_gvisor(sb)
            return
        for fd in (sb.ready_fd, sb.seed_err_fd, sb.slirp_ready_fd):
            if fd >= 0:
                try:
                    self.sel.unregister(fd)
                except KeyError:  # failed before it was watched
                    pass
        for fd in (sb.ready_fd, sb.info_fd, sb.seed_err_fd, sb.slirp_ready_fd,
                   sb.slirp_exit_fd):  # the last ends its slirp4netns
            if fd >= 0:
                _close(fd)
        if sb.slirp_fd >= 0:
            self.sel.register(sb.slirp_fd, selectors.EVENT_READ,
                              lambda _, s=sb: self._reap_slirp(s))
        for fd in sb.ns.values():
            _close(fd)
        _close(sb.block_fd)
        if sb.bwrap_fd >= 0:
            # Reap bwrap when it exits (soon: its sandbox is ending).
            self.sel.register(sb.bwrap_fd, selectors.EVENT_READ,
                              lambda _, s=sb: self._reap_bwrap(s))

    def _reap_bwrap(self, sb: _Sandbox) -> None:
        self.sel.unregister(sb.bwrap_fd)
        _close(sb.bwrap_fd)
        try:
            if sb.bwrap_pid > 0:
                os.waitpid(sb.bwrap_pid, 0)
        except ChildProcessError:
            pass
    def shutdown(self) -> None:
        """Kill every command and end every sandbox."""
        for c in self.commands.values():
            try:
                os.killpg(c.pid, signal.SIGKILL)
            except OSError:
                pass
        for sid in list(self.sandboxes):
            self._close(sid)


def _searchable(path: bytes) -> bytes:
    """The entries of a ``PATH`` that are directories this process's real user (the
    command's) may search, here (in the sandbox); ``/usr/bin:/bin`` where none is."""
    kept = [d for d in path.split(b":")
            if d.startswith(b"/") and os.access(d, os.X_OK) and os.path.isdir(d)]
    return b":".join(kept) or b"/usr/bin:/bin"


def main(argv: list[str]) -> None:
    """Entry point: ``server FD [--refuse-userns]``."""
    fd = int(argv[1])
    # End with the dispatcher even if its end of the socket outlives it somehow.
    syscalls.parent_death_signal(signal.SIGKILL)
    if os.getppid() == 1:
        sys.exit(0)
    syscalls.no_new_privs()  # no command can regain privileges through setuid binaries
    os.setgroups([])  # commands must not inherit root's supplementary groups
    state = "open (not asked)"
    if "--refuse-userns" in argv[2:]:
        try:
            userns.refuse_user_namespaces()
            state = "refused"
        except OSError as e:
            state = f"open ({e.strerror or e})"
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the dispatcher's to handle
    # Inherited (that is how it came), it would be inherited by every command too, and a
    # command holding it could ask this root process for anything.
    os.set_inheritable(fd, False)
    sock = socket.socket(fileno=fd)
    Server(sock, state).serve()


if __name__ == "__main__":
    main(sys.argv)
