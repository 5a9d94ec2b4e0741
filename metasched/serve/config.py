"""The service's own settings (:class:`ServeConfig`) and the upstreams of the quota proxy
(:class:`Upstream`); the dispatcher behind the service has its own
(:class:`~metasched.runtime.dispatch.DispatcherConfig`)."""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from pydantic import ValidationError

from metasched.core.cluster_config import ENDPOINT_KEYS
from metasched.core.pools import EndpointSpec
from metasched.core.validate import bounded, check_keys, get_key, mapping_or_empty
from metasched.errors import ConfigError, validation_error

__all__ = ["DEFAULT_CLIENT", "LOOPBACK", "ServeConfig", "Upstream", "derated", "is_loopback",
           "parse_upstreams"]

LOOPBACK = ("127.0.0.1", "::1", "localhost")
# The keys of one proxied endpoint: its quota (EndpointSpec) and where it forwards to.
_QUOTA_KEYS = ENDPOINT_KEYS
_UPSTREAM_KEYS = {"url", "headers", "tokens", "timeout_s", "margin_s"}


@dataclass(frozen=True)
class Upstream:
    """Where the quota proxy forwards ``/v1/endpoints/<name>/<path>``.

    Attributes:
        url: the upstream's base URL (``http://`` or ``https://``); ``<path>`` and the
            query string are appended.
        headers: added to every forwarded request, replacing the caller's (e.g. the
            upstream's API key, which then stays in the service: workers need none).
        tokens: tokens a request is charged against the endpoint's TPM when it does not
            say (``X-Tokens`` header).
        timeout_s: bound on one proxied call from its start, retries and their waits
            included (the wait in the queue before it is not counted).
        margin_s: how much later one request may reach the upstream than another,
            relative to its start (network and scheduling jitter). The proxy counts the
            quota's allowance over a window ``margin_s`` longer than the upstream's, so
            that the upstream still counts at most ``rpm`` in any 60 s window.
    """

    url: str
    headers: Mapping[str, str] = field(default_factory=dict)
    tokens: int = 0
    timeout_s: float = 300.0
    margin_s: float = 0.25


def derated(spec: EndpointSpec, margin_s: float) -> EndpointSpec:
    """The quota the dispatcher enforces for an upstream quota of ``spec``: the same
    allowance per window, over a window ``margin_s`` longer (see
    :attr:`Upstream.margin_s`). A request reaches the upstream between its start and
    ``margin_s`` later, so those arriving in any upstream window started within one
    window ``margin_s`` longer: at most the allowance."""
    w = spec.window_s + margin_s
    f = spec.window_s / w
    return replace(spec, rpm=spec.rpm * f, tpm=None if spec.tpm is None else spec.tpm * f,
                   window_s=w)


