"""Errors raised for user input (configs, traces, overrides, requests), and the one
formatter that turns a pydantic validation error into such a line."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


class ConfigError(ValueError):
    """A user-supplied setting is invalid.

    The message is one line that names the offending field, e.g.
    ``workload.tasks[0].actions[1].duration_s.median: must be > 0 (got -1)``.
    Command-line apps print it without a traceback and exit with status 2.
    """

    def __init__(self, field: str, problem: str) -> None:
        # One line, whatever the names in it contain.
        self.field = str(field).replace("\r", "\\r").replace("\n", "\\n")
        self.problem = str(problem).replace("\r", "\\r").replace("\n", "\\n")
        # No field: raised inside a validator, whose caller names it (validation_error).
        super().__init__(f"{self.field}: {self.problem}" if self.field else self.problem)

    def __reduce__(self):
        # Rebuilt from both parts, so it crosses process boundaries (evaluation workers).
        return type(self), (self.field, self.problem)


def short(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters (keeps error messages short)."""
    try:
        r = repr(value)
    except (ValueError, RecursionError):  # e.g. an int too long for its decimal repr
        r = f"<{type(value).__name__}>"
    return r if len(r) <= limit else r[: limit - 3] + "..."


def nearest(name: str, known: Iterable[str]) -> str | None:
    """The known name closest to ``name`` (a likely typo of it: ``n_seed`` -> ``n_seeds``),
    or None when none is close; names compare case-insensitively."""
    import difflib

    by_lower = {str(k).lower(): str(k) for k in known}
    match = difflib.get_close_matches(str(name).lower(), list(by_lower), n=1, cutoff=0.6)
    return by_lower[match[0]] if match else None


def one_of(value: Any, choices: Iterable[Any], field: object, *, what: str = "",
           null: bool = False) -> Any:
    """``value`` if it is one of ``choices`` (or None, if ``null``), else a ConfigError
    naming ``field``: ``must be one of a, b, c (got 'x')``. The check for settings that
    are not pydantic models; a model's ``Literal`` field gets the same message from
    :func:`validation_error`.

    Args:
        value: the value given.
        choices: the allowed values.
        field: its name (anything whose ``str`` is the name, e.g. a trace's locator).
        what: what the choices are, in the message (``"the schedulers"``).
        null: None is allowed too.
    """
    choices = tuple(choices)
    try:
        ok = value in choices or (null and value is None)
    except TypeError:  # an unhashable value, against a set or a dict's keys
        ok = False
    if not ok:
        names = ", ".join(str(c) for c in choices) + (" or null" if null else "")
        raise ConfigError(str(field), f"must be one of {what + ' ' if what else ''}{names} "
                          f"(got {short(value)})")
    return value


def _choices(expected: str) -> str:
    """pydantic's ``'a', 'b' or 'c'`` as :func:`one_of` writes it: ``a, b, c``."""
    return re.sub(r"'([^']*)'", r"\1", expected.replace(" or ", ", "))


def _bound(x: Any) -> str:
    if isinstance(x, float):
        return str(int(x)) if x.is_integer() and abs(x) < 1e15 else f"{x:g}"
    return str(x)


# pydantic's error types, in the words of the project's other messages. Each takes the
# error's ``ctx`` (its bounds, its choices).
_MESSAGES: dict[str, Any] = {
    "missing": lambda c: "is required",
    "model_type": lambda c: "must be a JSON object",
    "model_attributes_type": lambda c: "must be a JSON object",
    "dict_type": lambda c: "must be a JSON object",
    "literal_error": lambda c: f"must be one of {_choices(c['expected'])}",
    "enum": lambda c: f"must be one of {_choices(c['expected'])}",
    "string_type": lambda c: "must be a string",
    "string_too_short": lambda c: ("must not be empty" if c["min_length"] == 1 else
                                   f"must have at least {c['min_length']} characters"),
    "string_too_long": lambda c: f"must have at most {c['max_length']} characters",
    "int_type": lambda c: "must be a whole number",
    "int_parsing": lambda c: "must be a whole number",
    "int_from_float": lambda c: "must be a whole number",
    "float_type": lambda c: "must be a number",
    "float_parsing": lambda c: "must be a number",
    "finite_number": lambda c: "must be a finite number",
    "bool_type": lambda c: "must be true or false",
    "bool_parsing": lambda c: "must be true or false",
    "greater_than": lambda c: f"must be > {_bound(c['gt'])}",
    "greater_than_equal": lambda c: f"must be >= {_bound(c['ge'])}",
    "less_than": lambda c: f"must be < {_bound(c['lt'])}",
    "less_than_equal": lambda c: f"must be <= {_bound(c['le'])}",
    "list_type": lambda c: "must be a list",
    "tuple_type": lambda c: "must be a list",
    "too_short": lambda c: f"must have at least {c['min_length']} item(s)",
    "too_long": lambda c: f"must have at most {c['max_length']} item(s)",
    "json_invalid": lambda c: f"not valid JSON ({c.get('error', 'invalid')})",
    "callable_type": lambda c: "must be a callable",
}


