"""The commands of gVisor sandboxes in the sandbox server (:mod:`.server`): each
sandbox's exec server (:mod:`.gvisor_exec`) started once, by one ``runsc exec`` that
lives as long as the sandbox, and each command a request to it.

Starting: once the container's init is up, ``runsc exec`` (as root in the
sandbox, with CAP_SETUID, CAP_SETGID, CAP_KILL and CAP_DAC_READ_SEARCH only, and
CAP_SYS_ADMIN until it has hidden the root processes' descriptors) runs the sandbox's
``/usr/bin/python3 -I -S -c`` :mod:`.gvisor_exec` with the seccomp program of
:func:`.userns.bpf`; its stdin is a pipe this server writes requests to, its stdout a
pipe it reads events from. Its first event says the sandbox is ready.

A command: the request names its user, ``/workspace``, its environment (``PATH``
reduced to what the sandbox can search, a program certainly absent refused with
ENOENT as in a bubblewrap sandbox) and its cores; the spawn's reply goes back when the
exec server says it started (with the host pid of the sandbox's ``runsc exec``: the
command has none on the host) or why not. Its output comes back in frames and is
written to the command's own stdout and stderr here (buffered where the reader is
slow); its exit (after the exec server has killed what is left of it) is reported once
that output is written, and its descriptors are closed then. A kill request is passed
on (SIGKILL of the command's process group in the sandbox).
"""

from __future__ import annotations

import errno
import json
import os
import selectors
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from metasched.runtime.sandbox import gvisor_exec, gvisor_zygote, userns
from metasched.runtime.sandbox.server_gvisor import _check_program, _searchable
from metasched.runtime.sandbox.server_records import _close, _Sandbox

_SOURCE: str | None = None
_ZYGOTE: str | None = None
_PROGRAM: str | None = None
_CAPS = ("CAP_SETUID", "CAP_SETGID", "CAP_KILL", "CAP_DAC_READ_SEARCH", "CAP_SYS_ADMIN")
_HEADER = gvisor_exec.HEADER


def exec_server_argv(runsc: list[str], cid: str,
                     python_env: dict[str, str] | None = None) -> list[str]:
    """``runsc exec`` of a sandbox's exec server (see the module docstring); with
    ``python_env``, its zygote (:mod:`.gvisor_zygote`) started in that environment."""
    global _SOURCE, _ZYGOTE, _PROGRAM
    if _SOURCE is None:
        with open(gvisor_exec.__file__) as f:
            _SOURCE = f.read()
        with open(gvisor_zygote.__file__) as f:
            _ZYGOTE = f.read()
        _PROGRAM = userns.bpf(affinity_owner=gvisor_exec.OWNER).hex()
    caps = [a for c in _CAPS for a in ("--cap", c)]
    zygote = [] if python_env is None else [str(_ZYGOTE), json.dumps(python_env)]
    return [*runsc, "exec", "--user", "0:0", *caps, cid,
            "/usr/bin/python3", "-I", "-S", "-c", _SOURCE, str(_PROGRAM), *zygote]


@dataclass
class _Exec:
    """A command running in a gVisor sandbox: where its output goes (and what of it
    waits to be written), and its exit held until that is written."""

    sid: int
    fds: dict[int, int]  # frame kind (1, 2): the command's stdout, stderr
    pending: dict[int, bytearray] = field(default_factory=dict)
    exit: dict[str, Any] | None = None
    started: bool = False  # the spawn's reply sent


