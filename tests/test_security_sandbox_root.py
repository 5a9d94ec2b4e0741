"""Attacks on the host from inside a sandbox, through the live dispatcher and service,
each blocked: reading the host's files beyond the system's programs and libraries
(root-only files, home directories, ``/var``), the service's run directory with the
secrets of its command line (``.hydra/overrides.yaml``), connecting to the host's unix
sockets, making a user namespace; and a missing program reads as missing, not as a
refused directory of the dispatcher's ``PATH``. Then what a sandbox still has: the
system's Python with its standard library, an identity, ``sandbox.system_paths``."""

from __future__ import annotations

import asyncio
import http.server
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
from helpers import free_port
from sandbox_helpers import (  # noqa: F401 (isolation: a fixture)
    MODE,
    isolation,
    needs_isolation,
)
from serve_helpers import wait_for_ping

from metasched.errors import ConfigError
from metasched.runtime.dispatch import Dispatcher, DispatcherConfig
from metasched.runtime.sandbox.config import SandboxConfig
from metasched.runtime.sandbox.manager import Sandboxes

PY = "/usr/bin/python3"  # the system's: in every sandbox
HOST_DIRS = [d for d in ("/root", "/var", "/srv", "/mnt", "/media", "/run", "/opt",
                         "/boot", "/work") if os.path.isdir(d)]
# /home holds only user, the workspace mounted again (E2B's home): none of the host's.
HOST_HOMES = [os.path.join("/home", d) for d in os.listdir("/home") if d != "user"] \
    if os.path.isdir("/home") else []
ROOT_ONLY = [f for f in ("/etc/shadow", "/etc/gshadow", "/etc/sudoers", "/etc/ssh",
                         "/etc/ssl/private") if os.path.lexists(f)]


pytestmark = [pytest.mark.isolation, pytest.mark.usefixtures("isolation"),
              pytest.mark.skipif(not os.path.exists(PY), reason=f"{PY} is not installed")]


def cfg(**sandbox) -> DispatcherConfig:
    return DispatcherConfig(scheduler="elastic_greedy", sample_interval_s=0.05,
                            sandbox=SandboxConfig(isolation=MODE["isolation"], **sandbox))


def py(code: str, **kw) -> dict:
    return {"kind": "cpu", "argv": [PY, "-c", textwrap.dedent(code)],
            "timeout_s": kw.pop("timeout_s", 60), **kw}


async def run_all(requests: list[dict], config: DispatcherConfig | None = None) -> list:
    async with Dispatcher(config or cfg()) as d:
        return await asyncio.gather(*(d.submit(r) for r in requests))


SEES = """
    import os, sys
    for p in sys.argv[1:]:
        print(p, os.path.lexists(p))
"""


async def seen(paths: list[str], **kw) -> dict[str, bool]:
    """Which of ``paths`` exist for a sandboxed command."""
    (r,) = await run_all([{**py(SEES, **kw),
                           "argv": [PY, "-c", textwrap.dedent(SEES), *paths]}])
    assert r.ok, r.stderr
    return {p: v == "True" for p, v in (line.rsplit(" ", 1) for line in r.stdout.splitlines())}


# ---------------------------------------------------------------- the host's files


async def test_root_only_host_files_are_not_in_the_sandbox():
    if not ROOT_ONLY:
        pytest.skip("no root-only file of /etc here")
    assert await seen(ROOT_ONLY) == dict.fromkeys(ROOT_ONLY, False)


@pytest.mark.parametrize("network", [False, True])
async def test_home_root_var_and_the_rest_of_the_host_are_not_in_the_sandbox(network):
    # A world-readable file in a world-searchable directory: readable before, by anyone.
    planted = Path("/var/tmp") / f"metasched-test-{uuid.uuid4().hex}"
    planted.write_text("secret")
    planted.chmod(0o644)
    try:
        paths = [*HOST_DIRS, *HOST_HOMES, str(planted)]
        assert await seen(paths, network=network) == dict.fromkeys(paths, False)
    finally:
        planted.unlink()


