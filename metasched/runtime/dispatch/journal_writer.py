"""The dispatcher's writes to its journal, grouped: requests accepted in one loop turn
are journaled in one commit at its end and queued once that is durable; starts and
results wait up to ``journal_delay_s`` to be committed with others."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from metasched.errors import ConfigError
from metasched.runtime.dispatch.jobs import Job, taken
from metasched.runtime.dispatch.shared import Shared
from metasched.runtime.journal import Journal
from metasched.runtime.journal_rows import StoredRequest, compacted
from metasched.runtime.requests import REJECTED, Result


class WriterHost(Shared, Protocol):
    """What the journal writer asks of its dispatcher
    (the :class:`~.dispatcher.Dispatcher`)."""

    n_rejected: int

    def enqueue_job(self, job: Job) -> None: ...

    def schedule(self) -> None: ...


log = logging.getLogger("metasched.dispatch")


class JournalWriter:
    """Group commits to ``journal`` for dispatcher ``d``: it queues (``d.enqueue_job``)
    the requests it made durable and answers those the journal already finished."""

    def __init__(self, d: WriterHost, journal: Journal) -> None:
        self.d = d
        self.journal = journal
        # Journal writes waiting for the next group commit: starts by key (pid, attempt,
        # time), and finishes; a finish whose start is still waiting takes it along.
        self._starts: dict[str, tuple[int | None, int, float]] = {}
        self._finishes: list[tuple[str, str, float]] = []
        self._start_finishes: list[tuple[str, int, float, str, float]] = []
        self.to_queue: list[tuple[Job, dict, str]] = []  # accepted, queued once journaled
        self._flush_waiters: list[asyncio.Future] = []  # enqueue() calls awaiting a commit
        self._flush_pending = False
        self.timer: asyncio.TimerHandle | None = None

    def add(self, job: Job, doc: dict, digest: str) -> None:
        """Journal an accepted request with the others of this loop turn; it is queued
        once that commit is done."""
        self.to_queue.append((job, doc, digest))
        if not self._flush_pending:
            self._flush_pending = True
            self.d.loop.call_soon(self.flush)

    async def durable(self) -> None:
        """Return once what was accepted so far is committed (or rejected)."""
        if self.to_queue:
            waiter = self.d.loop.future()
            self._flush_waiters.append(waiter)
            await waiter

    def flush(self) -> None:
        """Commit every waiting write now, and queue what it made durable."""
        self._flush_pending = False
        waiters, self._flush_waiters = self._flush_waiters, []
        try:
            self._commit()
        finally:
            for w in waiters:  # enqueue() returns: its request is durable (or rejected)
                if not w.done():
                    w.set_result(None)

    def _commit(self) -> None:
        starts, self._starts = self._starts, {}
        finishes, self._finishes = self._finishes, []
        both, self._start_finishes = self._start_finishes, []
        accepted, self.to_queue = self.to_queue, []
        if not (starts or finishes or both or accepted):
            return
        d = self.d
        fresh: list[bool] = []
        try:
            with self.journal.batch():
                for job, doc, _ in accepted:
                    fresh.append(self.journal.accept(job.request.id, doc)[0])
                skipped = self.journal.record(
                    [(key, *row) for key, row in starts.items()], finishes, both)
            if skipped:  # never expected: each job is started and finished once
                log.warning("journal: %d start/finish writes named no unfinished request",
                            skipped)
        except Exception as e:  # noqa: BLE001 - e.g. a full disk: not accepted
            for job, _, _ in accepted:
                d.jobs.drop(job.request.id)
                d.n_rejected += 1
                if not job.future.done():
                    job.future.set_result(Result(
                        job.request.id, REJECTED, f"journal write failed: {e}",
                        queued_at=job.queued_at, finished_at=job.queued_at))
            log.error("journal write failed: %s", e)
            return
        queued = False
        for (job, _, digest), new in zip(accepted, fresh, strict=True):
            answer = None if new else self._stored_answer(job, digest)
            if answer is None:
                d.enqueue_job(job)
                queued = True
            else:  # finished under an earlier dispatcher: its result stands
                d.jobs.drop(job.request.id)
                job.future.set_result(answer)
        if queued:
            d.schedule()  # in this callback rather than one more loop callback later

    def _stored_answer(self, job: Job, digest: str) -> Result | None:
        """The answer to a request whose id the journal already held: its stored result
        if it finished and is the same request, a rejection if it is another request,
        None if it is unfinished (it runs)."""
        row = self.journal.row(job.request.id)
        if row is None or row[2] is None:
            return None
        try:
            same = StoredRequest.parse(row[0]).digest == digest
        except ValueError:
            same = False
        if same:
            return Result.from_json(row[2])
        self.d.n_rejected += 1
        return Result(job.request.id, REJECTED, str(ConfigError("id", taken(job.request.id))),
                      queued_at=job.queued_at, finished_at=job.queued_at)

    def start(self, key: str, pid: int | None, attempt: int) -> None:
        """Journal a start (with its process group, if any) in the next group commit."""
        self._starts[key] = (pid, attempt, time.time())
        self._commit_soon()

    def finish(self, key: str, result: str) -> None:
        """Journal a result in the next group commit; a start still waiting for that
        commit goes into the same row update (one write instead of two)."""
        start = self._starts.pop(key, None)
        if start is None:
            self._finishes.append((key, result, time.time()))
        else:
            _, attempt, t0 = start
            self._start_finishes.append((key, attempt, t0, result, time.time()))
        self._commit_soon()

    def _commit_soon(self) -> None:
        """Group commit within ``journal_delay_s``: a crash before then only means the
        request runs again (its acceptance is already durable)."""
        if self.timer is None and self.d.loop.aio is not None:
            self.timer = self.d.loop.call_later(self.d.config.journal_delay_s,
                                                 self._timed_flush)

    def _timed_flush(self) -> None:
        self.timer = None
        if not self.d.loop.closed:
            self.flush()

    def compact(self, older_than_s: float, *, vacuum: bool = False) -> int:
        """Commit what waits, then compact rows finished more than ``older_than_s``
        seconds ago (see :meth:`Journal.compact`)."""
        self.flush()
        return self.journal.compact(older_than_s, compacted, vacuum=vacuum)

    def close(self) -> None:
        """Commit what waits and close the journal."""
        if self.timer is not None:
            self.timer.cancel()
        self.flush()
        self.journal.close()


__all__ = ["JournalWriter"]