class GvisorExec:
    """The exec-server part of :class:`~metasched.runtime.sandbox.server.Server`."""

    sel: selectors.BaseSelector
    sandboxes: dict[int, _Sandbox]
    execs: dict[int, _Exec]
    _reply: Callable[[dict[str, Any]], None]
    _enter_net: Callable[[_Sandbox], bool]
    _back_home: Callable[[bool, bool], None]
    _fail_gvisor: Callable[[_Sandbox, str], None]
    _opened: Callable[[_Sandbox], None]

    def _start_exec(self, sb: _Sandbox, env: dict[str, str]) -> None:
        """Start ``sb``'s exec server (its init is up); ready on its first event."""
        gv = sb.gvisor
        assert gv is not None
        argv = exec_server_argv(gv["runsc"], gv["cid"], gv.get("python_env"))
        req_r, req_w = os.pipe2(os.O_CLOEXEC)
        ev_r, ev_w = os.pipe2(os.O_CLOEXEC)
        err = os.open(os.path.join(gv["bundle"], "exec.err"),
                      os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        entered = False
        try:
            entered = self._enter_net(sb)
            sb.exec_pid = os.posix_spawn(argv[0], argv, env,
                                         file_actions=[(os.POSIX_SPAWN_DUP2, req_r, 0),
                                                       (os.POSIX_SPAWN_DUP2, ev_w, 1),
                                                       (os.POSIX_SPAWN_DUP2, err, 2)],
                                         setsid=True)
        except OSError as e:
            for fd in (req_w, ev_r):
                _close(fd)
            self._fail_gvisor(sb, f"cannot start the exec server: {e.strerror or e}")
            return
        finally:
            self._back_home(False, entered)
            for fd in (req_r, ev_w, err):
                _close(fd)
        sb.exec_fd, sb.events_fd = req_w, ev_r
        os.set_blocking(ev_r, False)
        self.sel.register(ev_r, selectors.EVENT_READ, lambda _, s=sb: self._exec_said(s))

    def _exec_said(self, sb: _Sandbox) -> None:
        """Frames from ``sb``'s exec server; end of file: it is gone (the sandbox with
        it: commands still running there are reported lost)."""
        try:
            data = os.read(sb.events_fd, 1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._exec_gone(sb)
            return
        buf = sb.events
        buf += data
        while len(buf) >= _HEADER.size:
            cmd, kind, n = _HEADER.unpack_from(buf)
            if len(buf) < _HEADER.size + n:
                break
            body = bytes(buf[_HEADER.size:_HEADER.size + n])
            del buf[:_HEADER.size + n]
            self._frame(sb, cmd, kind, body)

    def _frame(self, sb: _Sandbox, cmd: int, kind: int, body: bytes) -> None:
        if cmd == 0:  # the exec server is up: the sandbox is ready once its network is
            sb.mounted = True
            if not sb.net_pending:
                self._opened(sb)
            return
        ex = self.execs.get(cmd)
        if ex is None:
            return
        if kind == gvisor_exec.STARTED:
            if body.startswith(b"-"):
                del self.execs[cmd]
                for fd in ex.fds.values():
                    _close(fd)
                code = int(body[1:])
                self._reply({"re": "spawn", "cmd": cmd, "errno": code,
                             "error": os.strerror(code)})
            else:
                ex.started = True
                self._reply({"re": "spawn", "cmd": cmd, "pid": sb.exec_pid})
        elif kind == gvisor_exec.EXITED:
            ev = json.loads(body)
            ex.exit = {"ev": "exit", "cmd": cmd, "status": ev["status"],
                       "maxrss_kb": ev.get("maxrss_kb", 0), "cpu_s": ev.get("cpu_s", 0.0)}
            self._exec_flushed(cmd, ex)
        elif kind in ex.fds:
            self._write_out(cmd, ex, kind, body)

    def _write_out(self, cmd: int, ex: _Exec, kind: int, data: bytes) -> None:
        """Write a chunk of output to the command's descriptor (behind what waits)."""
        fd = ex.fds[kind]
        if fd < 0:
            return
        if kind in ex.pending:
            ex.pending[kind] += data
            return
        try:
            done = os.write(fd, data)
        except BlockingIOError:
            done = 0
        except OSError:  # nobody reads it any more
            _close(fd)
            ex.fds[kind] = -1
            return
        if done < len(data):
            ex.pending[kind] = bytearray(data[done:])
            self.sel.register(fd, selectors.EVENT_WRITE,
                              lambda _, c=cmd, e=ex, k=kind: self._drain(c, e, k))

    def _drain(self, cmd: int, ex: _Exec, kind: int) -> None:
        fd, buf = ex.fds[kind], ex.pending[kind]
        try:
            done = os.write(fd, buf)
        except BlockingIOError:
            return
        except OSError:
            done = len(buf)
        del buf[:done]
        if not buf:
            self.sel.unregister(fd)
            del ex.pending[kind]
            self._exec_flushed(cmd, ex)

    def _exec_flushed(self, cmd: int, ex: _Exec) -> None:
        """Report the command's exit once it has exited and its output is written."""
        if ex.exit is None or ex.pending:
            return
        del self.execs[cmd]
        for fd in ex.fds.values():
            _close(fd)
        self._reply(ex.exit)

    def _spawn_gvisor(self, sb: _Sandbox, msg: dict[str, Any], fds: list[int]) -> None:
        """Ask ``sb``'s exec server to start a command (fds: stdout, stderr, then its
        slot's cgroup.procs files: unused, the container's slot holds its grant); the
        reply follows from the exec server's answer."""
        gv = sb.gvisor
        assert gv is not None
        env = dict(msg["env"])
        if b"PATH" in env:
            env[b"PATH"] = _searchable(env[b"PATH"], gv["seen"])
        if not msg.get("wipe"):  # (a wipe runs no program)
            _check_program(msg["argv"][0], env.get(b"PATH", b"/usr/bin:/bin"), gv["seen"])
        if sb.exec_fd < 0:
            raise OSError(errno.ESRCH, "the sandbox's exec server is gone")
        request = {"run": msg["cmd"], "argv": [os.fsdecode(a) for a in msg["argv"]],
                   "env": {os.fsdecode(k): os.fsdecode(v) for k, v in env.items()},
                   "uid": msg["uid"], "gid": msg["gid"], "cwd": msg["cwd"],
                   "cores": msg.get("cores"), "wipe": bool(msg.get("wipe"))}
        out, err = os.dup(fds[0]), os.dup(fds[1])
        for fd in (out, err):
            os.set_blocking(fd, False)
        self.execs[msg["cmd"]] = _Exec(sb.sid, {gvisor_exec.OUT: out, gvisor_exec.ERR: err})
        try:
            os.write(sb.exec_fd, json.dumps(request).encode() + b"\n")
        except OSError:
            del self.execs[msg["cmd"]]
            for fd in (out, err):
                _close(fd)
            raise

    def _kill_gvisor(self, cmd: int) -> bool:
        """Pass a kill on to the command's exec server (False: not a gVisor command)."""
        ex = self.execs.get(cmd)
        if ex is None:
            return False
        sb = self.sandboxes.get(ex.sid)
        if sb is not None and sb.exec_fd >= 0:
            try:
                os.write(sb.exec_fd, json.dumps({"kill": cmd}).encode() + b"\n")
            except OSError:
                pass
        return True

    def _exec_gone(self, sb: _Sandbox) -> None:
        """``sb``'s exec server ended (the sandbox closed, or it died): its commands are
        reported (killed by SIGKILL, with everything in the sandbox, where their exit
        was not known), and the ``runsc exec`` reaped."""
        if sb.events_fd >= 0:
            self.sel.unregister(sb.events_fd)
            _close(sb.events_fd)
            sb.events_fd = -1
        _close(sb.exec_fd)
        sb.exec_fd = -1
        if sb.exec_pid > 0:
            try:
                os.waitpid(sb.exec_pid, 0)
            except ChildProcessError:
                pass
            sb.exec_pid = -1
        if not sb.mounted:
            self._fail_gvisor(sb, "the exec server did not start: " + _last_line(
                os.path.join(sb.gvisor["bundle"], "exec.err") if sb.gvisor else ""))
            return
        for cmd, ex in list(self.execs.items()):
            if ex.sid != sb.sid:
                continue
            for kind in list(ex.pending):
                self.sel.unregister(ex.fds[kind])
            ex.pending.clear()
            if ex.exit is None:
                ex.exit = {"ev": "exit", "cmd": cmd, "status": int(signal.SIGKILL),
                           "maxrss_kb": 0, "cpu_s": 0.0}  # killed with its sandbox
                if not ex.started:
                    del self.execs[cmd]
                    for fd in ex.fds.values():
                        _close(fd)
                    self._reply({"re": "spawn", "cmd": cmd, "errno": errno.ESRCH,
                                 "error": "the sandbox ended"})
                    continue
            self._exec_flushed(cmd, ex)


def _last_line(path: str) -> str:
    try:
        with open(path, "rb") as f:
            lines = f.read()[-4096:].decode(errors="replace").strip().splitlines()
    except OSError:
        lines = []
    return lines[-1] if lines else "it exited"
