"""What the dispatcher stores in its journal for each request, and the compacted form of
a finished one.

A row's request text is a JSON object:

- ``queued_at``: when it was first accepted (Unix seconds; a re-queued request keeps
  its age);
- ``request``: its JSON form (``Request.to_dict``), without the ``env`` values unless
  the dispatcher was asked to store them (``journal_env``): environment variables are
  where secrets travel;
- ``env_withheld``: the names of the variables left out (only when some were);
- ``digest``: the SHA-256 of the request's JSON form as submitted (keys sorted, ``env``
  values included): a resubmission of the id must match it, or it is rejected instead
  of being answered with another request's result. (A digest of a guessable secret can
  be guessed by whoever can read the journal, which is why the file is 0600.)

Rows written before the digest existed hold the whole request (``env`` included, as
then); their digest is computed from it.

Compaction keeps ``queued_at`` and ``digest`` of a finished row (``"compacted": true``,
no ``request``) and its result without ``stdout``, ``stderr`` and ``value``: the id is
still known, a resubmission is still checked and answered (status, reason, exit code,
times), only the output is gone.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from metasched.runtime.requests import Request

_DROPPED_OUTPUT = ("stdout", "stderr", "value")


def _canonical(request: dict[str, Any]) -> str:
    """A request's JSON form with its keys sorted: the same text for the same request
    however its fields were ordered. Raises ValueError for a value JSON cannot hold."""
    try:
        return json.dumps(request, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"not JSON ({e})") from None


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def digest(request: dict[str, Any]) -> str:
    """SHA-256 (hex) of a request's JSON form, keys sorted."""
    return _sha256(_canonical(request))


@dataclass(frozen=True, slots=True)
class StoredRequest:
    """One row's request text, read back."""

    queued_at: float
    digest: str
    request: dict[str, Any] | None  # None once compacted
    env_withheld: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> StoredRequest:
        """Raises ValueError for a text this dispatcher did not write."""
        doc = json.loads(text)
        if not isinstance(doc, dict) or not isinstance(doc.get("queued_at"), (int, float)):
            raise ValueError("not a stored request")
        request = doc.get("request")
        if request is not None and not isinstance(request, dict):
            raise ValueError("not a stored request")
        if request is None and not doc.get("compacted"):
            raise ValueError("a stored request without its request")
        found = doc.get("digest")
        if found is None:  # written before digests: the whole request is there
            found = digest(request)
        return cls(float(doc["queued_at"]), str(found), request,
                   tuple(doc.get("env_withheld") or ()))


def store(request: Request, submitted: Request, queued_at: float, *, keep_env: bool
          ) -> tuple[str, str]:
    """The row text for ``request`` (as it will run) and the digest of ``submitted``
    (as it was given: a resubmission is compared with what the caller sent, not with
    what this machine made of it, e.g. cores capped to the node). One JSON encoding
    serves both when nothing is withheld (this runs for every accepted request).

    Raises:
        ValueError: the request holds a value JSON cannot (a Python object as a payload).
    """
    form = request.to_dict()
    text = _canonical(form)
    found = _sha256(text if submitted is request else _canonical(submitted.to_dict()))
    extra = ""
    if not keep_env and "env" in form:
        extra = f',"env_withheld":{json.dumps(sorted(form["env"]))}'
        text = _canonical({k: v for k, v in form.items() if k != "env"})
    return (f'{{"queued_at":{json.dumps(queued_at)},"request":{text},"digest":"{found}"'
            f'{extra}}}'), found


def compacted(request: str, result: str) -> tuple[str, str]:
    """A finished row's texts without what compaction drops (unchanged if already
    compact, or not this dispatcher's); for :meth:`Journal.compact`."""
    try:
        stored = StoredRequest.parse(request)
        doc = json.loads(result)
    except ValueError:
        return request, result
    if not isinstance(doc, dict):
        return request, result
    if stored.request is None and not any(doc.get(k) for k in _DROPPED_OUTPUT):
        return request, result
    for k in _DROPPED_OUTPUT:
        doc[k] = None if k == "value" else ""
    small = {"queued_at": stored.queued_at, "digest": stored.digest, "compacted": True}
    return (json.dumps(small, separators=(",", ":")),
            json.dumps(doc, separators=(",", ":"), default=repr))


__all__ = ["StoredRequest", "compacted", "digest", "store"]
