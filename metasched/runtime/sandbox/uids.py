"""The user ids sandboxes run as: one per trajectory, one per trajectory-less command,
taken from a configured range and given back when everything that ran as it is gone;
and whether a program is one such a user may run."""

from __future__ import annotations

import os

__all__ = ["UidPool", "runnable_by_all"]


def runnable_by_all(path: str) -> bool:
    """Whether every user (a sandbox's too) may run ``path``: each directory on the way
    (the symlinks resolved) searchable by others, the file executable by them."""
    real = os.path.realpath(path)
    d = os.path.dirname(real)
    while d != "/":
        if not os.stat(d).st_mode & 0o001:
            return False
        d = os.path.dirname(d)
    return os.access(real, os.X_OK) and bool(os.stat(real).st_mode & 0o001)


class UidPool:
    """Ids ``first .. first + count - 1``, handed out round-robin (a given-back id is
    reused as late as possible), or one shared ``nobody`` id when ``count`` is 0.

    Raises (``take``):
        RuntimeError: every id of the range is in use.
    """

    def __init__(self, first: int, count: int, nobody: int = 65534) -> None:
        self.first, self.count, self.nobody = first, count, nobody
        self._next = 0
        self._used: set[int] = set()

    @property
    def shared(self) -> bool:
        """Whether every sandbox runs as the same id (no range)."""
        return self.count == 0

    def take(self) -> int:
        if self.shared:
            return self.nobody
        for _ in range(self.count):
            uid = self.first + self._next
            self._next = (self._next + 1) % self.count
            if uid not in self._used:
                self._used.add(uid)
                return uid
        raise RuntimeError(f"all {self.count} sandbox user ids are in use")

    def give(self, uid: int) -> None:
        self._used.discard(uid)

    @property
    def in_use(self) -> int:
        return len(self._used)
