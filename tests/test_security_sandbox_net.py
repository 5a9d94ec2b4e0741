"""A sandboxed command granted network reaches what the operator allows and nothing of
the host: not the service's API, not a server on the host's loopback or on its own
interface addresses, not the user-mode stack's gateway, not an abstract unix socket of
the host; and it cannot lift the rules. Allowed egress is shown against a host of the
test's own: a network namespace joined to this one by a veth pair with private
addresses, running a small server.

Runs under each isolation mode (bwrap; gvisor under ``-m gvisor``). Needs root,
slirp4netns and nftables; the allowed-egress tests also ``ip netns``. A missing piece
skips with the reason (``-rs``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import psutil
import pytest
from helpers import COMMAND_PY
from sandbox_helpers import MODE, isolation  # noqa: F401 (a fixture)
from serve_helpers import serving

from metasched.errors import ConfigError
from metasched.runtime.dispatch import Dispatcher, DispatcherConfig
from metasched.runtime.sandbox.config import SandboxConfig
from metasched.serve import ServeConfig

PY = COMMAND_PY
TOOLS = "/usr/bin:/bin:/usr/sbin:/sbin:/usr/local/bin:/usr/local/sbin"
GATEWAY = "10.0.2.2"  # the user-mode stack's gateway: the host, seen from the sandbox


pytestmark = [pytest.mark.isolation, pytest.mark.usefixtures("isolation")]


@pytest.fixture(autouse=True)
def _network_tools():
    missing = [t for t in ("slirp4netns", "nft") if shutil.which(t, path=TOOLS) is None]
    if missing:
        pytest.skip(f"network for sandboxes needs {', '.join(missing)} (make sandbox-tools)")


def cfg(**sandbox) -> DispatcherConfig:
    return DispatcherConfig(scheduler="elastic_greedy", sample_interval_s=0.05,
                            sandbox=SandboxConfig(isolation=MODE["isolation"], **sandbox))


def cpu(code: str, **kw) -> dict:
    return {"kind": "cpu", "argv": [PY, "-c", textwrap.dedent(code)],
            "timeout_s": kw.pop("timeout_s", 60), **kw}


# A probe: one line per target, "connected <reply>" or "refused <errno>".
PROBE = """
    import socket, sys
    for target in sys.argv[1:]:
        host, port = target.rsplit(":", 1)
        try:
            with socket.create_connection((host, int(port)), timeout=3) as s:
                s.sendall(b"GET / HTTP/1.0\\r\\n\\r\\n")
                s.settimeout(3)
                print("connected", s.recv(64).split(b"\\r\\n")[0].decode(errors="replace"))
        except OSError as e:
            print("refused", e.errno)
