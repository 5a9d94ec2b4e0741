"""What the step heuristics' ``estimates: predictor`` reads: the learned remaining-work
predictor the cluster state carries (``state.predictor``, :mod:`metasched.core.predictor`)."""

from __future__ import annotations

from metasched.core.actions import Action
from metasched.core.state import ClusterState

ESTIMATES = ("given", "predictor")  # where the step heuristics' remaining work comes from


def check_estimates(estimates: str) -> str:
    """``estimates`` if it is one of ``ESTIMATES`` (ValueError otherwise)."""
    if estimates not in ESTIMATES:
        raise ValueError(f"estimates must be one of {', '.join(ESTIMATES)} (got {estimates!r})")
    return estimates


def require_predictor(state: ClusterState, estimates: str) -> None:
    """ValueError if ``estimates`` is ``predictor`` and ``state`` carries none."""
    if estimates == "predictor" and state.predictor is None:
        raise ValueError("estimates: predictor needs a remaining-work predictor on the "
                         "cluster state (none was configured)")


def predicted_remaining_s(state: ClusterState, a: Action) -> float:
    """Remaining work of ``a``'s trajectory, ``a`` included: the learned predictor's
    median remaining time less its median duration of ``a`` (what follows ``a``), plus
    ``a``'s own estimate at its maximum cores (the action's estimate, as every
    heuristic reads it); ``a``'s estimate alone for an action of no trajectory."""
    p = state.predictor
    if p is None:
        raise ValueError("estimates: predictor needs a remaining-work predictor on the "
                         "cluster state (none was configured)")
    s = a.spec
    own = s.est_s / s.speedup(s.max_cores)
    if a.traj is None:
        return own
    rest = p.remaining_of(a.traj, s.name).p50 - p.duration(a.traj.id, s.name)
    return own + (rest if rest > 0.0 else 0.0)


__all__ = ["ESTIMATES", "check_estimates", "predicted_remaining_s", "require_predictor"]
