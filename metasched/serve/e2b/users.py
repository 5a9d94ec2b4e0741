"""The user an envd call asks to act as (E2B's ``user=``: the ``Authorization: Basic``
header of the Connect RPC calls, the ``username`` parameter of file transfers).

A sandbox's commands and file calls run as its one unprivileged user, which plays
E2B's default user ``user``; asking for ``root`` or any other user is refused with
one line, never ignored.
"""

from __future__ import annotations

import base64
import binascii

__all__ = ["ACCEPTED_USERS", "user_refusal", "user_from_basic"]

ACCEPTED_USERS = ("user", "sandbox")  # E2B's default user; the sandbox's own name


def user_from_basic(header: str | None) -> str | None:
    """The user named by an ``Authorization: Basic base64(user:)`` header (None:
    no such header)."""
    if not header or not header.startswith("Basic "):
        return None
    try:
        return base64.b64decode(header[6:].strip(), validate=True).decode().split(":", 1)[0]
    except (binascii.Error, UnicodeDecodeError):
        return ""


def user_refusal(user: str | None) -> str | None:
    """Why a call asking for ``user`` is refused (one line), or None: no user asked
    for, or one that the sandbox's user plays."""
    if user is None or user in ACCEPTED_USERS:
        return None
    return (f"user {user!r}: not offered here: a sandbox's commands and files are its "
            f"unprivileged user's (E2B's 'user'); leave user= unset")