"""


def probe(*targets: str, **kw) -> dict:
    return {"kind": "cpu", "argv": [PY, "-c", textwrap.dedent(PROBE), *targets],
            "timeout_s": 60, **kw}


def host_address() -> str | None:
    """A non-loopback IPv4 address of this host (``ip -4 addr``), or None."""
    try:
        out = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        parts = line.split()
        if "inet" in parts:
            return parts[parts.index("inet") + 1].split("/")[0]
    return None


class _Hits(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        self.server.hits.append(self.path)  # type: ignore[attr-defined]
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"secret")

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def http_servers():
    """Real HTTP servers of the host: on 127.0.0.1 and, where the host has one, on a
    non-loopback address of its own; ``{name: (address, port, hits)}``."""
    where = {"loopback": "127.0.0.1"}
    addr = host_address()
    if addr is not None:
        where["host-address"] = addr
    servers = {}
    for name, a in where.items():
        srv = ThreadingHTTPServer((a, 0), _Hits)
        srv.hits = []  # type: ignore[attr-defined]
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers[name] = srv
    yield {n: (s.server_address[0], s.server_address[1], s.hits) for n, s in servers.items()}
    for s in servers.values():
        s.shutdown()
        s.server_close()


@pytest.mark.parametrize("kind", ["trajectory", "trajectory-less"])
async def test_granted_network_reaches_no_host_server(http_servers, kind):
    targets = [f"{a}:{p}" for a, p, _ in http_servers.values()]
    port = http_servers["loopback"][1]
    targets.append(f"{GATEWAY}:{port}")  # the stack's way to the host
    extra = {"trajectory": "t"} if kind == "trajectory" else {}

    async with Dispatcher(cfg()) as d:
        r = await d.submit(probe(*targets, network=True, **extra))
    assert r.status == "done", r.reason
    lines = r.stdout.splitlines()
    assert len(lines) == len(targets), r.stdout
    for target, line in zip(targets, lines, strict=True):
        assert line.startswith("refused"), (target, line)
    assert all(not hits for _, _, hits in http_servers.values())


async def test_granted_network_reaches_no_abstract_socket_of_the_host():
    name = f"\0metasched-test-{uuid.uuid4().hex}"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(name)
    srv.listen()
    code = f"""
        import socket
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect({name!r})
            print("connected")
        except OSError as e:
            print("refused", e.errno)
    """

    try:
        async with Dispatcher(cfg(network=True)) as d:
            rs = await asyncio.gather(d.submit(cpu(code)), d.submit(cpu(code, trajectory="t")))
    finally:
        srv.close()
    assert [r.stdout.split()[0] for r in rs] == ["refused", "refused"], [r.stdout for r in rs]


async def test_the_sandbox_cannot_lift_its_rules(http_servers):
    """It has no capability in its network namespace: the rule set, its addresses and
    routes stay as they are, and the host stays out of reach."""
    a, port, hits = http_servers["loopback"]
    target = f"{a}:{port}"
    script = ("nft flush ruleset; echo nft=$?; ip addr add 127.0.0.2/8 dev lo; echo addr=$?; "
              "ip route replace default dev lo; echo route=$?; "
              f"exec {PY} -c '{textwrap.dedent(PROBE)}' {target} {GATEWAY}:{port}")

    async with Dispatcher(cfg()) as d:
        r = await d.submit({"kind": "cpu", "argv": ["/bin/sh", "-c", script],
                            "timeout_s": 60, "network": True, "trajectory": "t"})
    lines = r.stdout.splitlines()
    # nft's exit: 1 (the kernel refuses the change); under gVisor 3 (gVisor's sockets
    # have no netfilter netlink: it cannot even ask)
    nft = "nft=3" if MODE["isolation"] == "gvisor" else "nft=1"
    assert [x for x in lines if "=" in x] == [nft, "addr=2", "route=2"], r.stdout
    assert [x.split()[0] for x in lines if "=" not in x] == ["refused", "refused"], r.stdout
    assert not hits


def test_run_code_with_network_cannot_reach_the_service():
    """The attack as it was: code sent to /run_code (the service runs with
    ``sandbox.network=true``) and a native request with ``network: true`` call the
    service's own API."""
    dcfg = cfg(network=True)
    with serving(dcfg, ServeConfig(languages=["python"])) as served:
        code = textwrap.dedent(f"""
            import urllib.request
            try:
                with urllib.request.urlopen({served.url + '/v1/status'!r}, timeout=5) as r:
                    print("reached", r.status)
            except OSError as e:
                print("refused", getattr(e, "reason", e))
        """)
        doc = httpx.post(f"{served.url}/run_code", json={"code": code, "language": "python",
                                                         "run_timeout": 30}, timeout=120).json()
        native = httpx.post(f"{served.url}/v1/actions?wait=60", timeout=120, json={
            "kind": "cpu", "trajectory": "t", "network": True, "argv": [PY, "-c", code],
            "timeout_s": 30}).json()
    assert doc["run_result"]["stdout"].startswith("refused"), doc
    assert native["stdout"].startswith("refused"), native


async def test_the_network_stack_ends_with_its_sandbox():
    async with Dispatcher(cfg()) as d:
        r = await d.submit(probe(network=True, trajectory="t"))
        server = d.sandboxes.server.pid  # the sandbox's stack is a child of its server
        stacks = _stacks(server)
        d.close_trajectory("t")
        for _ in range(100):
            if not _stacks(server):
                break
            await asyncio.sleep(0.02)
        before, after = stacks, _stacks(server)
    assert r.status == "done" and len(before) == 1 and after == [], (before, after)


