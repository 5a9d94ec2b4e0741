"""The distributions of a workload profile: :class:`Dist`, a log-normal given by its
median and upper quantiles (with a two-slope tail, clipping and a point mass at 0), and
the forms a profile writes one in (:func:`parse_dist`; the field types
:data:`PositiveDist` and :data:`AnyDist` for schemas)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import PlainValidator, model_validator

from metasched.core.schema import Number, Strict, join, parse
from metasched.errors import ConfigError, short

Z90, Z99 = 1.2815515655446004, 2.3263478740408408  # standard normal quantiles


@dataclass(frozen=True, slots=True)
class Dist:
    """A log-normal distribution given by its median and one upper quantile, clipped
    to [lo, hi]. With no quantile it is the constant ``median``.

    Given both a p90 and a p99, the tail above the p90 gets its own log-scale slope
    (``tail_sigma``): the quantile function is log-linear in the standard normal score
    with a kink at the p90, so the median, p90 and p99 all hold exactly. Measured action
    times have tails far heavier than one log-normal through the median and p90 allows
    (test runs: p90 2.6x the median, p99 155x).

    ``zero`` is a point mass at 0 (before clipping): the fraction of draws that are 0,
    the rest from the log-normal, whose median and quantiles are then those of the
    non-zero draws. Generation gaps have one: an agent's calls made together (a test
    run's programs at once, parallel tool calls) follow each other with no gap.
    """

    median: float
    sigma: float = 0.0
    lo: float = 0.0
    hi: float = math.inf
    tail_sigma: float | None = None  # log-scale slope above the p90 (None: ``sigma``)
    zero: float = 0.0  # the fraction of draws that are 0

    def sample(self, rng, size: int | None = None):
        """Draw from the distribution with ``rng`` (a numpy Generator)."""
        import numpy as np

        if self.sigma == 0.0 and self.tail_sigma is None:
            x = np.full(size, self.median) if size is not None else self.median
        else:
            x = self._unclipped(rng.standard_normal(size))
        if self.zero > 0.0:  # drawn only then: profiles without one keep their streams
            x = np.where(rng.random(size) < self.zero, 0.0, x)
            x = x if size is not None else float(x)
        return np.clip(x, self.lo, self.hi) if size is not None else min(max(x, self.lo), self.hi)

    def _unclipped(self, z):
        """The value at standard normal score ``z``, before clipping."""
        import numpy as np

        logx = self.sigma * z
        if self.tail_sigma is not None:
            logx = logx + (self.tail_sigma - self.sigma) * np.maximum(z - Z90, 0.0)
        return self.median * np.exp(logx)

    def quantile(self, p):
        """The ``p`` quantile(s) (``p`` a number or an array in (0, 1))."""
        import numpy as np
        from scipy.stats import norm

        p = np.asarray(p, float)
        if self.zero > 0.0:  # the mass at 0 takes the lowest quantiles
            body = (p - self.zero) / (1.0 - self.zero)
            x = np.where(p <= self.zero, 0.0,
                         self._unclipped(norm.ppf(np.clip(body, 1e-12, 1.0 - 1e-12))))
            return np.clip(x, self.lo, self.hi)
        return np.clip(self._unclipped(norm.ppf(p)), self.lo, self.hi)


class _DistForm(Strict):
    """A distribution as a profile gives it: ``{median, p90, p99, min, max}`` (p90, p99
    or both), and where values may be 0, ``zero``: the fraction of draws that are 0."""

    median: Number(ge=0.0)
    p90: Number(ge=0.0) | None = None
    p99: Number(ge=0.0) | None = None
    min: Number(ge=0.0) = 0.0
    max: Number(ge=0.0) | None = None
    zero: Number(ge=0.0, le=1.0) = 0.0

    @model_validator(mode="after")
    def _ordered(self) -> _DistForm:
        for q, lo, what in (("p90", self.median, "median"),
                            ("p99", self.median if self.p90 is None else self.p90,
                             "median" if self.p90 is None else "p90")):
            v = getattr(self, q)
            if v is not None and v < lo:
                raise ConfigError(q, f"must be >= {lo:g} ({what}; got {v:g})")
        if self.max is not None and self.max < self.min:
            raise ConfigError("max", f"must be >= {self.min:g} (min; got {self.max:g})")
        hi = math.inf if self.max is None else self.max
        if not self.min <= self.median <= hi:
            raise ConfigError("", f"median {self.median:g} must lie within [min, max] = "
                              f"[{self.min:g}, {hi:g}]")
        if self.zero == 1.0:
            raise ConfigError("zero", "must be < 1 (a distribution of zeros: give 0)")
        return self

    def dist(self) -> Dist:
        median, sigma, tail_sigma = self.median, 0.0, None
        if self.p90 is not None and self.p99 is not None:  # a body, its own tail
            if median > 0:
                sigma = math.log(self.p90 / median) / Z90
                tail_sigma = math.log(self.p99 / self.p90) / (Z99 - Z90)
        else:
            for v, z in ((self.p90, Z90), (self.p99, Z99)):
                if v is not None:
                    sigma = math.log(v / median) / z if median > 0 else 0.0
        return Dist(median, sigma, self.min, math.inf if self.max is None else self.max,
                    tail_sigma, self.zero)


class _PositiveDistForm(_DistForm):
    """A distribution of durations: no point mass at 0, a median > 0."""

    median: Number(gt=0.0)

    @model_validator(mode="before")
    @classmethod
    def _no_zero(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and "zero" in data:
            raise ConfigError("zero", "unknown field (durations are never 0)")
        return data


def _dist(d: Any, positive: bool) -> Dist:
    """A :class:`Dist` from a profile's mapping or a plain number (a constant)."""
    if isinstance(d, (int, float)) and not isinstance(d, bool):
        v = parse(Number(gt=0.0) if positive else Number(ge=0.0), d)
        return Dist(v, 0.0, v, v)
    if not isinstance(d, Mapping):
        raise ConfigError("", f"must be a number or a mapping with median/p90/p99 "
                          f"(got {short(d)})")
    return parse(_PositiveDistForm if positive else _DistForm, d).dist()


def parse_dist(d: Any, path: str, *, positive: bool = True) -> Dist:
    """``{median: m, p90: q, p99: q, min: lo, max: hi}`` (p90, p99 or both) or a plain
    number (a constant); where values may be 0 (``positive`` false), also ``zero: f``,
    the fraction of draws that are 0 (the quantiles are then those of the others)."""
    try:
        return _dist(d, positive)
    except ConfigError as e:
        raise ConfigError(join(path, e.field), e.problem) from None


PositiveDist = Annotated[Dist, PlainValidator(lambda v: _dist(v, True))]
"""A duration's distribution (a :class:`Dist` from a profile's form)."""
AnyDist = Annotated[Dist, PlainValidator(lambda v: _dist(v, False))]
"""A distribution whose draws may be 0 (turns, generation gaps, tokens)."""


__all__ = ["Z90", "Z99", "AnyDist", "Dist", "PositiveDist", "parse_dist"]
