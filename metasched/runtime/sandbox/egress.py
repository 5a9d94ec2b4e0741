"""Network for sandboxes that are granted it: their own network namespace, a user-mode
network stack attached to it, and a rule set inside it that the sandbox cannot change.

Every sandbox has its own network namespace (bwrap's ``--unshare-net``): alone, it holds
only a loopback interface. A sandbox granted network gets, before any command runs in it:

- a rule set (nftables, table ``inet sandbox``, hook ``output``, policy drop) loaded
  into its namespace by the sandbox server as root. Commands run as an unprivileged user
  without capabilities in that namespace (it belongs to the host's user namespace), so
  they cannot change or remove it. It lets through, in this order: the namespace's own
  loopback; DNS (port 53) to the stack's resolver :data:`DNS`; it refuses every host-local
  destination whatever the operator allows (:data:`ALWAYS_BLOCKED`: ``0.0.0.0/8``,
  loopback, link-local ``169.254.0.0/16`` with cloud metadata services, multicast and
  reserved space, the stack's own subnet, whose gateway is the host, and each address of
  the host's own interfaces, read when the sandbox is made); then accepts what
  ``sandbox.egress`` allows; and refuses the rest (an ICMP "administratively
  prohibited" answer: ``connect`` fails at once with ``EHOSTUNREACH``, "No route to
  host"). IPv6 is refused too (the stack is IPv4 only).
- a `slirp4netns <https://github.com/rootless-containers/slirp4netns>`_ process: a tap
  device ``tap0`` in the namespace (address :data:`GUEST`, gateway :data:`GATEWAY`,
  MTU 65520) whose traffic it turns into ordinary sockets of the host. It runs with
  ``--disable-host-loopback`` (the gateway is not the host's ``127.0.0.1``),
  ``--enable-sandbox`` and ``--enable-seccomp`` (its own confinement), and exits when
  its sandbox ends. Its connections start from the host, which is why the host's own
  addresses are dropped inside the namespace and not only loopback.

``sandbox.egress`` (:func:`parse_egress`) is a list of entries: ``"public"`` (every
IPv4 address outside :data:`PRIVATE`: RFC 1918, shared and benchmarking space, the
documentation ranges; the default), or a CIDR, optionally with a port or port range
(``"10.213.0.0/30"``, ``"192.0.2.10/32:8080"``, ``"203.0.113.0/24:8000-8100"``). The
private ranges are reachable only when an entry names them; host-local ones never.

DNS: a networked sandbox's ``/etc/resolv.conf`` names :data:`DNS` (the stack forwards
it to the first resolver of the host's ``/etc/resolv.conf``; a resolver on the host's
loopback cannot be reached that way).
"""

from __future__ import annotations

import ipaddress
import os
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from metasched.errors import ConfigError

__all__ = ["ALWAYS_BLOCKED", "DEFAULT_EGRESS", "DNS", "GATEWAY", "GUEST", "PRIVATE",
           "RESOLV_CONF", "Allow", "find_tools", "host_addresses", "parse_egress",
           "ruleset", "slirp_argv"]

GATEWAY = "10.0.2.2"  # slirp4netns's gateway (the host, through the stack)
DNS = "10.0.2.3"  # slirp4netns's DNS forwarder
GUEST = "10.0.2.100"  # the sandbox's address on tap0
ALWAYS_BLOCKED = ("0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/4",
                  "240.0.0.0/4", "10.0.2.0/24")
PRIVATE = ("10.0.0.0/8", "100.64.0.0/10", "172.16.0.0/12", "192.0.0.0/24",
           "192.0.2.0/24", "192.168.0.0/16", "198.18.0.0/15", "198.51.100.0/24",
           "203.0.113.0/24")
DEFAULT_EGRESS = ("public",)
# A networked sandbox's /etc/resolv.conf (bound over the host's).
RESOLV_CONF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "resolv.conf")
_TOOL_PATH = "/usr/bin:/bin:/usr/sbin:/sbin:/usr/local/bin:/usr/local/sbin"
_FIELD = "sandbox.egress"


@dataclass(frozen=True)
class Allow:
    """One ``sandbox.egress`` entry: a network (None: ``"public"``) and a port range."""

    net: ipaddress.IPv4Network | None
    ports: tuple[int, int] | None = None

    def __str__(self) -> str:
        where = "public" if self.net is None else str(self.net)
        if self.ports is None:
            return where
        lo, hi = self.ports
        return f"{where}:{lo}" if lo == hi else f"{where}:{lo}-{hi}"