def parse_upstreams(d: Any, path: str = "endpoints"
                    ) -> tuple[dict[str, EndpointSpec], dict[str, Upstream]]:
    """Split ``endpoints`` settings into the dispatcher's quotas and the proxy's
    upstreams: ``name -> {rpm, max_concurrency, tpm, window_s}`` plus, for an endpoint
    the proxy forwards to, ``url`` (and ``headers``, ``tokens``, ``timeout_s``,
    ``margin_s``). A proxied endpoint's quota is derated by its margin (see
    :func:`derated`).

    Raises:
        ConfigError: one line naming the setting.
    """
    from metasched.core.cluster_config import parse_endpoints
    from metasched.runtime.api_calls import HttpSpec

    quotas: dict[str, Any] = {}
    upstreams: dict[str, Upstream] = {}
    for name, e in mapping_or_empty(d, path).items():
        at = f"{path}.{name}"
        if not isinstance(e, Mapping):
            raise ConfigError(at, f"must be a mapping (got {e!r})")
        check_keys(e, _QUOTA_KEYS | _UPSTREAM_KEYS, at)
        quotas[name] = {k: v for k, v in e.items() if k in _QUOTA_KEYS}
        if e.get("url") is None:
            for key in _UPSTREAM_KEYS - {"url"}:
                if e.get(key) is not None:
                    raise ConfigError(f"{at}.{key}", "only an endpoint with a url (one the "
                                      "proxy forwards to) has it")
            continue
        url = get_key(e, "url", at)
        headers = mapping_or_empty(e.get("headers"), f"{at}.headers")
        try:
            HttpSpec.model_validate({"url": str(url),
                                     "headers": {str(k): v for k, v in headers.items()}})
        except ValidationError as err:
            raise validation_error(err.errors(), model=HttpSpec, at=(at,)) from None
        upstreams[str(name)] = Upstream(
            url=str(url).rstrip("/"), headers={str(k): str(v) for k, v in headers.items()},
            tokens=bounded(e.get("tokens", 0), f"{at}.tokens", lo=0, integer=True),
            timeout_s=bounded(e.get("timeout_s", 300.0), f"{at}.timeout_s", lo=0.0,
                              lo_open=True, hi=30 * 24 * 3600.0),
            margin_s=bounded(e.get("margin_s", 0.25), f"{at}.margin_s", lo=0.0, hi=60.0))
    specs = parse_endpoints(quotas, path)
    for name, up in upstreams.items():
        specs[name] = derated(specs[name], up.margin_s)
    return specs, upstreams


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a bind address) is reachable from this machine only."""
    if host in LOOPBACK:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


DEFAULT_CLIENT = "default"  # the client holding ``token``


def _check_token(token: Any, name: str) -> None:
    if not isinstance(token, str) or len(token) < 16 or not token.isprintable() \
            or " " in token:
        raise ConfigError(name, "must be at least 16 printable characters without spaces "
                          "(e.g. from: python -c 'import secrets; "
                          "print(secrets.token_urlsafe())')")


@dataclass
class ServeConfig:
    """How the service runs (the dispatcher behind it is configured on its own).

    Attributes:
        host, port: where it listens. Any address but a loopback one needs ``token``.
        token: the bearer token every request but ``/v1/ping`` and ``/v1/health`` must
            carry (``Authorization: Bearer <token>``); None: no authentication, allowed
            on a loopback address only. Its holder is the client named ``default``.
        tokens: more clients, by name: name -> its token. With authentication on
            (``token`` or ``tokens``), each token is one client: a trajectory belongs to
            the client that opened it, and only that client may act on it, close it or
            read its actions' results. Without it, every client is the same, trusted.
        max_body_mb: request bodies larger than this are refused (413).
        header_timeout_s: a request's headers must arrive within this many seconds of
            the connection's opening (of its next request's first byte, on a kept-alive
            connection); later, 408 and the connection is closed.
        body_timeout_s: a request's body must arrive within this many seconds of its
            headers; later, 408 and the connection is closed.
        max_connections: client connections open at once; one more is answered 503 and
            closed as soon as it is accepted (None: this process's descriptor limit less
            a reserve, see :func:`~metasched.serve.connections.default_max_connections`).
        upstreams: the quota proxy's endpoints (see :class:`Upstream`); their quotas
            are the dispatcher's endpoints of the same names.
        languages: the ``/run_code`` languages to offer (None: every one whose toolchain
            works here, found by running a small program in each at start).
        task: the task of ``/run_code`` actions that do not name one.
        keep_results: finished results kept in memory for ``GET /v1/actions/{id}``
            (older ones are answered from the dispatcher's journal, where it has one).
    """

    host: str = "127.0.0.1"
    port: int = 8080
    token: str | None = None
    tokens: dict[str, str] = field(default_factory=dict)
    max_body_mb: float = 64.0
    header_timeout_s: float = 30.0
    body_timeout_s: float = 120.0
    max_connections: int | None = None
    upstreams: dict[str, Upstream] = field(default_factory=dict)
    languages: list[str] | None = None
    task: str = "run_code"
    keep_results: int = 100_000

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise :class:`ConfigError` (one line, naming the setting) on a bad value."""
        if not isinstance(self.host, str) or not self.host:
            raise ConfigError("host", f"must be an address to listen on (got {self.host!r})")
        bounded(self.port, "port", lo=0, hi=65535, integer=True)
        if self.token is not None:
            _check_token(self.token, "token")
        if not isinstance(self.tokens, Mapping):
            raise ConfigError("tokens", f"must be a mapping of client name to token (got "
                              f"{type(self.tokens).__name__})")
        self.tokens = {str(k): v for k, v in self.tokens.items()}
        for name, token in self.tokens.items():
            if not name or name == DEFAULT_CLIENT and self.token is not None:
                raise ConfigError("tokens", f"{name!r}: a client name must be non-empty and "
                                  f"not {DEFAULT_CLIENT!r} (the holder of token)")
            _check_token(token, f"tokens.{name}")
        given = [t for t in [self.token, *self.tokens.values()] if t is not None]
        if len(set(given)) != len(given):
            raise ConfigError("tokens", "two clients have the same token: each needs its own")
        if not given and not is_loopback(self.host):
            raise ConfigError("token", f"listening on {self.host} needs a token (set "
                              f"METASCHED_SERVE_TOKEN, or token=...): only a loopback "
                              f"address may go without")
        bounded(self.max_body_mb, "max_body_mb", lo=0.0, lo_open=True, hi=math.inf)
        if not math.isfinite(self.max_body_mb):
            raise ConfigError("max_body_mb", f"must be finite (got {self.max_body_mb!r})")
        for name in ("header_timeout_s", "body_timeout_s"):
            bounded(getattr(self, name), name, lo=0.0, lo_open=True, hi=24 * 3600.0)
        if self.max_connections is not None:
            bounded(self.max_connections, "max_connections", lo=1, integer=True)
        if self.languages is not None and (
                not isinstance(self.languages, list)
                or not all(isinstance(x, str) and x for x in self.languages)):
            raise ConfigError("languages", f"must be a list of language names or null "
                              f"(got {self.languages!r})")
        if not isinstance(self.task, str) or not self.task:
            raise ConfigError("task", f"must be a non-empty string (got {self.task!r})")
        bounded(self.keep_results, "keep_results", lo=0, integer=True)

    @property
    def clients(self) -> dict[str, str]:
        """Token -> client name, for every configured token (empty: authentication
        off)."""
        out = {token: name for name, token in self.tokens.items()}
        if self.token is not None:
            out[self.token] = DEFAULT_CLIENT
        return out

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 2**20)
