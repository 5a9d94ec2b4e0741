"""The code interpreter's kernel: a program run inside an E2B sandbox (the service
writes this file into the sandbox's workspace and starts it there; it imports nothing
but the standard library), one per context, that keeps the context's state and runs
its cells one at a time.

``python3 interpreter_kernel.py FIFO LANGUAGE CWD``: it reads cells from the FIFO
``FIFO`` (a path in the workspace), one line each: the client's pid and the path
``P`` of its cell, whose request (a JSON object: ``code``, ``env_vars``) is in the file
``P.req``; it writes the cell's events, as they happen, to the FIFO ``P.out`` that the
client reads, one JSON object a line, as E2B's code interpreter streams them:
``stdout`` and ``stderr`` (``text``, ``timestamp``), ``result`` (the MIME bundle of a
displayed value under E2B's names: ``text``, ``html``, ``markdown``, ``svg``, ``png``,
``jpeg``, ``pdf``, ``latex``, ``json``, ``javascript``, and ``is_main_result`` for the
value of a last bare expression), ``error`` (``name``, ``value``, ``traceback``) and
``number_of_executions``, then ``end_of_execution``, and closes it. A client that ends
before its cell interrupts the cell (``KeyboardInterrupt`` in Python, SIGINT to bash's
commands): that is how a cell's timeout reaches it.

``LANGUAGE`` is ``python`` (one namespace; matplotlib draws with a backend that sends
each figure shown, or left open at the end of the cell, as a PNG result) or ``bash``
(one ``bash`` process: variables, functions and the working directory persist; a
cell that ends with a non-zero status is an error ``CommandExitError``).
"""

import ast
import base64
import contextlib
import datetime
import errno
import io
import json
import os
import secrets
import shlex
import signal
import subprocess
import sys
import threading
import time
import traceback

# E2B's result fields, by the MIME type an object's _repr_*_ or a display gives.
MIME_FIELDS = {"text/plain": "text", "text/html": "html", "text/markdown": "markdown",
               "image/svg+xml": "svg", "image/png": "png", "image/jpeg": "jpeg",
               "application/pdf": "pdf", "text/latex": "latex", "application/json": "json",
               "application/javascript": "javascript"}
REPR_METHODS = {"text/html": "_repr_html_", "text/markdown": "_repr_markdown_",
                "image/svg+xml": "_repr_svg_", "image/png": "_repr_png_",
                "image/jpeg": "_repr_jpeg_", "application/pdf": "_repr_pdf_",
                "text/latex": "_repr_latex_", "application/json": "_repr_json_",
                "application/javascript": "_repr_javascript_"}
WATCH_S = 0.05  # how often a cell's client is looked for while the cell runs
FLUSH_S = 0.2  # a stream's output waits this long for more before it is sent
BACKEND = "_metasched_inline"  # the matplotlib backend module this kernel provides
BACKEND_SOURCE = """from matplotlib.backends.backend_agg import FigureCanvasAgg as FigureCanvas
import sys


def show(*args, **kwargs):
    sys.modules["__kernel__"].send_figures()
"""


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat()


