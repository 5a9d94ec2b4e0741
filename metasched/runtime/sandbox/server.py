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
standard library and this package's :mod:`.syscalls`, :mod:`.protocol` and
:mod:`.userns` are imported.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import sys
from dataclasses import dataclass, field
from typing import Any

from metasched.runtime.sandbox import protocol, syscalls, userns
from metasched.runtime.sandbox.syscalls import (
    CLONE_NEWIPC,
    CLONE_NEWNET,
    CLONE_NEWNS,
    CLONE_NEWPID,
    CLONE_NEWUTS,
    MNT_DETACH,
    MS_BIND,
    MS_NODEV,
    MS_NOSUID,
    MS_PRIVATE,
    MS_REC,
    MS_REMOUNT,
)

STAGE = "/.sandbox"  # where a sandbox's tmpfs is mounted while its parts are bound out
WORKSPACE = "/workspace"
_NS = (("mnt", CLONE_NEWNS), ("net", CLONE_NEWNET), ("ipc", CLONE_NEWIPC),
       ("uts", CLONE_NEWUTS), ("pid", CLONE_NEWPID))
_SHARED_MOUNTS = (WORKSPACE, "/tmp", "/dev/shm")  # what a sandbox's tmpfs holds
_TAIL = 2048  # bytes of a seeding command's stderr kept for its error message
_DATA_MAX = 60_000  # bytes of a file given to bwrap through a pipe (its buffer: 64 KiB)


@dataclass
class _Sandbox:
    sid: int
    uid: int
    gid: int
    bwrap_pid: int = -1
    bwrap_fd: int = -1  # pidfd
    ready_fd: int = -1  # the stub's stdout: a newline once it runs
    info_fd: int = -1  # bwrap's --info-fd: the pid of the namespaces' init
    block_fd: int = -1  # the stub's stdin: closing it ends the sandbox
    ns: dict[str, int] = field(default_factory=dict)
    workspace: dict[str, Any] = field(default_factory=dict)
    seeding: int = -1  # command id of the template copy running, if any
    seed_err: bytearray = field(default_factory=bytearray)
    seed_err_fd: int = -1
    method: str = ""  # how the workspace was seeded: "", "overlay", "copy" or "tar"
    init_pid: int = -1  # the namespaces' init (bwrap's pid 1), in this server's pid space
    ready: bool = False
    net: dict[str, Any] | None = None  # granted network: {"slirp": argv, "nft": path, ...}
    net_pending: set[str] = field(default_factory=set)  # "rules", "slirp" still starting
    mounted: bool = False  # workspace mounted and seeded (ready once net_pending is empty)
    nft_err_fd: int = -1
    slirp_pid: int = -1
    slirp_fd: int = -1  # pidfd
    slirp_ready_fd: int = -1
    slirp_exit_fd: int = -1  # closing it ends slirp4netns


@dataclass
class _Command:
    cmd: int
    pid: int
    pidfd: int
    sid: int | None = None


