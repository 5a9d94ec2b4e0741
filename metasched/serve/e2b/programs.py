"""The small programs an E2B sandbox's calls run inside it, each as one ``cpu`` action
of the sandbox's trajectory (the service never reaches into a sandbox: see
:mod:`metasched.serve.files`).

- :func:`process_argv`: a command, started by a watcher (``sh``, or ``python3`` for a
  command given standard input) that runs it in its own process group, feeds it the
  standard input that :func:`input_argv` appends to a file, sends it the signal
  that :func:`signal_argv` leaves in a file (the sandbox's control directory,
  :data:`CONTROL`, in its workspace) and, where the service reads them while it runs
  (:mod:`.output`), writes its stdout and stderr to files there.
- :func:`fs_argv`: one filesystem operation (``stat``, ``list``, ``mkdir``, ``remove``,
  ``move``, ``read``, ``write``; ``commit``: an upload's files renamed into place from
  their temporary names, or written from base64 pieces), printed as one JSON object.

Paths are the workspace's: relative ones from its root, ``/home/user`` (E2B's home) and
``~`` standing for it, any other absolute path only where it lies in the workspace. A
path that leads out of it, by ``..`` or through a symbolic link, is refused (the
program checks the real path of what it touches, or of the nearest existing parent of
what it creates).
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterator, Mapping, Sequence

from metasched.serve.files import PER_COMMAND, PIECE

__all__ = ["CONTROL", "HOME", "fs_argv", "input_argv", "process_argv", "signal_argv",
           "write_argvs"]

CONTROL = ".e2b"  # the control directory, in the workspace
HOME = "/home/user"  # E2B's home directory: the workspace here
PYTHON = ("python3", "-I", "-S")  # isolated (no PYTHON* variables), no site-packages

# Shared by both programs: the workspace's root and the sandboxes of paths.
_PATHS = r"""import os, sys
ROOT = os.path.realpath(os.getcwd())
# the workspace's other names: /home/user where it is the workspace again (a second mount)
SAME = [ROOT] + [h for h in ("/home/user",) if h != ROOT and os.path.isdir(h)
                 and os.path.samefile(h, ROOT)]
class Refused(Exception):
    pass
def inside(p):
    return any(p == r or p.startswith(r.rstrip("/") + "/") for r in SAME)
def place(p):
    if "\0" in p:
        raise Refused("holds a NUL character")
    for home in ("/home/user", "~"):
        if p == home or p.startswith(home + "/"):
            p = p[len(home):].lstrip("/")
    full = os.path.normpath(os.path.join(ROOT, p))
    if not inside(full):
        raise Refused("is outside the sandbox's workspace")
    return full
def real(full, missing_ok=False):
    probe = full
    while missing_ok and not os.path.lexists(probe) and probe != ROOT:
        probe = os.path.dirname(probe)
    if not inside(os.path.realpath(probe)):
        raise Refused("leads outside the sandbox's workspace (a symbolic link)")
    return full
"""

# argv[1:]: control dir, pid, "1" to feed stdin, cwd ("" for the root), "1" to write the
# command's output to files, the command.
# Only built-in modules (no subprocess, signal or json: their imports cost more than the
# rest of a short command).
_WATCH = _PATHS + r"""import time
ctl, pid, feed, cwd, files = sys.argv[1:6]
argv = sys.argv[6:]
ctl = os.path.join(ROOT, ctl)
os.makedirs(ctl, exist_ok=True)
base = os.path.join(ctl, pid)
HOME = "/home/user" if os.path.isdir("/home/user") else ROOT  # the workspace there
env = dict(os.environ, HOME=HOME, PWD=HOME)
try:
    cwd = HOME + real(place(cwd))[len(ROOT):] if cwd else HOME
    env["PWD"] = cwd
except Refused as e:
    sys.stderr.write(f"cwd: {sys.argv[4]!r} {e}\n")
    sys.exit(126)
if feed == "1":
    rfd, wfd = os.pipe()
else:
    rfd, wfd = os.open(os.devnull, os.O_RDONLY), None