def parse_egress(entries: Iterable[object]) -> tuple[Allow, ...]:
    """The checked ``sandbox.egress`` list.

    Raises:
        ConfigError: one line naming the bad entry.
    """
    if isinstance(entries, (str, bytes)) or not isinstance(entries, Iterable):
        raise ConfigError(_FIELD, f"must be a list of CIDRs or \"public\" (got {entries!r})")
    out = []
    for entry in entries:
        if isinstance(entry, Allow):
            out.append(entry)
            continue
        if not isinstance(entry, str):
            raise ConfigError(_FIELD, f"entries are strings (got {entry!r})")
        if entry.count(":") > 1:
            raise ConfigError(_FIELD, f"{entry!r}: only IPv4 is supported")
        where, _, port = entry.strip().partition(":")
        ports = _ports(entry, port) if port else None
        if where == "public":
            out.append(Allow(None, ports))
            continue
        try:
            net = ipaddress.ip_network(where, strict=False)
        except ValueError:
            raise ConfigError(_FIELD, f"{entry!r} is not \"public\" or an IPv4 CIDR with an "
                              "optional :port or :port-port") from None
        if not isinstance(net, ipaddress.IPv4Network):
            raise ConfigError(_FIELD, f"{entry!r}: only IPv4 is supported")
        out.append(Allow(net, ports))
    return tuple(out)


def _ports(entry: str, text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    try:
        first, last = int(lo), int(hi or lo)
    except ValueError:
        first = last = -1
    if not 1 <= first <= last <= 65535:
        raise ConfigError(_FIELD, f"{entry!r}: the port must be N or N-M within 1-65535")
    return first, last


def host_addresses() -> list[str]:
    """The IPv4 addresses of this host's interfaces (its ``LOCAL`` routes, from
    ``/proc/net/fib_trie``: every namespace-visible one, loopback included)."""
    found: set[str] = set()
    try:
        with open("/proc/net/fib_trie") as f:
            last = ""
            for line in f:
                text = line.strip()
                if text.startswith("|--"):
                    last = text[3:].strip()
                elif text.endswith("host LOCAL") and last:
                    found.add(last)
    except OSError:
        pass
    return sorted(found, key=lambda a: tuple(int(x) for x in a.split(".")))


def ruleset(allow: Sequence[Allow], host: Sequence[str] = ()) -> str:
    """The nftables rule set loaded into a networked sandbox's namespace (see the
    module docstring); ``host``: the host's own addresses (dropped)."""
    blocked = ", ".join([*ALWAYS_BLOCKED, *host])
    private = ", ".join(PRIVATE)
    rules = ['oif "lo" accept',
             f"ip daddr {DNS} meta l4proto {{ tcp, udp }} th dport 53 accept",
             "ip daddr @blocked jump refuse"]
    for a in allow:
        match = "ip daddr != @private" if a.net is None else f"ip daddr {a.net}"
        if a.ports is not None:
            lo, hi = a.ports
            match += f" meta l4proto {{ tcp, udp }} th dport {lo if lo == hi else f'{lo}-{hi}'}"
        rules.append(f"{match} accept")
    rules.append("jump refuse")
    body = "\n".join(f"    {r}" for r in rules)
    return ("table inet sandbox {\n"
            f"  set blocked {{ type ipv4_addr; flags interval; auto-merge; "
            f"elements = {{ {blocked} }} }}\n"
            f"  set private {{ type ipv4_addr; flags interval; elements = {{ {private} }} }}\n"
            "  chain refuse {\n"
            "    reject with icmpx admin-prohibited\n"
            "  }\n"
            "  chain out {\n"
            "    type filter hook output priority 0; policy drop;\n"
            f"{body}\n"
            "  }\n"
            "}\n")


def find_tools() -> tuple[tuple[str, str] | None, str]:
    """``((slirp4netns, nft), "")`` when both are installed, else ``(None, why not)``
    in one line."""
    slirp = shutil.which("slirp4netns", path=_TOOL_PATH)
    nft = shutil.which("nft", path=_TOOL_PATH)
    unshare = shutil.which("unshare", path=_TOOL_PATH)  # see slirp_argv
    missing = [name for name, path in (("slirp4netns", slirp), ("nftables", nft),
                                       ("util-linux", unshare)) if path is None]
    if missing:
        return None, (f"network for sandboxes needs {' and '.join(missing)} (Debian/Ubuntu: "
                      f"apt-get install {' '.join(missing)}; `make sandbox-tools` does it "
                      "as root)")
    assert slirp is not None and nft is not None
    return (slirp, nft), ""


def slirp_argv(slirp: str) -> list[str]:
    """slirp4netns's command line, less what the server adds: ``--ready-fd``,
    ``--exit-fd``, the namespace's pid and the tap device's name.

    It starts in a mount namespace of its own with private propagation (``unshare
    --mount``): ``--enable-sandbox`` remakes its view of the file system, and from the
    host's mount namespace, whose mounts are shared, its unmounts reached the host's
    own mounts (``ip netns``'s ``/run/netns/<name>`` among them)."""
    unshare = shutil.which("unshare", path=_TOOL_PATH)
    if unshare is None:
        raise FileNotFoundError("unshare (util-linux) is needed to start slirp4netns")
    return [unshare, "--mount", "--propagation", "private", slirp, "--configure",
            "--mtu=65520", "--disable-host-loopback", "--enable-sandbox", "--enable-seccomp"]
