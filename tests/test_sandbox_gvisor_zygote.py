"""The zygote of a gVisor sandbox (:mod:`metasched.runtime.sandbox.gvisor_zygote`): a
``python3 FILE`` or ``python3 -c CODE`` command runs in a fork of a warm interpreter,
and gets what an exec of ``python3`` would give it: the same output, exit status and
traceback, the same ``sys`` state and modules, environment, directory, user, session
and signal dispositions; nothing of the commands before it is in its memory; it ends
at its timeout with what it started; a command in another Python environment runs by
an exec.

Each program runs twice in one trajectory: as ``/usr/bin/python3`` (the zygote) and
through ``/usr/bin/env`` (an exec of the same interpreter with the same environment),
and both outcomes must be equal.
"""

from __future__ import annotations

import json
import os

import pytest
from helpers import cpu
from sandbox_helpers import gvisor_mode as gvisor_mode  # noqa: F401 (a fixture)
from sandbox_helpers import sandboxed_config

from metasched.runtime.dispatch import Dispatcher

pytestmark = [pytest.mark.isolation, pytest.mark.gvisor]

PYTHON = "/usr/bin/python3"

# Which process started it: the zygote (``python3 -c``) or the exec server (``-I -S``).
PARENT = "import os; print(open(f'/proc/{os.getppid()}/cmdline').read().split(chr(0))[1])"

STATE = """
import json, os, resource, signal, sys
print(json.dumps({
    "argv": sys.argv, "orig_argv": sys.orig_argv, "path": sys.path,
    "executable": sys.executable, "flags": list(sys.flags), "modules": sorted(sys.modules),
    "main": [__name__, type(__loader__).__name__, __spec__, globals().get("__file__"),
             sorted(globals())],
    "env": sorted(kv for kv in os.environ.items() if kv[0] != "METASCHED_ACTION_ID"),
    "cwd": os.getcwd(),
    "ids": [os.getuid(), os.geteuid(), os.getgid(), os.getgroups()],
    "session": [os.getsid(0) == os.getpid(), os.getpgrp() == os.getpid()],
    "stdin": sys.stdin.read(), "stdio": [[s.encoding, s.errors, s.line_buffering]
                                         for s in (sys.stdin, sys.stdout, sys.stderr)],
    "signals": [str(signal.getsignal(s)) for s in signal.valid_signals()
                if s not in (signal.SIGKILL, signal.SIGSTOP)],
    "rlimits": [resource.getrlimit(getattr(resource, n)) for n in dir(resource)
                if n.startswith("RLIMIT_")],
    "affinity": sorted(os.sched_getaffinity(0)),
}))
"""

PROGRAMS = {
    "state": STATE,
    "raises": "import json\ndef f():\n    json.loads('{')\nprint('before')\nf()\n",
    "syntax_error": "print('never'\n",
    "exit_status": "import sys\nprint('out')\nprint('err', file=sys.stderr)\nsys.exit(3)\n",
    "exit_message": "raise SystemExit('bye')\n",
    "atexit_and_threads": (
        "import atexit, threading, time\natexit.register(print, 'atexit')\n"
        "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()\n"
        "print('main')\n"),
    "chained": "try:\n    1/0\nexcept ZeroDivisionError as e:\n    raise KeyError('k') from e\n",
}


def _outcome(r) -> tuple:
    return r.status, r.exit_code, r.stdout, r.stderr


@pytest.mark.parametrize("form", ["-c", "file"])
@pytest.mark.parametrize("program", sorted(PROGRAMS))
async def test_a_python_command_in_the_zygote_ends_as_an_exec_of_python3_would(
        gvisor_mode, program, form):  # noqa: F811
    source = PROGRAMS[program]
    async with Dispatcher(sandboxed_config()) as d:
        if form == "file":
            wrote = await d.submit(cpu("/bin/sh", "-c", 'printf %s "$0" > prog.py', source,
                                       trajectory="t"))
            assert wrote.ok, wrote
            args = ["prog.py", "one", "two"]
        else:
            args = ["-c", source, "one"]
        parent = await d.submit(cpu(PYTHON, "-c", PARENT, trajectory="t"))
        forked = await d.submit(cpu(PYTHON, *args, trajectory="t"))
        execed = await d.submit(cpu("/usr/bin/env", PYTHON, *args, trajectory="t"))
    assert parent.ok and parent.stdout.strip() == "-c", parent  # the zygote's child
    assert _outcome(forked) == _outcome(execed)
    if program == "state":
        state = json.loads(forked.stdout)
        assert state["ids"][0] != 0 and state["session"] == [True, True]


