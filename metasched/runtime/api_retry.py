"""How an API call is retried: :class:`RetryPolicy` (attempts, exponential backoff with
full jitter, the cap on any wait) and :class:`RetryableError` (a user's callable asking
for a retry)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

__all__ = ["RetryPolicy", "RetryableError"]


class RetryableError(Exception):
    """Raised by a user's async callable to ask for a retry (like a 429/5xx).

    Args:
        message: why, in a few words; the failure reason if the retries run out.
        retry_after_s: wait this long before the retry (capped by the policy's
            ``max_backoff_s``) instead of the exponential backoff.
    """

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently to retry.

    Attributes:
        max_attempts: calls in all (1: no retry).
        backoff_s: base wait; before retry ``k`` (1-based) the wait is uniform in
            ``[0, min(max_backoff_s, backoff_s * 2**(k-1))]`` ("full jitter", so that
            clients rejected together do not come back together).
        max_backoff_s: cap on any wait, a server's ``Retry-After`` included.
    """

    max_attempts: int = 4
    backoff_s: float = 0.5
    max_backoff_s: float = 30.0

    def __post_init__(self) -> None:
        if not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ValueError(f"retry.max_attempts: must be an integer >= 1 "
                             f"(got {self.max_attempts!r})")
        for name in ("backoff_s", "max_backoff_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not (0 <= v < math.inf):
                raise ValueError(f"retry.{name}: must be a finite number >= 0 (got {v!r})")

    def delay(self, retry: int, rng: random.Random,
              retry_after_s: float | None = None) -> float:
        """Seconds to wait before retry number ``retry`` (1 = the second attempt).

        ``retry_after_s`` (a server's or a :class:`RetryableError`'s) replaces the
        jittered backoff; either way the wait is capped by ``max_backoff_s``.
        """
        if retry_after_s is not None:
            try:
                after = float(retry_after_s)
            except (TypeError, ValueError):  # a user's odd value: fall back to backoff
                after = math.nan
            if math.isfinite(after):
                return min(self.max_backoff_s, max(0.0, after))
        # min() on the exponent first: 2.0**k overflows a float for k > 1023.
        ceiling = min(self.max_backoff_s, self.backoff_s * 2.0 ** min(retry - 1, 64))
        return rng.random() * ceiling

