"""The staleness bound of asynchronous RL rollouts (AReaL's ``max_head_offpolicyness``).

Asynchronous RL has no step barrier: the trainer takes a batch of ``batch`` finished
trajectories as soon as that many have finished, and new trajectories start while
others still run. What bounds how old a trajectory's weights may get is a count, as
AReaL's ``StalenessManager`` keeps it: with the trainer at version ``v`` (batches
trained so far), a new trajectory may start only while

    started < (max_offpolicyness + v + 1) * batch

(AReaL's ``(ofp + current_version + 1) * consumer_bs - (accepted + running)``, where
every started trajectory is accepted or running). ``max_offpolicyness = 0`` is
synchronous RL without the barrier's idle tail: the next batch starts only after the
trainer has trained on this one.

The gate holds the counts; the clock that starts trajectories asks it (``room``) and
tells it what started, finished and what the trainer finished (``trained``). Both
clocks can use it: the simulator does (``metasched.sim.async_rollout``).
"""

from __future__ import annotations


class StalenessGate:
    """Counts of started and finished trajectories and the trainer's version.

    Args:
        batch: trajectories per training batch (the trainer's consumer batch size).
        max_offpolicyness: AReaL's ``max_head_offpolicyness`` (>= 0).
    """

    def __init__(self, batch: int, max_offpolicyness: int) -> None:
        if batch < 1:
            raise ValueError(f"batch must be >= 1 (got {batch})")
        if max_offpolicyness < 0:
            raise ValueError(f"max_offpolicyness must be >= 0 (got {max_offpolicyness})")
        self.batch = batch
        self.max_offpolicyness = max_offpolicyness
        self.started = 0
        self.finished = 0
        self.version = 0  # batches the trainer has trained on
        self.batches_ready = 0  # batches complete (finished // batch), trained or not
        self.most_ahead = 0  # the largest started - (version + 1) * batch seen at a start

    @property
    def limit(self) -> int:
        """How many trajectories may have started at the current version."""
        return (self.max_offpolicyness + self.version + 1) * self.batch

    def room(self) -> int:
        """How many more trajectories may start now."""
        return max(0, self.limit - self.started)

    def start(self) -> int:
        """Count a started trajectory; returns the version it starts at. Raises
        ``RuntimeError`` past the bound (the caller must ask ``room`` first)."""
        if self.started >= self.limit:
            raise RuntimeError(f"staleness bound: {self.started} started, limit {self.limit}")
        self.started += 1
        self.most_ahead = max(self.most_ahead, self.started - (self.version + 1) * self.batch)
        return self.version

    def finish(self) -> bool:
        """Count a finished trajectory; True when it completes a batch for the trainer."""
        self.finished += 1
        if self.finished // self.batch > self.batches_ready:
            self.batches_ready += 1
            return True
        return False

    def trained(self) -> None:
        """The trainer has trained on one more batch: the version advances."""
        if self.version >= self.batches_ready:
            raise RuntimeError("the trainer trained a batch that is not complete")
        self.version += 1
