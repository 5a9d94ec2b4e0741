"""The service's own settings (:class:`ServeConfig`) and the upstreams of the quota proxy
(:class:`Upstream`); the dispatcher behind the service has its own
(:class:`~metasched.runtime.dispatch.DispatcherConfig`)."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, model_validator

from metasched.core.cluster_config import _Endpoint
from metasched.core.pools import EndpointSpec
from metasched.core.schema import Checked, Count, Number, Strict, Text, parse
from metasched.errors import ConfigError
from metasched.serve.e2b.templates import E2BTemplate

__all__ = ["DEFAULT_CLIENT", "E2B_SDK1_PORTS", "LOOPBACK", "GenerationReplicas", "ServeConfig",
           "Upstream", "derated", "is_loopback", "parse_upstreams"]

LOOPBACK = ("127.0.0.1", "::1", "localhost")


class Upstream(Strict):
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

    url: Text
    headers: dict[str, str] = {}
    tokens: Count(0) = 0
    timeout_s: Number(gt=0.0, le=30 * 24 * 3600.0) = 300.0
    margin_s: Number(ge=0.0, le=60.0) = 0.25

    @model_validator(mode="before")
    @classmethod
    def _http(cls, data: Any) -> Any:
        """The url and headers as an api request's (``http://`` or ``https://``, header
        names and values a request may carry); the url without its trailing ``/``."""
        from metasched.runtime.api_calls import HttpSpec

        if not isinstance(data, Mapping) or data.get("url") is None:
            return data
        headers = parse(Mapping[Any, Any], data.get("headers") or {}, "headers")
        headers = {str(k): v for k, v in headers.items()}
        parse(HttpSpec, {"url": str(data["url"]), "headers": headers})
        return {**data, "url": str(data["url"]).rstrip("/"),
                "headers": {k: str(v) for k, v in headers.items()}}


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


class _ProxiedEndpoint(_Endpoint):
    """An ``endpoints`` entry of the service: a quota and, for an endpoint the proxy
    forwards to, its upstream (``url`` and the rest of :class:`Upstream`)."""

    url: Any = None
    headers: Any = None
    tokens: Any = None
    timeout_s: Any = None
    margin_s: Any = None

    @model_validator(mode="after")
    def _upstream_fields(self) -> _ProxiedEndpoint:
        if self.url is None:
            for key in _UPSTREAM_KEYS - {"url"}:
                if getattr(self, key) is not None:
                    raise ConfigError(key, "only an endpoint with a url (one the proxy "
                                      "forwards to) has it")
        else:
            self.upstream()
        return self

    def upstream(self) -> Upstream:
        return parse(Upstream, {k: getattr(self, k) for k in _UPSTREAM_KEYS
                                if getattr(self, k) is not None})


_UPSTREAM_KEYS = frozenset(Upstream.model_fields)


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
    given = parse(dict[str, _ProxiedEndpoint] | None, d, path) or {}
    specs = {str(k): e.spec() for k, e in given.items()}
    upstreams = {str(k): e.upstream() for k, e in given.items() if e.url is not None}
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


def _token(token: str) -> str:
    if len(token) < 16 or not token.isprintable() or " " in token:
        raise ConfigError("", "must be at least 16 printable characters without spaces "
                          "(e.g. from: python -c 'import secrets; "
                          "print(secrets.token_urlsafe())')")
    return token


def _port(port: int) -> int:
    if not 0 <= port <= 65535:
        raise ConfigError("", f"must be >= 0 and <= 65535 (got {port})")
    return port


Token = Annotated[str, Field(strict=True), AfterValidator(_token)]
"""A bearer token: at least 16 printable characters, no spaces."""


def _base_url(url: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"{url!r}: give a base URL (http://host:port)")
    return url.rstrip("/")


class GenerationReplicas(Strict):
    """The OpenAI-compatible front door's replicas (``/v1/chat/completions``,
    ``/v1/completions``; :mod:`metasched.serve.generation_door`).

    Attributes:
        replicas: base URLs of vLLM or SGLang OpenAI servers (``http://host:port``, no
            ``/v1``); a trajectory stays on the one it first went to (its prefix cache).
        order: the priority stamped on each request (lower first, as vLLM's
            ``--scheduling-policy priority`` reads it): ``predicted``, the longest
            predicted remaining work of the request's trajectory first (the dispatcher's
            remaining-work predictor); ``least_slack``, the longest time since the
            trajectory opened plus its predicted remaining work first; ``fifo``, none
            stamped (the client's own ``priority`` passes through).
        timeout_s: bound on one forwarded request, its whole stream included.
    """

    replicas: Annotated[list[Annotated[Text, AfterValidator(_base_url)]], Field(min_length=1)]
    order: Literal["predicted", "least_slack", "fifo"] = "predicted"
    timeout_s: Number(gt=0.0, le=24 * 3600.0) = 600.0


# E2B SDK 1.x's fixed ports in its debug mode, where ``e2b_sdk1_ports`` listens too
# (metasched.serve.e2b.sdk1_door): its API, envd, code interpreter.
E2B_SDK1_PORTS = {3000: "API", 49983: "envd", 49999: "code interpreter"}


class ServeConfig(Checked):
    """How the service runs (the dispatcher behind it is configured on its own).

    Built by keyword (``ServeConfig(port=8080, token=...)``); a bad value is a
    :class:`ConfigError`, one line naming the setting.

    Attributes:
        host, port: where it listens. Any address but a loopback one needs ``token``.
        token: the bearer token every request but ``/v1/ping`` and ``/v1/health`` must
            carry (``Authorization: Bearer <token>``); None: no authentication, allowed
            on a loopback address only. Its holder is the client named ``default``.
        tokens: more clients, by name: name -> its token. With authentication on
            (``token`` or ``tokens``), each token is one client: a trajectory belongs to
            the client that opened it, and only that client may act on it, close it or
            read its actions' results. Without it, every client is the same, trusted.
        max_body_mb: request bodies larger than this are refused (413), E2B uploads'
            aside (``max_file_mb``); a ``/run_code`` body's ``files`` are bounded by it.
        max_file_mb: an E2B download of a larger file, or an E2B upload of a larger
            body, is refused (413, one line); so is a file of ``fetch_files`` that would
            take one answer's files past it (named in ``fetch_errors``). Smaller ones
            stream as they are read or written (the service holds a piece or two).
        header_timeout_s: a request's headers must arrive within this many seconds of
            the connection's opening (of its next request's first byte, on a kept-alive
            connection); later, 408 and the connection is closed.
        body_timeout_s: a request's body must arrive within this many seconds of its
            headers; later, 408 and the connection is closed.
        max_connections: client connections open at once; one more is answered 503 and
            closed as soon as it is accepted (None: this process's descriptor limit less
            a reserve, see :func:`~metasched.serve.connections.default_max_connections`).
        client_commands: E2B commands (background or not) one client may have running
            at once; one more is refused (``resource exhausted``, one line) and other
            clients are unaffected (None: from the descriptor limit, see
            :func:`~metasched.serve.connections.default_client_commands`).
        upstreams: the quota proxy's endpoints (see :class:`Upstream`); their quotas
            are the dispatcher's endpoints of the same names.
        languages: the ``/run_code`` languages to offer (None: every one whose toolchain
            works here, found by running a small program in each at start).
        task: the task of ``/run_code`` actions that do not name one.
        e2b_templates: the E2B templates with packages (see
            :mod:`metasched.serve.e2b.templates`): their packages' layers, built in
            ``e2b_cache`` (None: ``~/.cache/metasched/e2b-templates``), are among the
            dispatcher's ``sandbox.system_paths``, their files its workspace templates.
        e2b_cache: where the templates' layers are (see ``e2b_templates``).
        e2b_sdk1_ports: also listen on 127.0.0.1 at E2B SDK 1.x's fixed ports (3000,
            49983, 49999: its debug mode, ``E2B_DEBUG=true``) and serve its API, envd
            and code interpreter there (see :mod:`metasched.serve.e2b.sdk1_door`);
            only without tokens.
        e2b_sdk1_replace: a sandbox made through SDK 1.x's door ends the door sandboxes
            made before it (SDK 1.x in debug mode sends no kill): for one sandbox at a
            time, whose replacement then works (rllm's ``E2BPythonInterpreter`` with
            ``n_sandboxes=1`` restarting its sandbox); off, a second one live makes
            the code interpreter refuse its calls.
        keep_results: finished results kept in memory for ``GET /v1/actions/{id}``
            (older ones are answered from the dispatcher's journal, where it has one).
        generation: the OpenAI-compatible front door's replicas (see
            :class:`GenerationReplicas`); None: its routes answer 404.
    """

    host: Text = "127.0.0.1"
    port: Annotated[Count(0), AfterValidator(_port)] = 8080
    token: Token | None = None
    tokens: dict[Annotated[str, BeforeValidator(str)], Token] = {}
    max_body_mb: Number(gt=0.0) = 64.0
    max_file_mb: Number(gt=0.0) = 4096.0
    header_timeout_s: Number(gt=0.0, le=24 * 3600.0) = 30.0
    body_timeout_s: Number(gt=0.0, le=24 * 3600.0) = 120.0
    max_connections: Count(1) | None = None
    client_commands: Count(1) | None = None
    upstreams: dict[str, Upstream] = {}
    languages: list[Text] | None = None
    task: Text = "run_code"
    keep_results: Count(0) = 100_000
    e2b_templates: dict[str, E2BTemplate] = {}
    e2b_cache: Text | None = None
    e2b_sdk1_ports: bool = False
    e2b_sdk1_replace: bool = False
    generation: GenerationReplicas | None = None

    one_line_root = 'settings'

    @model_validator(mode="after")
    def _clients(self) -> ServeConfig:
        for name in self.tokens:
            if not name or name == DEFAULT_CLIENT and self.token is not None:
                raise ConfigError("tokens", f"{name!r}: a client name must be non-empty and "
                                  f"not {DEFAULT_CLIENT!r} (the holder of token)")
        given = [t for t in [self.token, *self.tokens.values()] if t is not None]
        if len(set(given)) != len(given):
            raise ConfigError("tokens", "two clients have the same token: each needs its own")
        if not given and not is_loopback(self.host):
            raise ConfigError("token", f"listening on {self.host} needs a token (set "
                              f"METASCHED_SERVE_TOKEN, or token=...): only a loopback "
                              f"address may go without")
        return self

    @model_validator(mode="after")
    def _sdk1_door(self) -> ServeConfig:
        if not self.e2b_sdk1_ports:
            if self.e2b_sdk1_replace:
                raise ConfigError("e2b_sdk1_replace", "needs e2b_sdk1_ports (the door it "
                                  "is a rule of)")
            return self
        if self.clients:
            raise ConfigError("e2b_sdk1_ports", "SDK 1.x's code interpreter sends no "
                              "credential, so its door serves only a service without "
                              "tokens (on 127.0.0.1)")
        if self.port in E2B_SDK1_PORTS:
            raise ConfigError("e2b_sdk1_ports", f"port {self.port} is one of SDK 1.x's "
                              f"({', '.join(map(str, E2B_SDK1_PORTS))}): listen on another")
        return self

    @model_validator(mode="after")
    def _languages(self) -> ServeConfig:
        from metasched.serve.languages import LANGUAGES

        for name in self.languages or ():  # known before anything listens
            if name not in LANGUAGES:
                raise ConfigError("languages", f"unknown language {name!r} (known: "
                                  f"{', '.join(LANGUAGES)})")
        return self

    @property
    def clients(self) -> dict[str, str]:
        """Token -> client name, for every configured token (empty: authentication
        off)."""
        out = {token: name for name, token in self.tokens.items()}
        if self.token is not None:
            out[self.token] = DEFAULT_CLIENT
        return out

    @property
    def max_file_bytes(self) -> int:
        return int(self.max_file_mb * 2**20)

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 2**20)
