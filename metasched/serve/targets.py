"""Where an ``api`` request given over HTTP (``POST /v1/actions``) may send its call:
under its endpoint's configured ``url`` (``endpoints.<name>.url``, the quota proxy's
upstream), nowhere else. Without this check the service would call any address it can
reach on a client's behalf (its own API, other services on the host's loopback, a
cloud's metadata address). Job files and the Python API are the operator's own code,
run with the operator's rights: they may call any URL.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from metasched.errors import ConfigError, short
from metasched.serve.config import Upstream

__all__ = ["check_http_target"]

_DEFAULT_PORT = {"http": 80, "https": 443}
# Encodings a server may decode into a path separator or a dot segment after the check.
_ENCODED = ("%2f", "%5c", "%2e")


def _origin_and_path(url: str) -> tuple[tuple[str, str, int], str]:
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    port = parts.port or _DEFAULT_PORT.get(scheme, 0)
    return (scheme, (parts.hostname or "").lower(), port), parts.path


def _under(url: str, base: str) -> bool:
    """Whether ``url`` lies under ``base``: the same scheme, host and port, and a path
    at or below the base's with no dot segment (plain or encoded)."""
    try:
        origin, path = _origin_and_path(url)
        base_origin, base_path = _origin_and_path(base)
    except ValueError:  # a bad port
        return False
    if origin != base_origin or "\\" in path or any(e in path.lower() for e in _ENCODED):
        return False
    if any(seg in (".", "..") for seg in path.split("/")):
        return False
    base_path = base_path.rstrip("/")
    return path == base_path or path.startswith(base_path + "/") or (not base_path
                                                                      and not path)


def check_http_target(doc: Mapping[str, Any], upstreams: Mapping[str, Upstream]) -> None:
    """Refuse an ``api`` request whose ``http.url`` is not under its endpoint's
    configured url (a request of another kind, or without ``http``, passes; a malformed
    one is left to the request schema).

    Raises:
        ConfigError: one line naming ``http.url``.
    """
    http = doc.get("http")
    if doc.get("kind") != "api" or not isinstance(http, Mapping):
        return
    url = http.get("url")
    if not isinstance(url, str):
        return
    endpoint = doc.get("endpoint")
    up = upstreams.get(endpoint) if isinstance(endpoint, str) else None
    if up is None:
        proxied = ", ".join(sorted(upstreams)) or "none"
        raise ConfigError("http.url", f"over HTTP an api request calls only its endpoint's "
                          f"configured url (endpoints.<name>.url); endpoint "
                          f"{short(endpoint)} has none (with a url: {proxied})")
    if not _under(url, up.url):
        raise ConfigError("http.url", f"must lie under endpoint {endpoint}'s url "
                          f"({up.url}/...; no dot segments): got {short(url)}")