def _path(loc: Sequence[Any]) -> str:
    """``("env", "A")`` -> ``env.A``; ``("argv", 1)`` -> ``argv[1]``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part != "[key]":
            out += f".{part}" if out else str(part)
    return out


def _fields_at(model: Any, loc: Sequence[Any]) -> list[str] | None:
    """The field names of the (nested) model at ``loc``, for an unknown field's message."""
    for part in loc:
        fields = getattr(model, "model_fields", None)
        if fields is None or part not in fields:
            return None
        ann = fields[part].annotation
        model = next((a for a in (ann, *getattr(ann, "__args__", ()))
                      if hasattr(a, "model_fields")), None)
    fields = getattr(model, "model_fields", None)
    return None if fields is None else sorted(
        f.alias or n for n, f in fields.items() if not f.exclude)


def validation_error(errors: Sequence[Mapping[str, Any]], loc: str = "", *,
                     model: Any = None, strip: Sequence[str] = (),
                     at: Sequence[str] = (), root: str = "request") -> ConfigError:
    """The first of a pydantic validation error's ``errors()`` as one line naming its
    field: ``<loc>: <field path>: <problem> (got <value>)``.

    Args:
        errors: ``ValidationError.errors()`` (or FastAPI's ``RequestValidationError``).
        loc: where the value came from (``jobs.jsonl:3``); none if empty.
        model: the model validated: an unknown field's message lists its fields.
        strip: leading location parts to leave out (FastAPI's ``body``).
        at: location parts to put before the error's own (``("http",)``: the model
            validated is the ``http`` field of a request).
        root: the name of the whole value, for an error that is about all of it.

    A validator that raises a :class:`ConfigError` names its own field (relative to
    where it ran): cross-field rules say which field is wrong.
    """
    if not errors:
        return ConfigError(loc or root, "invalid")
    e = errors[0]
    parts = list(e.get("loc", ()))
    while parts and strip and parts[0] in strip:
        parts.pop(0)
    if e.get("type") == "json_invalid":
        parts = []  # its location is a character offset
    key = bool(parts) and parts[-1] == "[key]"
    if key:  # a mapping's key: named as the mapping
        parts = parts[:-2]
    unknown = e.get("type") == "extra_forbidden"
    known = _fields_at(model, parts[:-1]) if unknown and model is not None else None
    parts = [*at, *parts]
    ctx = e.get("ctx") or {}
    kind = e.get("type", "")
    cause = ctx.get("error")
    if kind in ("value_error", "assertion_error") and isinstance(cause, ConfigError):
        where = _path([*parts, cause.field] if cause.field else parts)
        field = f"{loc}: {where}" if loc and where else loc or where or root
        return ConfigError(field, cause.problem)
    if kind in ("value_error", "assertion_error") and cause is not None:
        problem = str(cause)
    elif unknown:
        near = nearest(str(parts[-1]), known) if known and parts else None
        problem = "unknown field" + (f", did you mean {near}?" if near else "") \
            + (f" (expected one of: {', '.join(known)})" if known else "")
    elif kind in _MESSAGES:
        try:
            problem = _MESSAGES[kind](ctx)
        except KeyError:
            problem = str(e.get("msg", "invalid"))
    else:
        problem = str(e.get("msg", "invalid"))
    if kind not in ("missing", "extra_forbidden", "json_invalid") and "input" in e:
        problem += f" (got {short(e['input'])})"
    if key and kind != "value_error":
        problem = f"bad key: {problem}"
    where = _path(parts)
    field = f"{loc}: {where}" if loc and where else loc or where or root
    return ConfigError(field, problem)


__all__ = ["ConfigError", "nearest", "one_of", "short", "validation_error"]