async def test_a_networked_sandbox_leaves_the_hosts_mounts_alone():
    # slirp4netns's own sandbox remakes its view of the file system; started in the
    # host's mount namespace it unmounted the host's shared mounts, e.g. the named
    # network namespaces of `ip netns` (a later `ip netns exec` failed: Invalid argument).
    name = f"ms-mounts-{os.getpid()}"
    _ip("netns", "add", name)
    try:
        async with Dispatcher(cfg()) as d:
            r = await d.submit(probe(network=True, trajectory="t"))
            d.close_trajectory("t")
        mounted = f"/run/netns/{name}" in Path("/proc/self/mountinfo").read_text()
        still = subprocess.run(["ip", "netns", "exec", name, "true"], capture_output=True,
                               text=True, timeout=30)
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    assert r.status == "done" and mounted and still.returncode == 0, still.stderr


def _stacks(server: int) -> list[int]:
    """The live slirp4netns processes started by the sandbox server ``server``."""
    out = []
    for p in psutil.Process(server).children():
        try:
            if p.name() == "slirp4netns" and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


async def test_a_networked_sandbox_resolves_through_the_stack():
    async with Dispatcher(cfg()) as d:
        resolv, addrs = await asyncio.gather(
                     d.submit({"kind": "cpu", "argv": ["cat", "/etc/resolv.conf"], "timeout_s": 30,
                               "network": True}),
                     d.submit({"kind": "cpu", "argv": ["ip", "-4", "-o", "addr"], "timeout_s": 30,
                               "network": True, "trajectory": "t"}))
    assert [x for x in resolv.stdout.splitlines() if not x.startswith("#")] == [
        "nameserver 10.0.2.3"], resolv.stdout
    assert "tap0" in addrs.stdout and "10.0.2.100/24" in addrs.stdout, addrs.stdout


# ---------------------------------------------------------------- allowed egress