async def test_etc_holds_only_what_programs_read_and_a_passwd_of_its_own():
    (r,) = await run_all([py("""
        import getpass, os
        print(sorted(os.listdir("/etc")))
        print(open("/etc/passwd").read())
        print(getpass.getuser(), os.getuid())
    """, trajectory="t")])
    assert r.ok, r.stderr
    listing, *rest = r.stdout.splitlines()
    for name in ("shadow", "gshadow", "sudoers", "pip.conf", "npmrc", "gitconfig", "ssh",
                 "machine-id", "hostname", "subuid", "resolv.conf"):
        assert f"'{name}'" not in listing
    assert "'ld.so.cache'" in listing and "'passwd'" in listing
    host_users = {line.split(":")[0] for line in open("/etc/passwd")} - {"root", "nobody"}
    names = {line.split(":")[0] for line in rest if ":" in line}
    assert names == {"root", "sandbox", "nobody"} and not names & host_users
    user, uid = rest[-1].split()
    assert user == "sandbox" and int(uid) >= SandboxConfig().uid_range[0]


async def test_the_system_python_and_its_standard_library_work():
    (r,) = await run_all([py("""
        import ctypes, decimal, hashlib, json, sqlite3, ssl, subprocess, threading, zlib
        ssl.create_default_context()
        out = []
        t = threading.Thread(target=out.append, args=("thread",))
        t.start(); t.join()
        out.append(subprocess.run(["/bin/sh", "-c", "echo child"], capture_output=True,
                                  text=True).stdout.strip())
        print(*out, sqlite3.connect(":memory:").execute("select 6*7").fetchone()[0])
    """)])
    assert r.ok, r.stderr
    assert r.stdout.split() == ["thread", "child", "42"]


async def test_configured_system_paths_are_seen_read_only(visible_dir):
    (visible_dir / "tool").write_text("#!/bin/sh\necho toolchain\n")
    (visible_dir / "tool").chmod(0o755)
    (r,) = await run_all([{"kind": "cpu", "argv": ["/bin/sh", "-c", f"{visible_dir}/tool; "
                                                   f"touch {visible_dir}/x || echo read-only"],
                           "timeout_s": 30}], cfg(system_paths=(str(visible_dir),)))
    assert r.ok, r.stderr
    assert r.stdout.split() == ["toolchain", "read-only"]


@pytest.mark.parametrize("paths, message", [
    (["opt/tool"], "error: sandbox.system_paths: must be absolute host paths (got 'opt/tool')"),
    (["/"], "error: sandbox.system_paths: '/' would expose the host"),
    (["/etc"], "error: sandbox.system_paths: '/etc' would expose the host"),
    (["/proc/1"], "error: sandbox.system_paths: '/proc/1' would cover the sandbox's own"),
    (["/no/such/toolchain"], "error: sandbox.system_paths: '/no/such/toolchain' does not "
                             "exist"),
    ("/opt", "error: sandbox.system_paths: must be a list"),
])
def test_bad_system_paths_are_one_line_errors(paths, message):
    with pytest.raises(ConfigError) as e:
        SandboxConfig.from_dict({"system_paths": paths})
    assert f"error: {e.value}".startswith(message) and "\n" not in str(e.value)


# ---------------------------------------------------------------- the service's run directory