class Server:
    """The server's state and event loop (see the module docstring)."""

    def __init__(self, sock: socket.socket, userns_state: str = "open") -> None:
        self.sock = sock
        self.userns = userns_state  # "refused", or why new user namespaces are open
        self.sel = selectors.DefaultSelector()
        self.sandboxes: dict[int, _Sandbox] = {}
        self.commands: dict[int, _Command] = {}
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
        else:
            self._reply(event)

    def _kill(self, cmd: int) -> None:
        c = self.commands.get(cmd)
        if c is not None:
            try:
                os.killpg(c.pid, signal.SIGKILL)
            except OSError:
                pass

    # --- sandboxes ----------------------------------------------------------------------

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

    # --- network (see egress.py) ------------------------------------------------------

    def _start_network(self, sb: _Sandbox) -> None:
        """Load the sandbox's rule set (``nft -f -`` in its net namespace) and start its
        slirp4netns; each reports when done (:meth:`_rules_loaded`, :meth:`_slirp_up`)."""
        net = sb.net
        assert net is not None
        if os.fstat(sb.ns["net"]).st_ino == os.fstat(self.own["net"]).st_ino:
            # never load a sandbox's rules into (or attach its stack to) the host's
            raise OSError(0, "its network namespace is the host's")
        rules_r, rules_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            os.write(rules_w, net["rules"].encode())  # a few hundred bytes: fits the pipe
            _close(rules_w)
            syscalls.setns(sb.ns["net"], CLONE_NEWNET)
            try:
                pid = os.posix_spawn(net["nft"], [net["nft"], "-f", "-"],
                                     {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
                                     file_actions=[(os.POSIX_SPAWN_DUP2, rules_r, 0),
                                                   (os.POSIX_SPAWN_DUP2, err_w, 1),
                                                   (os.POSIX_SPAWN_DUP2, err_w, 2)])
            finally:
                try:
                    syscalls.setns(self.own["net"], CLONE_NEWNET)
                except OSError as e:  # as in _spawn: not safe to go on
                    print(f"sandbox server: cannot return to its own state: {e}",
                          file=sys.stderr)
                    os._exit(1)
        except BaseException:
            _close(err_r)
            raise
        finally:
            for fd in (rules_r, rules_w, err_w):
                _close(fd)
        sb.nft_err_fd = err_r
        sb.net_pending.add("rules")
        pidfd = os.pidfd_open(pid)
        self.sel.register(pidfd, selectors.EVENT_READ,
                          lambda _: self._rules_loaded(sb, pid, pidfd))
        ready_r, ready_w = os.pipe()
        exit_r, sb.slirp_exit_fd = os.pipe()
        try:
            os.set_inheritable(ready_w, True)
            os.set_inheritable(exit_r, True)
            argv = [*net["slirp"], f"--ready-fd={ready_w}", f"--exit-fd={exit_r}",
                    str(sb.init_pid), "tap0"]
            sb.slirp_pid = os.posix_spawn(
                argv[0], argv, {"PATH": "/usr/bin:/bin"},
                file_actions=[(os.POSIX_SPAWN_DUP2, self.devnull, 0),
                              (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
                              (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0)],
                setsid=True)
        except BaseException:
            _close(ready_r)
            raise
        finally:
            _close(ready_w)
            _close(exit_r)
        sb.slirp_fd = os.pidfd_open(sb.slirp_pid)
        sb.slirp_ready_fd = ready_r
        sb.net_pending.add("slirp")
        self.sel.register(ready_r, selectors.EVENT_READ, lambda _: self._slirp_up(sb))

    def _rules_loaded(self, sb: _Sandbox, pid: int, pidfd: int) -> None:
        self.sel.unregister(pidfd)
        _close(pidfd)
        try:
            _, status = os.waitpid(pid, 0)
        except ChildProcessError:
            status = -1
        err = _read_all(sb.nft_err_fd, limit=_TAIL).decode(errors="replace").strip()
        _close(sb.nft_err_fd)
        sb.nft_err_fd = -1
        if self.sandboxes.get(sb.sid) is not sb:
            return  # closed meanwhile
        if status != 0:
            line = err.splitlines()[-1] if err else f"wait status {status}"
            self._fail_open(sb, f"cannot load its network rules: nft: {line}")
            return
        self._net_done(sb, "rules")

    def _slirp_up(self, sb: _Sandbox) -> None:
        self.sel.unregister(sb.slirp_ready_fd)
        try:
            data = os.read(sb.slirp_ready_fd, 16)
        except OSError:
            data = b""
        _close(sb.slirp_ready_fd)
        sb.slirp_ready_fd = -1
        if not data:
            self._fail_open(sb, "cannot give the sandbox network: slirp4netns exited")
            return
        self._net_done(sb, "slirp")

    def _net_done(self, sb: _Sandbox, part: str) -> None:
        sb.net_pending.discard(part)
        if not sb.net_pending and sb.mounted and not sb.ready:
            self._opened(sb)

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

    def _close(self, sid: int) -> None:
        """End a sandbox: its stub's stdin closes, the stub and the namespaces' init
        exit, and the kernel kills whatever is left in its pid namespace."""
        sb = self.sandboxes.pop(sid, None)
        if sb is None:
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

    def _reap_slirp(self, sb: _Sandbox) -> None:
        self.sel.unregister(sb.slirp_fd)
        _close(sb.slirp_fd)
        try:
            os.waitpid(sb.slirp_pid, 0)
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


def _mount_tmpfs(size: int, uid: int, gid: int, template: str | None) -> None:
    """Mount a tmpfs of ``size`` bytes and bind its parts to ``/workspace`` (owned by
    ``uid``; an overlay on ``template`` when given), ``/tmp`` and ``/dev/shm`` (in the
    current mount namespace); the staging mount is detached after."""
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
        syscalls.mount(f"{STAGE}/tmp", "/tmp", None, MS_BIND)
        syscalls.mount(f"{STAGE}/shm", "/dev/shm", None, MS_BIND)
    finally:
        os.umask(umask)
        syscalls.umount(STAGE, MNT_DETACH)


def _searchable(path: bytes) -> bytes:
    """The entries of a ``PATH`` that are directories this process's real user (the
    command's) may search, here (in the sandbox); ``/usr/bin:/bin`` where none is."""
    kept = [d for d in path.split(b":")
            if d.startswith(b"/") and os.access(d, os.X_OK) and os.path.isdir(d)]
    return b":".join(kept) or b"/usr/bin:/bin"


def _read_all(fd: int, limit: int = 1 << 16) -> bytes:
    out = bytearray()
    os.set_blocking(fd, False)
    while len(out) < limit:
        try:
            data = os.read(fd, 4096)
        except BlockingIOError:
            break
        if not data:
            break
        out += data
    return bytes(out[-limit:])


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


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