NETNS_SERVER = """
import socket, sys, threading
def serve(port):
    s = socket.create_server(("0.0.0.0", port))
    while True:
        c, _ = s.accept()
        c.recv(1024)
        c.sendall(b"hello-%d\\r\\n" % port)
        c.close()
for port in (8080, 8081):
    threading.Thread(target=serve, args=(port,), daemon=True).start()
print("ready", flush=True)
sys.stdin.read()
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def test_host():
    """A host of the test's own: network namespace ``msn<pid>`` behind a veth pair
    (``10.213.N.1/30`` this side, ``10.213.N.2`` there) that also answers on
    ``10.214.N.2`` (routed through it), serving ports 8080 and 8081 on both. Yields
    ``(host side, there, other address there)``."""
    if shutil.which("ip", path=TOOLS) is None:
        pytest.skip("iproute2 (ip) is not installed")
    n = os.getpid() % 250 + 1
    ns, here, peer = f"msn{os.getpid()}", f"msh{os.getpid()}", f"msp{os.getpid()}"
    near, far, other = f"10.213.{n}.1", f"10.213.{n}.2", f"10.214.{n}.2"
    try:
        _ip("netns", "add", ns)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot make a network namespace: {e.stderr.strip()}")
    proc = None
    try:
        _ip("link", "add", here, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", ns)
        _ip("addr", "add", f"{near}/30", "dev", here)
        _ip("link", "set", here, "up")
        _ip("-n", ns, "addr", "add", f"{far}/30", "dev", peer)
        _ip("-n", ns, "addr", "add", f"{other}/32", "dev", "lo")
        _ip("-n", ns, "link", "set", peer, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "route", "add", "default", "via", near)
        _ip("route", "add", f"{other}/32", "via", far)
        proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c",
                                 NETNS_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True)
        assert proc.stdout.readline().strip() == "ready"
        yield near, far, other
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        subprocess.run(["ip", "link", "del", here], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def test_the_test_host_answers_from_here(test_host):
    _, far, other = test_host
    for addr in (far, other):
        with socket.create_connection((addr, 8080), timeout=3) as s:
            s.sendall(b"x")
            assert s.recv(64) == b"hello-8080\r\n"


async def _egress(test_host, egress):
    near, far, other = test_host
    targets = [f"{far}:8080", f"{far}:8081", f"{other}:8080", f"{near}:22"]

    async with Dispatcher(cfg(egress=egress)) as d:
        rs = await asyncio.gather(d.submit(probe(*targets, network=True)),
                                  d.submit(probe(*targets, network=True, trajectory="t")))
    return [[line.split()[0] + (" " + line.split()[1] if line.startswith("connected") else "")
             for line in r.stdout.splitlines()] for r in rs]


@pytest.mark.parametrize(("allow", "expected"), [
    # only the allowed address and port; the host's own side of the veth never
    ("{far}/32:8080", ["connected hello-8080", "refused", "refused", "refused"]),
    # a subnet, every port; the other address is outside it
    ("{net}", ["connected hello-8080", "connected hello-8081", "refused", "refused"]),
    # both, by listing them
    ("{net}:8080-8081,{other}/32", ["connected hello-8080", "connected hello-8081",
                                    "connected hello-8080", "refused"]),
    # the default: public addresses only; the test host's are private
    ("public", ["refused", "refused", "refused", "refused"]),
])
async def test_egress_reaches_what_is_allowed_and_nothing_else(test_host, allow, expected):
    near, far, other = test_host
    net = str(ipaddress.ip_network(f"{near}/30", strict=False))
    egress = allow.format(far=far, net=net, other=other).split(",")
    traj_less, traj = await _egress(test_host, egress)
    assert traj_less == traj == expected, (egress, traj_less, traj)


async def test_allowing_everything_still_leaves_the_host_out(test_host, http_servers):
    near, far, _ = test_host
    targets = [f"{a}:{p}" for a, p, _ in http_servers.values()] + [f"{far}:8080"]

    async with Dispatcher(cfg(egress=["0.0.0.0/0"])) as d:
        r = await d.submit(probe(*targets, network=True))
    lines = r.stdout.splitlines()
    assert [x.split()[0] for x in lines] == ["refused"] * (len(targets) - 1) + ["connected"]
    assert all(not hits for _, _, hits in http_servers.values())


# ---------------------------------------------------------------- settings, missing tools


@pytest.mark.parametrize(("egress", "says"), [
    ("public", "must be a list"),
    (["10.0.0.0/33"], "'10.0.0.0/33' is not \"public\" or an IPv4 CIDR"),
    (["fd00::/8"], "only IPv4"),
    (["10.0.0.0/8:0"], "the port must be N or N-M within 1-65535"),
    (["public:443-80"], "the port must be N or N-M"),
    ([443], "entries are strings"),
])
def test_a_bad_egress_setting_is_one_line(egress, says):
    with pytest.raises(ConfigError) as e:
        SandboxConfig.from_dict({"egress": egress})
    msg = str(e.value)
    assert msg.startswith("sandbox.egress: ") and says in msg and "\n" not in msg, msg


@pytest.fixture
def no_tools(monkeypatch, tmp_path):
    """slirp4netns and nft looked for where they are not (an empty directory)."""
    from metasched.runtime.sandbox import egress
    monkeypatch.setattr(egress, "_TOOL_PATH", str(tmp_path))


async def test_without_the_tools_network_is_refused_in_one_line(no_tools, http_servers):
    a, port, hits = http_servers["loopback"]

    async with Dispatcher(cfg()) as d:
        shared, traj, offline = await asyncio.gather(d.submit(probe(f"{a}:{port}", network=True)),
                                                     d.submit(probe(f"{a}:{port}", network=True,
                                                                    trajectory="t")),
                                                     d.submit(probe(f"{a}:{port}")))
    for r in (shared, traj):
        assert r.status == "failed" and "\n" not in r.reason, r
        assert "network for sandboxes needs slirp4netns and nftables" in r.reason, r.reason
    assert offline.status == "done" and offline.stdout.startswith("refused")
    assert not hits


async def test_without_the_tools_a_network_default_stops_the_start(no_tools):
    started = time.monotonic()
    with pytest.raises(ConfigError) as e:
        async with Dispatcher(cfg(network=True)):
            pass
    assert str(e.value).startswith("sandbox.network: network for sandboxes needs slirp4netns")
    assert time.monotonic() - started < 60