class _Upstream(http.server.BaseHTTPRequestHandler):
    seen: list[str] = []

    def do_GET(self):  # noqa: N802 - the handler's name
        type(self).seen.append(self.headers.get("Authorization", ""))
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def served_with_keys(isolation):  # noqa: F811
    """metasched-serve, its run directory outside /tmp in a directory open to all, with
    one endpoint's key on its command line (so in ``.hydra/overrides.yaml``) and
    another's from the environment, both proxied to an upstream on 127.0.0.1."""
    needs_isolation()
    import tempfile

    run_root = Path(tempfile.mkdtemp(prefix="metasched-test-", dir="/var/tmp"))
    run_root.chmod(0o755)
    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    up = f"http://127.0.0.1:{upstream.server_address[1]}"
    on_line, in_env = uuid.uuid4().hex, uuid.uuid4().hex
    port = free_port()
    endpoints = (f"+endpoints={{inline: {{rpm: 600, max_concurrency: 4, url: '{up}', "
                 f"headers: {{Authorization: 'Bearer {on_line}'}}}}, "
                 f"search: {{rpm: 600, max_concurrency: 4, url: '{up}', "
                 "headers: {Authorization: 'Bearer ${oc.env:SEARCH_KEY}'}}}")
    p = subprocess.Popen(
        [sys.executable, "-m", "metasched.cli.serve_app", f"port={port}", "languages=[]",
         "scheduler=elastic_greedy", f"sandbox.isolation={isolation}", endpoints,
         f"hydra.run.dir={run_root}/run"],
        env={**os.environ, "SEARCH_KEY": in_env}, cwd=run_root,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_ping(url, p)
        yield url, run_root / "run", on_line, in_env
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        upstream.shutdown()
        import shutil

        shutil.rmtree(run_root, ignore_errors=True)


def test_the_run_directory_and_the_secrets_of_the_command_line_are_out_of_reach(
        served_with_keys):
    url, run_dir, on_line, _ = served_with_keys
    overrides = run_dir / ".hydra" / "overrides.yaml"
    assert on_line in overrides.read_text()  # there, on the host (the insecure way)
    probe = f"""
        import os
        for p in [{str(overrides)!r}, {str(run_dir)!r}]:
            try:
                print(p, {on_line!r} in open(p).read() if os.path.isfile(p) else
                      os.path.exists(p))
            except OSError as e:
                print(p, e.strerror)
    """
    for network in (False, True):
        r = httpx.post(f"{url}/v1/actions", params={"wait": 60},
                       json={**py(probe), "network": network}, timeout=90).json()
        assert r["status"] == "done", r
        assert r["stdout"].split("\n")[:2] == [f"{overrides} False", f"{run_dir} False"]


def test_an_upstream_key_from_the_environment_reaches_the_upstream_and_no_file(
        served_with_keys):
    url, run_dir, _, in_env = served_with_keys
    _Upstream.seen.clear()
    r = httpx.get(f"{url}/v1/endpoints/search/anything", timeout=30)
    assert r.status_code == 200 and r.text == "ok"
    assert _Upstream.seen == [f"Bearer {in_env}"]
    for f in (run_dir / ".hydra").iterdir():
        assert in_env not in f.read_text()


# ---------------------------------------------------------------- the host's unix sockets


@pytest.fixture
def host_sockets(visible_dir):
    """Unix sockets listening on the host, open to every user: under /run, in a directory
    open to all, and an abstract one; each counts the connections it accepts."""
    mark = uuid.uuid4().hex[:12]
    paths = [f"/run/metasched-test-{mark}.sock", str(visible_dir / "s.sock")]
    socks, accepted, stop = {}, [], threading.Event()
    for where in [*paths, f"\0metasched-test-{mark}"]:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(where)
        if not where.startswith("\0"):
            os.chmod(where, 0o777)
        s.listen()
        s.settimeout(0.1)
        socks[where] = s

    def serve():
        while not stop.is_set():
            for s in socks.values():
                try:
                    s.accept()[0].close()
                    accepted.append(1)
                except OSError:
                    pass
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield list(socks), accepted
    stop.set()
    t.join()
    for where, s in socks.items():
        s.close()
        if not where.startswith("\0"):
            os.unlink(where)


async def test_host_unix_sockets_are_out_of_reach(host_sockets):
    where, accepted = host_sockets
    probe = """
        import socket, sys
        for p in sys.argv[1:]:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(3)
            try:
                s.connect(p.replace("@", "\\0", 1))
                print("connected")
            except OSError as e:
                print("refused", e.strerror)
    """
    argv = [PY, "-c", textwrap.dedent(probe), *(w.replace("\0", "@", 1) for w in where)]
    # Abstract sockets belong to a network namespace: without network the sandbox has
    # its own; a sandbox granted the network shares the host's (then the abstract one is
    # reachable, as any host port is), so that one is tried without network only.
    r1, r2 = await run_all([
        {"kind": "cpu", "argv": argv, "timeout_s": 60},
        {"kind": "cpu", "argv": argv[:-1], "timeout_s": 60, "network": True}])
    assert r1.ok and r2.ok, r1.stderr + r2.stderr
    assert all(line.startswith("refused") for line in r1.stdout.splitlines() +
               r2.stdout.splitlines()), (r1.stdout, r2.stdout)
    time.sleep(0.3)
    assert not accepted


# ---------------------------------------------------------------- user namespaces


@pytest.mark.parametrize("argv", [
    ["unshare", "-Ur", "id"],
    ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", "mount -t tmpfs x /tmp"],
    [PY, "-c", "import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); "
               "r = libc.unshare(0x10000000); print(r, os.strerror(ctypes.get_errno()));"
               "raise SystemExit(0 if r == 0 else 1)"],
], ids=["unshare-Ur", "unshare-mount", "python-unshare"])
async def test_user_namespaces_are_refused(argv):
    (r,) = await run_all([{"kind": "cpu", "argv": argv, "timeout_s": 30}])
    assert not r.ok and "uid=0" not in r.stdout
    assert "Operation not permitted" in r.stdout + r.stderr


# What a command has no use for: io_uring, the (not namespaced) key rings, perf events.
_REFUSED_CALLS = {"io_uring_setup": (425, "0, 0"), "keyctl": (250, "0, 0"),
                  "add_key": (248, "b'user', b'k', b'v', 1, -2"),
                  "perf_event_open": (298, "0, 0, -1, -1, 0")}


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86-64 system call numbers")
@pytest.mark.parametrize("name", sorted(_REFUSED_CALLS))
async def test_kernel_surface_calls_are_refused(name):
    nr, args = _REFUSED_CALLS[name]
    probe = (f"import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); "
             f"r = libc.syscall({nr}, {args}); e = ctypes.get_errno(); "
             f"print(r, os.strerror(e)); raise SystemExit(0 if e == 1 else 1)")
    (r,) = await run_all([{"kind": "cpu", "argv": [PY, "-c", probe], "timeout_s": 30}])
    assert r.ok and "Operation not permitted" in r.stdout, (r.stdout, r.stderr)


def test_the_startup_line_says_user_namespaces_are_refused():
    sandboxes = Sandboxes(SandboxConfig(isolation=MODE["isolation"], cgroups="none"))
    try:
        line = sandboxes.describe()
    finally:
        sandboxes.close()
    assert "minimal root, no user namespaces" in line


# ---------------------------------------------------------------- PATH


async def test_a_missing_program_is_not_found_not_a_refused_path_directory():
    # A directory the dispatcher's PATH may name that the sandbox's user cannot search
    # (a virtual environment below /root), then a missing program.
    private = Path("/root") / f".metasched-test-{uuid.uuid4().hex}" / "bin"
    private.mkdir(parents=True)
    try:
        path = f"{private}:/usr/bin:/bin"
        missing, shown = await run_all([
            {"kind": "cpu", "argv": ["no-such-program-here"], "timeout_s": 30,
             "env": {"PATH": path}},
            {"kind": "cpu", "argv": ["/bin/sh", "-c", "echo $PATH"], "timeout_s": 30,
             "env": {"PATH": path}}])
    finally:
        private.parent.chmod(0o700)
        import shutil

        shutil.rmtree(private.parent)
    assert not missing.ok
    assert missing.reason == "cannot start: no-such-program-here: command not found"
    assert shown.stdout.strip() == "/usr/bin:/bin"