class Cell:
    """One cell's answer: its events are written to the client's FIFO as they come."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.lock = threading.Lock()
        self.open = True

    def send(self, event: dict) -> None:
        data = (json.dumps(event, default=repr) + "\n").encode()
        with self.lock:
            if not self.open:
                return
            try:
                while data:
                    data = data[os.write(self.fd, data):]
            except OSError:  # the client is gone
                self.open = False

    def text(self, stream: str, text: str) -> None:
        if text:
            self.send({"type": stream, "text": text, "timestamp": now()})


class Stream(io.TextIOBase):
    """A cell's stdout or stderr: what is written is sent :data:`FLUSH_S` after the
    first write since the last send (and at a flush, and at the cell's end), so that
    prints in quick succession come as one event, as Jupyter's kernel sends them."""

    def __init__(self, name: str, fileno: int) -> None:
        self.name_ = name
        self.fileno_ = fileno
        self.cell: Cell | None = None
        self.pending = ""
        self.lock = threading.Lock()
        self.timer: threading.Timer | None = None

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        with self.lock:
            self.pending += str(text)
            if self.timer is None and self.cell is not None:
                self.timer = threading.Timer(FLUSH_S, self.flush)
                self.timer.daemon = True
                self.timer.start()
        return len(text)

    def flush(self) -> None:
        with self.lock:
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None
            text, self.pending = self.pending, ""
            if text and self.cell is not None:
                self.cell.text(self.name_, text)

    def fileno(self) -> int:
        return self.fileno_

    def isatty(self) -> bool:
        return False


def bundle(value: object) -> dict:
    """The MIME bundle of ``value``, as E2B names its fields."""
    out: dict = {}
    for mime, method in REPR_METHODS.items():
        fn = getattr(value, method, None)
        if fn is None or isinstance(value, type):
            continue
        try:
            data = fn()
        except Exception:
            continue
        if isinstance(data, tuple):  # (data, metadata)
            data = data[0]
        if data is None:
            continue
        if isinstance(data, bytes):
            data = base64.b64encode(data).decode()
        if mime == "application/json" and isinstance(data, str):
            with contextlib.suppress(ValueError):
                data = json.loads(data)
        out[MIME_FIELDS[mime]] = data
    text = value if isinstance(value, str) else repr(value)
    out["text"] = text
    return out


class Python:
    """A Python context: one namespace, cells run in the main thread."""

    def __init__(self) -> None:
        self.ns: dict = {"__name__": "__main__", "__builtins__": __builtins__}
        self.stdout = Stream("stdout", 1)
        self.stderr = Stream("stderr", 2)
        self.cell: Cell | None = None
        sys.modules["__kernel__"] = sys.modules[__name__]
        backend_dir = os.path.join(os.path.dirname(os.path.abspath(sys.argv[1])), "lib")
        os.makedirs(backend_dir, exist_ok=True)
        with open(os.path.join(backend_dir, BACKEND + ".py"), "w") as f:
            f.write(BACKEND_SOURCE)
        sys.path.insert(0, backend_dir)
        os.environ.setdefault("MPLBACKEND", "module://" + BACKEND)
        self.ns["display"] = self.display

    def display(self, *values: object) -> None:
        """Jupyter's ``display``: each value sent as a result now."""
        for value in values:
            if self.cell is not None:
                self.cell.send({"type": "result", **bundle(value), "is_main_result": False})

    def figures(self) -> None:
        """Each open matplotlib figure sent as a PNG result, then closed."""
        plt = sys.modules.get("matplotlib.pyplot")
        if plt is None or self.cell is None:
            return
        for num in plt.get_fignums():
            fig = plt.figure(num)
            buf = io.BytesIO()
            try:
                fig.savefig(buf, format="png")
            except Exception as e:
                self.cell.text("stderr", f"figure {num}: could not be drawn: {e}\n")
                continue
            self.cell.send({"type": "result", "text": repr(fig),
                            "png": base64.b64encode(buf.getvalue()).decode(),
                            "is_main_result": False})
        plt.close("all")

    def run(self, cell: Cell, code: str, env: dict) -> None:
        self.cell = cell
        self.stdout.cell = self.stderr.cell = cell
        old = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = self.stdout, self.stderr
        try:
            tree = ast.parse(code, "<cell>", "exec")
            last = None
            if tree.body and isinstance(tree.body[-1], ast.Expr):
                last = tree.body.pop()
            exec(compile(tree, "<cell>", "exec"), self.ns)
            value = None
            if last is not None:
                value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), self.ns)
            self.figures()
            if value is not None:
                self.ns["_"] = value
                cell.send({"type": "result", **bundle(value), "is_main_result": True})
        except BaseException as e:  # the cell's error, KeyboardInterrupt and SystemExit too
            self.figures()
            tb = traceback.format_exception(type(e), e, e.__traceback__)
            # The kernel's own frames are not the cell's.
            kept = [line for line in tb if 'File "<cell>"' in line or not line.startswith(
                "  File ")]
            cell.send({"type": "error", "name": type(e).__name__, "value": str(e),
                       "traceback": "".join(kept)})
        finally:
            self.stdout.flush()
            self.stderr.flush()
            sys.stdout, sys.stderr = old
            self.stdout.cell = self.stderr.cell = self.cell = None

    def interrupt(self) -> None:
        # To the main thread, so that a blocking call in the cell (sleep, a read) ends.
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


