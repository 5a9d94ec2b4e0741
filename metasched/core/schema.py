"""The schema layer's building blocks: field types shared by every pydantic schema
(configs, profiles, requests), the one model of an action's resource demand
(:class:`Demand`) and :func:`parse`, which validates a value against a schema and turns
a failure into the project's one-line :class:`~metasched.errors.ConfigError` naming the
field (``workload.tasks.code.actions.shell.timeout_s: must be > 0 (got 0)``).

Numbers, strings and booleans are strict: ``"2"`` is not 2 and ``true`` is not 1; a
whole float (``2.0``, JSON's one number type) is a whole number. Validation runs where a
config or a request is read, never per simulated action.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Annotated, Any, ClassVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from metasched.errors import ConfigError, validation_error

# ---------------------------------------------------------------- field types


def _whole(value: Any) -> Any:
    """A float that is a whole number as that int (JSON has one number type: ``2.0``
    is 2 cores); anything else as it is, for the strict int check."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


@cache
def Count(lo: int, hi: int | None = None) -> Any:  # noqa: N802 - a type, named as one
    """A whole number in ``[lo, hi]`` (JSON's ``2.0`` included; ``true`` and ``"2"``
    not). The same bounds give the same type (a cached validator)."""
    return Annotated[int, BeforeValidator(_whole), Field(strict=True, ge=lo, le=hi)]


@cache
def Number(*, gt: float | None = None, ge: float | None = None,  # noqa: N802 - a type
           le: float | None = None) -> Any:
    """A finite number (an int is taken as a float) within the bounds given."""
    return Annotated[float, Field(strict=True, allow_inf_nan=False, gt=gt, ge=ge,
                                  le=None if le == math.inf else le)]


Text = Annotated[str, Field(strict=True, min_length=1)]
"""A non-empty string."""
MAX_KEY = 256
Key = Annotated[str, Field(strict=True, min_length=1, max_length=MAX_KEY)]
"""A name the core keeps per action or trajectory (an id, a task, a prompt): non-empty,
at most 256 characters, so that no request can make the scheduler's state grow by its
own size."""
Flag = Annotated[bool, Field(strict=True)]
"""``true`` or ``false`` (not 1, not ``"yes"``)."""
Fraction = Number(ge=0.0, le=1.0)
"""A number in [0, 1]."""


class Strict(BaseModel):
    """A schema: frozen, and an unknown field is an error naming it."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class Checked(Strict):
    """A schema also built in Python (``SandboxConfig(cpus=2)``): a bad value raises the
    same one-line :class:`ConfigError` as from a config file or JSON, naming the field.

    Subclasses say where their fields sit: ``one_line_at`` is the path put before each
    field (``("sandbox",)``: ``sandbox.cpus: ...``) and ``one_line_root`` names an error
    about the whole value. Validation from data (:meth:`model_validate`, :func:`parse`)
    does not go through ``__init__``; :func:`parse` formats its errors itself.
    """

    one_line_at: ClassVar[tuple[str, ...]] = ()
    one_line_root: ClassVar[str] = "request"

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            cls = type(self)
            raise validation_error(e.errors(), model=cls, at=cls.one_line_at,
                                   root=cls.one_line_root) from None

    # model_validate passes a context, which __init__ cannot: it bypasses __init__.
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]


# ---------------------------------------------------------------- resource demand


class Demand(Strict):
    """What one action asks of the resource pools, beside its duration: the cpu cores it
    can use and how it speeds up on them, the gpu service it calls or the api endpoint.

    The one declaration of these fields: a workload's action type
    (:class:`~metasched.sim.workload_config.ActionType`) and a dispatcher request
    (:class:`~metasched.runtime.requests.Request`) are demands, and a simulated action
    (:class:`~metasched.core.actions.ActionSpec`) carries one's values (``spec.demand``).

    Attributes:
        min_cores, max_cores: the cpu core range the action can use.
        parallel_fraction: Amdahl parallel fraction p; speedup(k) = 1 / ((1-p) + p/k).
        service: the gpu service (reward model) it calls.
        endpoint: the api endpoint it calls.
    """

    min_cores: Count(1) = 1
    max_cores: Count(1) = 1
    parallel_fraction: Fraction = 0.0
    service: Text | None = None
    endpoint: Text | None = None

    @model_validator(mode="after")
    def _core_range(self) -> Demand:
        if self.max_cores < self.min_cores:
            raise ConfigError("max_cores", f"must be >= {self.min_cores} (min_cores; got "
                              f"{self.max_cores})")
        return self


DEMAND_FIELDS = tuple(Demand.model_fields)
"""The names of :class:`Demand`'s fields, in order."""


# ---------------------------------------------------------------- validation

_ADAPTERS: dict[Any, TypeAdapter] = {}


def valid(schema: Any, value: Any) -> bool:
    """Whether ``value`` passes ``schema`` (for a setting whose message is its own)."""
    try:
        _adapter(schema).validate_python(value)
    except ValidationError:
        return False
    return True


def _adapter(schema: Any) -> TypeAdapter:
    adapter = _ADAPTERS.get(schema)
    if adapter is None:
        adapter = _ADAPTERS[schema] = TypeAdapter(schema)
    return adapter


def parse(schema: Any, value: Any, field: str = "", *, context: Any = None) -> Any:
    """``value`` validated against ``schema`` (a pydantic model or any type pydantic
    knows), or a one-line :class:`ConfigError` naming ``field`` and the path within it.

    Inside a validator, ``field`` is left empty: the error is re-raised relative to the
    field being validated, and the outer :func:`parse` names it in full.
    """
    try:
        if isinstance(schema, type) and issubclass(schema, BaseModel):
            return schema.model_validate(value, context=context)
        return _adapter(schema).validate_python(value, context=context)
    except ValidationError as e:
        err = validation_error(e.errors(), model=schema, root="")
        raise ConfigError(join(field, err.field), err.problem) from None


def join(field: str, sub: str) -> str:
    """``field`` and a path within it: ``a.b`` + ``c[0]`` -> ``a.b.c[0]``."""
    if not field or not sub:
        return field or sub
    return f"{field}{'' if sub.startswith('[') else '.'}{sub}"


__all__ = ["DEMAND_FIELDS", "Checked", "Count", "Demand", "Flag", "Fraction", "Number", "Strict",
           "Text", "join", "parse", "valid"]