if files == "1":
    outs = [os.open(base + s, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            for s in (".out", ".err")]
else:
    outs = [1, 2]
child = os.fork()
if child == 0:
    try:
        os.setsid()
        os.dup2(rfd, 0)
        os.dup2(outs[0], 1)
        os.dup2(outs[1], 2)
        if wfd is not None:
            os.close(wfd)
        if cwd:
            os.chdir(cwd)
        os.execvpe(argv[0], argv, env)
    except OSError as e:
        os.write(2, f"{argv[0]}: {e.strerror or e}\n".encode())
    os._exit(127)
os.close(rfd)
if files == "1":
    os.close(outs[0])
    os.close(outs[1])
if wfd is not None:
    os.set_blocking(wfd, False)
fed, pending, delay = 0, b"", 0.001
while True:
    done, status = os.waitpid(child, os.WNOHANG)
    if done:
        break
    time.sleep(delay)
    delay = min(delay * 2, 0.02)
    for name in (base + ".signal", os.path.join(ctl, "all.signal")):
        try:
            with open(name) as f:
                os.killpg(child, int(f.read().strip() or 9))
        except (OSError, ValueError):
            pass
    if wfd is not None:
        try:
            with open(base + ".stdin", "rb") as f:
                f.seek(fed)
                data = f.read()
            fed += len(data)
            pending += data
        except FileNotFoundError:
            pass
        try:
            if pending:
                pending = pending[os.write(wfd, pending):]
            elif os.path.exists(base + ".eof"):
                os.close(wfd)
                wfd = None
        except BlockingIOError:
            pass
        except OSError:
            os.close(wfd)
            wfd = None
for suffix in (".signal", ".stdin", ".eof"):
    try:
        os.unlink(base + suffix)
    except OSError:
        pass
if os.WIFSIGNALED(status):
    import _signal
    _signal.signal(os.WTERMSIG(status), _signal.SIG_DFL)
    os.kill(os.getpid(), os.WTERMSIG(status))
sys.exit(os.waitstatus_to_exitcode(status))
"""

# argv[1]: the operation (JSON); argv[2:]: base64 pieces (write).
_FS = _PATHS + r"""import base64, json, pwd, grp, stat
KINDS = {stat.S_IFREG: "file", stat.S_IFDIR: "dir", stat.S_IFLNK: "symlink"}
def name_of(f, i):
    try:
        return f(i)[0]
    except KeyError:
        return str(i)
def entry(full):
    st = os.lstat(full)
    kind = KINDS.get(stat.S_IFMT(st.st_mode), "file")
    target = None
    if kind == "symlink":
        target = os.readlink(full)
        try:
            if inside(os.path.realpath(full)):
                kind = KINDS.get(stat.S_IFMT(os.stat(full).st_mode), "file")
        except OSError:
            pass
    rel = os.path.relpath(full, ROOT)
    return {"name": os.path.basename(full) if full != ROOT else "", "type": kind,
            "path": "/home/user" + ("" if rel == "." else "/" + rel), "size": st.st_size,
            "mode": stat.S_IMODE(st.st_mode), "permissions": stat.filemode(st.st_mode),
            "owner": name_of(pwd.getpwuid, st.st_uid), "group": name_of(grp.getgrgid, st.st_gid),
            "mtime": st.st_mtime, "symlink": target, "is_symlink": stat.S_ISLNK(st.st_mode)}
def listing(full, depth):
    out = []
    for name in sorted(os.listdir(full)):
        p = os.path.join(full, name)
        if p == os.path.join(ROOT, ".e2b"):
            continue
        e = entry(p)
        out.append(e)
        if depth > 1 and e["type"] == "dir" and not e["is_symlink"]:
            out.extend(listing(p, depth - 1))
    return out
def run(op):
    kind = op["op"]
    if kind == "write":
        full = real(place(op["path"]), missing_ok=True)
        if os.path.isdir(full):
            raise IsADirectoryError(21, "Is a directory")
        os.makedirs(os.path.dirname(full), exist_ok=True)
        real(full, missing_ok=True)
        with open(full, "ab" if op.get("append") else "wb") as f:
            for piece in sys.argv[2:]:
                f.write(base64.b64decode(piece))
        return entry(full)
    if kind == "commit":  # uploads: each file whole under its name, or not at all
        out, n = [], 2
        for f in op["files"]:
            full = real(place(f["path"]), missing_ok=True)
            if os.path.isdir(full):
                raise IsADirectoryError(21, "Is a directory")
            os.makedirs(os.path.dirname(full), exist_ok=True)
            target = os.path.realpath(real(full, missing_ok=True))  # through a link in
            src = f.get("from") or ".e2b/up-%s-%d" % (op["spill"], len(out))
            src = place(src)
            if not f.get("from"):
                os.makedirs(os.path.dirname(src), exist_ok=True)
                with open(src, "wb") as w:
                    for piece in sys.argv[n:n + f["pieces"]]:
                        w.write(base64.b64decode(piece))
                n += f["pieces"]
            if os.path.exists(target):  # its mode stays as it was
                os.chmod(src, stat.S_IMODE(os.stat(target).st_mode))
            try:
                os.replace(src, target)
            except OSError as e:  # another mount of the workspace (/home/user)
                if e.errno != 18:
                    raise
                import shutil
                shutil.copyfile(src, target)
                os.unlink(src)
            out.append(entry(full))
        return out
    if kind == "mkdir":
        full = real(place(op["path"]), missing_ok=True)
        if os.path.isdir(full):
            return {"exists": True, "entry": entry(full)}
        os.makedirs(full)
        return {"exists": False, "entry": entry(full)}
    if kind == "remove":
        full = place(op["path"])
        if full == ROOT:
            raise Refused("is the workspace itself")
        real(os.path.dirname(full))
        if not os.path.lexists(full):
            raise FileNotFoundError(2, "No such file or directory")
        if os.path.isdir(full) and not os.path.islink(full):
            import shutil
            shutil.rmtree(full)
        else:
            os.unlink(full)
        return {}
    if kind == "move":
        src, dst = place(op["path"]), real(place(op["to"]), missing_ok=True)
        real(os.path.dirname(src))
        if not os.path.lexists(src):
            raise FileNotFoundError(2, "No such file or directory")
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.rename(src, dst)
        return entry(dst)
    full = real(place(op["path"]))
    if kind == "stat":
        return entry(full)
    if kind == "list":
        if not os.path.isdir(full):
            raise NotADirectoryError(20, "Not a directory")
        return listing(full, op.get("depth", 1))
    if kind == "read":
        if os.path.isdir(full):
            raise IsADirectoryError(21, "Is a directory")
        with open(full, "rb") as f:
            f.seek(op["offset"])
            data = f.read(op["length"])
        return {"size": os.path.getsize(full), "data": base64.b64encode(data).decode()}
    raise Refused("unknown operation " + kind)
try:
    op = json.loads(sys.argv[1])
    text = json.dumps({"ok": run(op)})
    if len(text) > op.get("limit", len(text)):  # past what the result keeps: in a file
        spill = os.path.join(ROOT, ".e2b", "out-" + op["spill"] + ".json")
        os.makedirs(os.path.dirname(spill), exist_ok=True)
        with open(spill, "w") as f:
            f.write(text)
        text = json.dumps({"spilled": ".e2b/out-" + op["spill"] + ".json"})
    print(text)
except Refused as e:
    print(json.dumps({"error": ["invalid", f"path: {e}"]}))
except FileNotFoundError as e:
    print(json.dumps({"error": ["not_found", f"path: {e.strerror}"]}))
except FileExistsError as e:
    print(json.dumps({"error": ["exists", f"path: {e.strerror}"]}))
except PermissionError as e:
    print(json.dumps({"error": ["denied", f"path: {e.strerror}"]}))
except (OSError, ValueError) as e:
    print(json.dumps({"error": ["invalid", f"path: {getattr(e, 'strerror', None) or e}"]}))
"""


# The watcher of a process without standard input, in sh (a few milliseconds where
# python3 takes tens): the command runs in a session of its own (setsid: its process
# group), a second job polls for a signal to pass on to that group; argv[1:]: control dir, pid,
# cwd, "1" to write the command's output to files, the command.
_SH_WATCH = r"""ctl=$PWD/$1 pid=$2 cwd=$3 files=$4
shift 4
mkdir -p "$ctl" || exit 126
home=$PWD
if [ -d /home/user ]; then home=/home/user; fi
export HOME="$home"
# The workspace as the kernel names it, under both of its paths (/home/user is the
# workspace mounted a second time where the sandbox has it).
root=$(pwd -P)
hroot=$(cd -- "$home" && pwd -P) || exit 126
case $cwd in
  /home/user|/home/user/*) cwd=$home${cwd#/home/user} ;;
  "~"|"~/"*) cwd=$home${cwd#"~"} ;;
  "") cwd=$home ;;
esac
cd -- "$cwd" || exit 126
case $(pwd -P) in
  "$root"|"$root"/*|"$hroot"|"$hroot"/*) ;;
  *) echo "cwd: '$3' leads outside the sandbox's workspace (a symbolic link)" >&2; exit 126 ;;
esac
if [ "$files" = 1 ]; then
  exec >"$ctl/$pid.out" 2>"$ctl/$pid.err"
fi
if command -v setsid >/dev/null; then setsid "$@" </dev/null & else "$@" </dev/null & fi
child=$!
(while kill -0 "$child" 2>/dev/null; do
  for f in "$ctl/$pid.signal" "$ctl/all.signal"; do
    if [ -f "$f" ]; then kill -"$(cat "$f")" -"$child"; fi
  done
  sleep 0.05
done) >/dev/null 2>&1 &
poller=$!
wait "$child"
code=$?
kill "$poller" 2>/dev/null
rm -f "$ctl/$pid.signal"
if [ "$code" -gt 128 ] && [ "$code" -lt 160 ]; then
  trap - INT QUIT TERM HUP
  kill -s "$((code - 128))" "$$"
fi
exit "$code"
"""


def checked_cwd(cwd: str) -> str:
    """``cwd`` if it names a place in the workspace (``/home/user/...``, ``~/...`` or
    relative to the home), as the watchers read it; else ValueError (one line): a path
    outside the workspace, even one inside the sandbox (``/etc``, ``..``), is refused
    before anything runs (a symbolic link out is the watcher's to refuse)."""
    if "\0" in cwd:
        raise ValueError(f"cwd: {cwd[:200]!r} holds a NUL character")
    rel = cwd
    for home in (HOME, "~"):
        if rel == home or rel.startswith(home + "/"):
            rel = rel[len(home):].lstrip("/")
            break
    full = posixpath.normpath(posixpath.join(HOME, rel))
    if full != HOME and not full.startswith(HOME + "/"):
        raise ValueError(f"cwd: {cwd[:200]!r} is outside the sandbox's workspace "
                         f"({HOME})")
    return cwd


def process_argv(pid: int, argv: Sequence[str], *, cwd: str = "", stdin: bool = False,
                 files: bool = False) -> list[str]:
    """The action's argv that runs ``argv`` as process ``pid`` of the sandbox (in
    ``cwd``, a workspace path; with its standard input fed from what
    :func:`input_argv` writes when ``stdin``, else from ``/dev/null``; its stdout and
    stderr written to ``.e2b/<pid>.out`` and ``.err`` when ``files``, else the
    action's own, see :mod:`.output`)."""
    flag = "1" if files else "0"
    if not stdin:
        return ["/bin/sh", "-c", _SH_WATCH, "watch", CONTROL, str(pid), cwd, flag, *argv]
    return [*PYTHON, "-c", _WATCH, CONTROL, str(pid), "1", cwd, flag, *argv]


def signal_argv(pid: int | None, signum: int) -> list[str]:
    """The action's argv that sends ``signum`` to process ``pid`` (None: every process
    of the sandbox), through its watcher."""
    name = "all" if pid is None else str(pid)
    return ["/bin/sh", "-c", 'mkdir -p "$0" && printf %s "$1" > "$0/$2.signal"', CONTROL,
            str(signum), name]


def input_argv(pid: int, data: bytes | None) -> list[str]:
    """The action's argv that appends ``data`` to process ``pid``'s standard input
    (None: closes it, once what was written is read)."""
    if data is None:
        return ["/bin/sh", "-c", 'touch "$0/$1.eof"', CONTROL, str(pid)]
    import base64

    text = base64.b64encode(data).decode()
    return [*PYTHON, "-c", "import base64, sys\nwith open(sys.argv[1], 'ab') as f:\n"
            "    f.write(base64.b64decode(''.join(sys.argv[2:])))",
            f"{CONTROL}/{pid}.stdin", *(text[i:i + PIECE] for i in range(0, len(text), PIECE))]


def fs_argv(op: Mapping[str, object], pieces: Sequence[str] = ()) -> list[str]:
    """The action's argv that runs one filesystem operation (``{"op": ..., "path": ...}``;
    ``write`` takes its content as base64 ``pieces``)."""
    return [*PYTHON, "-c", _FS, json.dumps(dict(op)), *pieces]


def write_argvs(path: str, data: bytes) -> Iterator[list[str]]:
    """The actions that write ``data`` to ``path``: one, or more (appending) for data
    past :data:`~metasched.serve.files.PER_COMMAND` base64 characters."""
    import base64

    text = base64.b64encode(data).decode()
    first = True
    for start in range(0, max(len(text), 1), PER_COMMAND):
        chunk = text[start:start + PER_COMMAND]
        yield fs_argv({"op": "write", "path": path, "append": not first},
                      [chunk[i:i + PIECE] for i in range(0, len(chunk), PIECE)])
        first = False