class Bash:
    """A bash context: one ``bash`` process fed each cell on its standard input."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def start(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen(["bash", "--norc", "--noprofile"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, start_new_session=True)
        return self.proc

    def run(self, cell: Cell, code: str, env: dict) -> None:
        proc = self.start()
        exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items()
                          if k.isidentifier())
        mark = "__metasched_end_" + secrets.token_hex(8)
        path = os.path.join(os.path.dirname(os.path.abspath(sys.argv[1])),
                            f"cell-{os.getpid()}.sh")
        with open(path, "w") as f:
            f.write(exports + code + "\n")
        status: list[int] = []
        readers = [threading.Thread(target=self.read, args=(cell, proc.stdout, "stdout",
                                                            mark, status)),
                   threading.Thread(target=self.read, args=(cell, proc.stderr, "stderr",
                                                            mark, None))]
        for r in readers:
            r.start()
        try:
            assert proc.stdin is not None
            proc.stdin.write(f'. {path} </dev/null\nprintf "{mark}%d\\n" $?\n'
                             f'printf "{mark}\\n" >&2\n'.encode())
            proc.stdin.flush()
        except OSError:
            pass
        for r in readers:
            r.join()
        with contextlib.suppress(OSError):
            os.unlink(path)
        if not status:
            cell.send({"type": "error", "name": "KernelExit",
                       "value": "bash exited (the context's state is gone; it restarts "
                                "with the next cell)", "traceback": ""})
            self.proc = None
        elif status[0] != 0:
            cell.send({"type": "error", "name": "CommandExitError",
                       "value": f"exit status {status[0]}", "traceback": ""})

    @staticmethod
    def read(cell: Cell, pipe: io.BufferedReader, stream: str, mark: str,
             status: list[int] | None) -> None:
        """Send what bash writes to ``pipe`` until the cell's mark."""
        token = mark.encode()
        pending = b""
        while True:
            chunk = os.read(pipe.fileno(), 65536)
            if not chunk:
                cell.text(stream, pending.decode(errors="replace"))
                return
            pending += chunk
            at = pending.find(token)
            if at >= 0:
                cell.text(stream, pending[:at].decode(errors="replace"))
                rest = pending[at + len(token):].split(b"\n", 1)[0]
                if status is not None:
                    status.append(int(rest or b"0"))
                return
            # Keep what could be the start of the mark; send the rest now.
            keep = len(token) - 1
            if len(pending) > keep:
                send, pending = pending[:-keep], pending[-keep:]
                cell.text(stream, send.decode(errors="replace"))

    def interrupt(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(self.proc.pid, signal.SIGINT)


CONTEXT: "Python | Bash | None" = None


def send_figures() -> None:
    """matplotlib's ``show`` here: the open figures sent as results now."""
    if isinstance(CONTEXT, Python):
        CONTEXT.figures()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def watch(pid: int, done: threading.Event, context: object) -> None:
    """Interrupt the cell when its client (``pid``) ends before it."""
    while not done.wait(WATCH_S):
        if not alive(pid):
            if not done.is_set():
                context.interrupt()  # type: ignore[attr-defined]
            return


def reply_fd(path: str, pid: int) -> int | None:
    """The cell's FIFO opened for writing, once its client opens it for reading (None:
    the client ended first)."""
    while True:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            if e.errno != errno.ENXIO or not alive(pid):  # ENXIO: no reader yet
                return None
            time.sleep(0.001)
            continue
        os.set_blocking(fd, True)
        return fd


def main() -> None:
    global CONTEXT
    path, language, cwd = sys.argv[1:4]
    path = sys.argv[1] = os.path.abspath(path)  # before the cell's directory
    os.chdir(cwd)
    os.environ["PWD"] = cwd
    context = CONTEXT = Python() if language == "python" else Bash()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    os.mkfifo(path + ".new", 0o600)
    os.rename(path + ".new", path)
    fifo = os.open(path, os.O_RDWR)  # its own writer too: never at its end
    signal.signal(signal.SIGINT, signal.default_int_handler)
    count, pending = 0, b""
    while True:
        try:
            while b"\n" not in pending:
                pending += os.read(fifo, 4096)
            line, pending = pending.split(b"\n", 1)
            pid, cell = line.decode().split(" ", 1)
            count += 1
            serve(int(pid), cell, context, count)
        except KeyboardInterrupt:  # a cell's interrupt that came after its end
            pass
        except (ValueError, OSError) as e:  # a malformed line: only a client's mistake
            sys.stderr.write(f"kernel: a cell was not run: {e}\n")


def serve(pid: int, cell_path: str, context: "Python | Bash", count: int) -> None:
    """Run the ``count``-th cell, the one of client ``pid`` at ``cell_path``."""
    try:
        with open(cell_path + ".req", "rb") as f:
            data = f.read()
    finally:
        with contextlib.suppress(OSError):
            os.unlink(cell_path + ".req")
    fd = reply_fd(cell_path + ".out", pid)
    if fd is None:
        return
    cell = Cell(fd)
    try:
        try:
            req = json.loads(data)
            code = str(req["code"])
            env = {str(k): str(v) for k, v in (req.get("env_vars") or {}).items()}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            cell.send({"type": "error", "name": type(e).__name__,
                       "value": f"a malformed cell: {e}", "traceback": ""})
            return
        cell.send({"type": "number_of_executions", "execution_count": count})
        saved = {k: os.environ.get(k) for k in env}
        if isinstance(context, Python):  # bash's are exported in its cell
            os.environ.update(env)
        done = threading.Event()
        threading.Thread(target=watch, args=(pid, done, context), daemon=True).start()
        try:
            context.run(cell, code, env)
        finally:
            done.set()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        cell.send({"type": "end_of_execution"})  # what tells a complete answer
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(cell_path + ".out")

if __name__ == "__main__":
    main()
