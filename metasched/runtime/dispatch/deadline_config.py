"""The dispatcher's deadline and time-sharing settings (:class:`DeadlineConfig`,
``DispatcherConfig.deadlines``); what they do is :mod:`metasched.core.deadlines` and
:mod:`metasched.runtime.dispatch.sharing`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from metasched.core.schema import Flag, Number, Strict, parse

__all__ = ["DeadlineConfig"]


class DeadlineConfig(Strict):
    """When callers give up, and what the dispatcher does about it.

    Attributes:
        default_s: the deadline of a request that has none of its own (its
            ``deadline_s``: a front door sets it from a header or from the contract the
            caller speaks), in seconds from acceptance. None: no deadline.
        margin_s: what a command needs beyond its ``timeout_s`` to be answered (start-up,
            the answer's way back): its latest start is its deadline less both. 8 s: 98
            sandboxed busy loops time-shared at once on a 2-core host at load average
            44 were answered up to 4.4 s after their start plus limit.
        on_deadline: a cpu command still queued at its latest start: ``"share"`` starts
            it on cores already busy, time-shared by the kernel (it then ends by its own
            wall-clock limit, before the deadline); ``"refuse"`` fails it then instead
            (``deadline: ...``; the SandboxFusion route answers 504, which its clients
            retry), before the caller gives up.
        recovered_s: the deadline of a command recovered from the journal after a
            restart (``on_restart: run``), in seconds from the restart: one not started
            by then is failed (``deadline: ...``), whatever ``on_deadline`` says (its
            caller has long stopped waiting on a connection; it comes back for the
            result, if at all). None: it waits its turn, however long.
        idle_share: lend the cores of a running command that measurably does not use
            them (its cgroup's CPU time) to queued commands, time-shared: three
            ``sleep`` commands on two cores do not keep a fourth command waiting.
        idle_cpu: a command is idle while it uses less than this fraction of its cores'
            time over ``idle_after_s``.
        idle_after_s: how long a command's CPU use is measured before its cores count as
            idle (and how often the measure is taken while commands wait for cores).
    """


    default_s: Number(gt=0.0, le=30 * 24 * 3600.0) | None = None
    margin_s: Number(ge=0.0, le=3600.0) = 8.0
    on_deadline: Literal["share", "refuse"] = "share"
    recovered_s: Number(gt=0.0, le=30 * 24 * 3600.0) | None = 600.0
    idle_share: Flag = True
    idle_cpu: Number(ge=0.0, le=1.0) = 0.1
    idle_after_s: Number(gt=0.0, le=3600.0) = 0.5

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> DeadlineConfig:
        """From the ``deadlines:`` settings group (unknown keys are an error)."""
        return parse(cls, {} if d is None else d, "deadlines")
