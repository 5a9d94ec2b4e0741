"""What one request gets when it does not say, and the most it may ask
(:class:`RequestLimits`, the ``limits:`` settings group).

Every front door (the Python API, job files, ``POST /v1/actions``, ``/run_code``'s
steps) goes through the dispatcher, which applies them to each request it accepts:

- defaults: a command (a cpu request) without ``mem_limit_mb`` gets ``mem_mb``; a
  request without ``timeout_s`` gets ``timeout_s``.
- caps: a request asking more than ``max_cores`` cores, ``max_mem_mb`` of memory,
  ``max_timeout_s`` of wall time, ``max_cpu_time_s`` of CPU time, a ``max_workspace_mb``
  workspace or ``max_pids`` processes is rejected, with one line naming the field and the
  setting, e.g. ``mem_limit_mb: 65536 MiB asked; a request may ask at most 16384
  (limits.max_mem_mb)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import model_validator

from metasched.core.schema import Checked, Count, Number, parse
from metasched.errors import ConfigError

__all__ = ["RequestLimits"]

_DAY = 24 * 3600.0


class RequestLimits(Checked):
    """Defaults and caps of one request (see the module docstring).

    Attributes:
        mem_mb: memory (MiB) of a command whose request gives no ``mem_limit_mb``
            (``/run_code``: no ``memory_limit_MB``, or -1).
        timeout_s: wall time of a request that gives no ``timeout_s`` (``/run_code``:
            its ``compile_timeout`` and ``run_timeout`` when not given; 10 s, as
            SandboxFusion's).
        max_cores: the most cores one request may ask (``min_cores``, ``max_cores``);
            None: a node's.
        max_mem_mb: the most ``mem_limit_mb`` one request may ask.
        max_timeout_s: the most ``timeout_s``.
        max_cpu_time_s: the most ``cpu_time_s``.
        max_workspace_mb: the largest ``workspace_mb``.
        max_pids: the most ``pids_max``.
    """

    mem_mb: Number(ge=1.0, le=2.0**40) = 2048.0
    timeout_s: Number(gt=0.0, le=30 * _DAY) = 10.0
    max_cores: Count(1) | None = None
    max_mem_mb: Number(ge=1.0, le=2.0**40) = 16384.0
    max_timeout_s: Number(gt=0.0, le=30 * _DAY) = _DAY
    max_cpu_time_s: Number(gt=0.0, le=30 * _DAY) = _DAY
    max_workspace_mb: Number(ge=1.0, le=2.0**40) = 8192.0
    max_pids: Count(1, 4_194_304) = 16384

    one_line_at = ("limits",)

    @model_validator(mode="after")
    def _defaults_within_caps(self) -> RequestLimits:
        if self.mem_mb > self.max_mem_mb:
            raise ConfigError("mem_mb", f"must be <= limits.max_mem_mb "
                              f"({self.max_mem_mb:g}; got {self.mem_mb:g})")
        if self.timeout_s > self.max_timeout_s:
            raise ConfigError("timeout_s", f"must be <= limits.max_timeout_s "
                              f"({self.max_timeout_s:g}; got {self.timeout_s:g})")
        return self

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> RequestLimits:
        """From the ``limits:`` settings group (unknown keys are an error; null: the
        default, but for ``max_cores``, whose null is "a node's")."""
        if isinstance(d, Mapping):
            d = {k: v for k, v in d.items() if v is not None or k == "max_cores"}
        return parse(cls, {} if d is None else d, "limits")

    def to_dict(self) -> dict[str, Any]:
        """The settings, as ``GET /v1/status`` shows them (``from_dict`` reads them)."""
        return self.model_dump()

    def cap(self, value: float | None, name: str, setting: str, unit: str = "") -> None:
        """Refuse ``value`` of request field ``name`` above setting ``setting``."""
        most = getattr(self, setting)
        if value is not None and most is not None and value > most:
            raise ConfigError(name, f"{value:g}{unit} asked; a request may ask at most "
                              f"{most:g} (limits.{setting})")

    def check(self, fields_: Mapping[str, Any]) -> None:
        """Refuse a request (its JSON form, or any mapping of its fields) that asks more
        than the caps, with one line naming the field.

        Raises:
            ConfigError: the first field over its cap.
        """
        g = fields_.get
        self.cap(g("min_cores"), "min_cores", "max_cores", " cores")
        self.cap(g("max_cores"), "max_cores", "max_cores", " cores")
        self.cap(g("mem_limit_mb"), "mem_limit_mb", "max_mem_mb", " MiB")
        self.cap(g("timeout_s"), "timeout_s", "max_timeout_s", " s")
        self.cap(g("cpu_time_s"), "cpu_time_s", "max_cpu_time_s", " s")
        self.cap(g("workspace_mb"), "workspace_mb", "max_workspace_mb", " MB")
        self.cap(g("pids_max"), "pids_max", "max_pids", "")

    def defaults(self, kind: str, given: Mapping[str, Any],
                 ram_mb: float | None = None) -> dict[str, Any]:
        """The fields a request of ``kind`` gets from these defaults (those absent or
        null in ``given``); the default memory is at most ``ram_mb`` (a node's)."""
        out: dict[str, Any] = {}
        if given.get("timeout_s") is None:
            out["timeout_s"] = self.timeout_s
        if kind == "cpu" and given.get("mem_limit_mb") is None:
            out["mem_limit_mb"] = self.mem_mb if ram_mb is None else min(self.mem_mb, ram_mb)
        return out

    def describe(self) -> str:
        """One line: the defaults and the caps."""
        cores = "a node's" if self.max_cores is None else f"{self.max_cores}"
        return (f"default memory {self.mem_mb:g} MiB, wall time {self.timeout_s:g} s; "
                f"a request may ask at most {cores} cores, {self.max_mem_mb:g} MiB, "
                f"{self.max_timeout_s:g} s wall, {self.max_cpu_time_s:g} s CPU, a "
                f"{self.max_workspace_mb:g} MB workspace, {self.max_pids} processes")

