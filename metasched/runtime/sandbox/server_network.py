"""A granted network in the sandbox server (:mod:`.server`; see :mod:`.egress`): the
sandbox's rule set loaded by ``nft`` in its net namespace, its ``slirp4netns`` started,
each reporting when done, and ``slirp4netns`` reaped once the sandbox ends. Only the
standard library and this package's :mod:`.syscalls` are imported."""

from __future__ import annotations

import os
import selectors
import sys
from collections.abc import Callable

from metasched.runtime.sandbox import syscalls
from metasched.runtime.sandbox.server_records import _TAIL, _close, _read_all, _Sandbox
from metasched.runtime.sandbox.syscalls import CLONE_NEWNET


class Networking:
    """The sandbox server's steps of giving a sandbox its network (a part of
    :class:`~metasched.runtime.sandbox.server.Server`, which holds the state they use:
    ``sel``, ``sandboxes``, ``own``, ``devnull``)."""

    sel: selectors.BaseSelector
    sandboxes: dict[int, _Sandbox]
    own: dict[str, int]
    devnull: int
    _network_up: Callable[[_Sandbox], None]

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
            # (a gVisor sandbox's namespace has no process of its own: its path)
            target = ([str(sb.init_pid)] if sb.gvisor is None else
                      ["--netns-type=path", f"/proc/{os.getpid()}/fd/{sb.ns['net']}"])
            argv = [*net["slirp"], f"--ready-fd={ready_w}", f"--exit-fd={exit_r}",
                    *target, "tap0"]
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
        if sb.net_pending or self.sandboxes.get(sb.sid) is not sb:
            return
        if sb.gvisor is not None and sb.bwrap_pid < 0:
            self._network_up(sb)  # its container starts now (.server_gvisor)
        elif sb.mounted and not sb.ready:
            self._opened(sb)

    def _reap_slirp(self, sb: _Sandbox) -> None:
        self.sel.unregister(sb.slirp_fd)
        _close(sb.slirp_fd)
        try:
            os.waitpid(sb.slirp_pid, 0)
        except ChildProcessError:
            pass
