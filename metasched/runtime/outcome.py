"""What an executor reports when an action ends (one type for cpu, gpu and api)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Outcome:
    """How one action ended.

    Attributes:
        ok: it completed successfully.
        reason: why it failed, in a few words ("exit code 3", "timeout after 2.0 s",
            "memory limit exceeded (512 MB)", "killed by SIGSEGV", "HTTP 503 after 4
            attempts", ...); empty when ``ok``.
        exit_code: a process's exit status (negative: killed by that signal), else None.
        value: a gpu service's or an api call's return value.
        stdout, stderr: the last bytes a process wrote (decoded, replacement on errors).
        attempts: calls made (api retries count).
        detail: executor-specific measurements (e.g. ``restore_s``, ``pid``).
    """

    ok: bool
    reason: str = ""
    exit_code: int | None = None
    value: Any = None
    stdout: str = ""
    stderr: str = ""
    attempts: int = 1
    detail: dict[str, Any] = field(default_factory=dict)
