"""An API call's HTTP request (:class:`HttpSpec`): URL, method, headers and a JSON or
text body, every field validated (one-line errors naming the field)."""

from __future__ import annotations

import json as jsonlib
import re
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from metasched.errors import ConfigError, validation_error

__all__ = ["METHODS", "HttpSpec"]

METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")

# Headers the client writes itself: a user's value would contradict the bytes sent (and
# HTTP/2 forbids the last two).
_MANAGED_HEADERS = frozenset({"content-length", "transfer-encoding", "connection"})
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110 header-name characters
_URL_CHARS = re.compile(r"[\x21-\x7e]+")  # printable ASCII, no spaces: safe in a request line


def _show(value: Any, limit: int = 60) -> str:
    """repr() for an error message: one line (repr escapes newlines), shortened."""
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _one_line(text: str, limit: int = 500) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_url(url: str) -> str:
    if not url.lower().startswith(("http://", "https://")):
        raise ValueError("must start with http:// or https://")
    if not _URL_CHARS.fullmatch(url):
        raise ValueError("must be printable ASCII without spaces (percent-encode other "
                         "characters)")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 -- parsing the port is the check (ValueError if bad)
    except ValueError as e:
        raise ValueError(_one_line(str(e), 80)) from None
    if not parts.hostname:
        raise ValueError("has no host")
    try:
        parts.hostname.encode("idna")  # what the resolver will need (label lengths)
    except UnicodeError:
        raise ValueError("invalid host name") from None
    if parts.username is not None or parts.password is not None:
        raise ConfigError("", "credentials in the URL are not supported; send an "
                          "Authorization header instead")
    return url


def _check_headers(headers: dict[str, str]) -> dict[str, str]:
    for name, value in headers.items():
        if not _TOKEN.fullmatch(name):
            raise ConfigError("", f"invalid header name {_show(name)}")
        if name.lower() in _MANAGED_HEADERS:
            raise ConfigError("", f"{name!r} is set by the client; remove it")
        if any(c in value for c in "\r\n\0") or not value.isascii():
            # Non-ASCII would need an encoding the server may not share; line breaks
            # would inject headers.
            raise ConfigError("", f"value of {name!r} must be ASCII text without line "
                              f"breaks (got {_show(value)})")
    return headers


def _check_json(value: Any) -> Any:
    if value is not None:
        try:
            jsonlib.dumps(value, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as e:
            raise ConfigError("", f"not JSON-serialisable ({type(e).__name__}: "
                              f"{_one_line(str(e), 120)})") from None
    return value


def _default_if_null(default: Any) -> Any:
    return BeforeValidator(lambda v: default if v is None else v)


class HttpSpec(BaseModel):
    """One HTTP request.

    Attributes:
        url: ``http://`` or ``https://`` URL (printable ASCII; no credentials in it).
        method: GET, POST, PUT, PATCH or DELETE (any case; stored upper-case).
        headers: extra request headers; ``Content-Length``, ``Transfer-Encoding`` and
            ``Connection`` are the client's. A ``Content-Type`` given here wins over the
            default for the body.
        json_: sent as the JSON body (``application/json``) when not None (``json`` in
            the JSON form and as a keyword).
        body: sent as a UTF-8 text body (``text/plain``) otherwise.

    Construction validates every field (a pydantic ``ValidationError``, a ValueError);
    :meth:`from_dict` raises a one-line ConfigError naming the field instead. Unknown
    keys are an error. ``HttpSpec(url, **fields)`` takes the URL positionally too.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    url: Annotated[str, Field(strict=True), AfterValidator(_check_url)]
    method: Annotated[Literal[METHODS], BeforeValidator(
        lambda v: "POST" if v is None else v.upper() if isinstance(v, str) else v)] = "POST"
    headers: Annotated[dict[Annotated[str, Field(strict=True)],
                            Annotated[str, Field(strict=True)]],
                       _default_if_null({}), AfterValidator(_check_headers)] = {}
    json_: Annotated[Any, AfterValidator(_check_json)] = Field(None, alias="json")
    body: Annotated[str, Field(strict=True)] | None = None

    def __init__(self, url: str | None = None, /, **fields: Any) -> None:
        if url is not None:
            fields["url"] = url
        super().__init__(**fields)

    @model_validator(mode="after")
    def _one_body(self) -> HttpSpec:
        if self.json_ is not None and self.body is not None:
            raise ConfigError("", "give json or body, not both")
        return self

    @classmethod
    def from_dict(cls, d: Any) -> HttpSpec:
        """Build a spec from a plain mapping (e.g. a request's ``http`` section).

        Raises:
            ConfigError: one line naming the bad field (``http.url: ...``), for a
                missing url, an unknown key or any invalid value.
        """
        try:
            return cls.model_validate(d)
        except ValidationError as e:
            raise validation_error(e.errors(), model=cls, at=("http",)) from None

    def payload(self) -> tuple[bytes | None, str | None]:
        """The body bytes and their default Content-Type (None, None without a body)."""
        if self.json_ is not None:
            return (jsonlib.dumps(self.json_, allow_nan=False).encode(),
                    "application/json")
        if self.body is not None:
            return self.body.encode(), "text/plain; charset=utf-8"
        return None, None
