"""The zygote of a gVisor sandbox: a ``python3`` started once, which forks a warm
interpreter for each ``python3`` command of the sandbox instead of an exec and an
interpreter start-up (under gVisor's ptrace platform, ``python3 -c 'print(42)'`` costs
94-137 ms against 38 ms in a bubblewrap sandbox; a fork of a started interpreter a
fraction of that).

This file runs inside the container as ``/usr/bin/python3 -c`` its source, with no
flags, in the Python environment of the sandbox's commands (the variables of
:data:`.gvisor_exec.PYTHON_ENV`): started as a command's ``python3 FILE`` would be, so that the
interpreter a command gets (``sys.flags``, ``sys.path`` with its site directories, the
modules a started interpreter holds, the encodings) is the one an exec would give it.
The exec server (:mod:`.gvisor_exec`) forks and execs it once, before it reads any
request: root with ``CAP_SETUID`` and ``CAP_SETGID`` only, no new privileges, the
sandbox's seccomp filter (its affinity owner this process), its descriptors hidden in
``/proc``; fd 3 a ``SOCK_SEQPACKET`` socket to the exec server, 0 and 1 ``/dev/null``.

It never runs a command's code and never reads a request: each order from the exec
server is the cores of a command (4-byte integers) and three descriptors (a memfd
holding the request, the write ends of the command's stdout and stderr). It sets its
affinity to the cores, forks, and answers ``PID ERRNO`` (0: started) once the child
has taken its request on (its identity, directory and descriptors: :func:`_become`);
``x PID STATUS MAXRSS_KB CPU_S`` when a child has exited. Every child is a copy of this
process as it was before any request, and a child reads its own request only.

A child (:func:`_become`, then :func:`_run`): its own session, no supplementary
groups, the request's gid and uid, its ``cwd``, stdin ``/dev/null``; the request's
environment exactly; the modules this file imported beyond a started interpreter's
forgotten; ``sys.argv``, ``sys.path[0]``, ``sys.executable`` as ``python3 FILE ARGS``
or ``python3 -c CODE ARGS`` set them; a fresh ``__main__``; then the code, ending as
the interpreter ends (an uncaught exception printed as it prints it, status 1;
``SystemExit``'s code; threads joined and ``atexit`` run).
"""

import sys

_STARTED = frozenset(sys.modules)  # what a started interpreter holds before its code

import json  # noqa: E402
import os  # noqa: E402
import select  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import struct  # noqa: E402


def _serve() -> tuple:
    """Fork a child for each order until the exec server's socket closes (then exit);
    returns only in a child: its request and its status descriptor."""
    me = os.getpid()
    sock = socket.socket(fileno=3)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sock.send(b"ready")
    while True:
        try:
            ready, _, _ = select.select([sock, wake_r], [], [])
        except InterruptedError:
            continue
        if wake_r in ready:
            _drain(wake_r)
            _reap(sock)
        if sock not in ready:
            continue
        data, fds, _, _ = socket.recv_fds(sock, 4096, 3)
        if not data:
            os._exit(0)
        cores = struct.unpack(f"<{len(data) // 4}I", data)
        os.sched_setaffinity(me, cores)  # the child inherits it
        status_r, status_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in (sock.detach(), wake_r, wake_w, status_r):
                os.close(fd)
            return fds, status_w
        for fd in (*fds, status_w):
            os.close(fd)
        why = b""
        while True:
            chunk = os.read(status_r, 64)
            if not chunk:
                break
            why += chunk
        os.close(status_r)
        sock.send(b"%d %d" % (pid, int(why or 0)))


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock.send(b"x %d %d %d %r" % (pid, status, usage.ru_maxrss,
                                      usage.ru_utime + usage.ru_stime))


def _become(fds: list, status_w: int) -> dict:
    """Take the request on in a new child: read it, then its session, groups, gid, uid,
    directory and descriptors; on a failure its errno to the zygote, and exit."""
    memfd, out_w, err_w = fds
    try:
        chunks = []
        while True:
            chunk = os.read(memfd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
        os.close(memfd)
        req = json.loads(b"".join(chunks))
        os.setsid()
        os.setgroups([])
        os.setgid(req["gid"])
        os.setuid(req["uid"])
        os.chdir(req["cwd"])  # (as its user: this root may not search it)
        null = os.open("/dev/null", os.O_RDONLY)
        for fd, to in ((null, 0), (out_w, 1), (err_w, 2)):
            os.dup2(fd, to)
            os.close(fd)
    except OSError as e:
        os.write(status_w, b"%d" % (e.errno or 1))
        os._exit(127)
    os.close(status_w)
    return req


def _run(req: dict) -> None:
    """Run the request's code as ``python3`` would, in this (forked) interpreter."""
    argv = req["argv"]
    os.environ.clear()
    os.environ.update(req["env"])
    for name in set(sys.modules) - _STARTED:
        del sys.modules[name]
    sys.executable = req["executable"]
    sys.orig_argv = list(argv)
    main = type(sys)("__main__")
    main.__builtins__ = sys.modules["builtins"]
    main.__annotations__ = {}
    if argv[1] == "-c":
        source, filename = argv[2], "<string>"
        sys.argv = ["-c", *argv[3:]]
        main.__loader__ = sys.modules["_frozen_importlib"].BuiltinImporter
        first = ""
    else:
        filename = os.path.join(os.getcwd(), argv[1])
        sys.argv = argv[1:]
        try:
            with open(filename, "rb") as f:
                source = f.read()
        except OSError as e:
            sys.stderr.write(f"{argv[0]}: can't open file {filename!r}: "
                             f"[Errno {e.errno}] {e.strerror}\n")
            sys.exit(2)
        main.__file__, main.__cached__ = filename, None
        main.__loader__ = sys.modules["_frozen_importlib_external"].SourceFileLoader(
            "__main__", filename)
        first = os.path.dirname(os.path.realpath(filename))
    if not sys.flags.safe_path:
        sys.path[0] = first
    sys.modules["__main__"] = main
    try:
        exec(compile(source, filename, "exec", dont_inherit=True), main.__dict__)
    except SystemExit:
        raise
    except BaseException as e:  # printed as the interpreter prints it: from the code on
        tb = e.__traceback__.tb_next  # (this frame's own entry left out)
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        sys.exit(1)


if __name__ == "__main__":
    _run(_become(*_serve()))