SECRET_RUN = "import sys; print(len(sys.argv))"

# The second command: every readable page of its own memory searched for the first
# one's marker (given in two halves, found where one follows the other: the search
# never holds it whole).
SEARCH = """
import ctypes, sys
first, second = sys.argv[1].encode(), sys.argv[2].encode()
found = 0
for line in open("/proc/self/maps"):
    span, perms = line.split()[:2]
    if not perms.startswith("r") or line.rstrip().endswith(("[vvar]", "[vsyscall]")):
        continue
    lo, hi = (int(x, 16) for x in span.split("-"))
    try:
        data = ctypes.string_at(lo, hi - lo)
    except Exception:
        continue
    at = data.find(first)
    while at >= 0:
        found += data.startswith(second, at + len(first))
        at = data.find(first, at + 1)
print(found)
"""


@pytest.mark.parametrize("by", ["argv", "code", "environment"])
async def test_nothing_of_a_command_before_is_in_a_zygote_commands_memory(
        gvisor_mode, by):  # noqa: F811
    """A child is a copy of the zygote as it was before any request: the zygote never
    reads one (each child reads its own), so the argv, code and environment of the
    sandbox's commands before it are nowhere in its memory."""
    half = ("ZYGOTE", "SECRET0123456789")
    marker = "".join(half)
    first = {"argv": cpu(PYTHON, "-c", SECRET_RUN, marker),
             "code": cpu(PYTHON, "-c", f"x = {marker!r}"),
             "environment": cpu(PYTHON, "-c", "pass", env={**os.environ, "KEPT": marker})
             }[by]
    async with Dispatcher(sandboxed_config()) as d:
        ran = await d.submit({**first, "trajectory": "t"})
        own = await d.submit(cpu(PYTHON, "-c", SEARCH, *half, marker,
                                 trajectory="t"))  # (the marker in its own argv: a control)
        look = await d.submit(cpu(PYTHON, "-c", SEARCH, *half, trajectory="t"))
        parent = await d.submit(cpu(PYTHON, "-c", PARENT, trajectory="t"))
    assert ran.ok and own.ok and look.ok, (ran, own, look)
    assert int(own.stdout) > 0  # the search finds what is there
    assert look.stdout.strip() == "0", look
    assert parent.stdout.strip() == "-c", parent


async def test_a_zygote_command_ends_at_its_timeout_with_what_it_started(
        gvisor_mode):  # noqa: F811
    hang = ("import subprocess, time\n"
            "subprocess.Popen(['sleep', '300'], start_new_session=True)\ntime.sleep(60)\n")
    async with Dispatcher(sandboxed_config()) as d:
        r = await d.submit(cpu(PYTHON, "-c", hang, timeout_s=2, trajectory="t"))
        left = await d.submit(cpu("/bin/sh", "-c", "ps -eo user,args | grep -c '[s]leep 300'"
                                  " || true", trajectory="t"))
        parent = await d.submit(cpu(PYTHON, "-c", PARENT, trajectory="t"))
    assert r.status == "failed" and r.reason == "timeout after 2 s", r
    assert left.stdout.strip() == "0", left
    assert parent.ok and parent.stdout.strip() == "-c", parent  # the zygote is still up


async def test_a_command_in_another_python_environment_runs_by_an_exec(
        gvisor_mode):  # noqa: F811
    """``PYTHONHASHSEED`` differs from the zygote's: an exec, and the seed holds."""
    env = {**os.environ, "PYTHONHASHSEED": "7"}
    probe = PARENT + "; print(hash('metasched'))"
    async with Dispatcher(sandboxed_config()) as d:
        runs = [await d.submit(cpu(PYTHON, "-c", probe, env=env, trajectory="t"))
                for _ in range(2)]
    assert all(r.ok for r in runs), runs
    assert [r.stdout.split()[0] for r in runs] == ["-I", "-I"]  # the exec server's child
    assert runs[0].stdout.split()[1] == runs[1].stdout.split()[1]
