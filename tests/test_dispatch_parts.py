"""The dispatcher's parts own their state: no module of ``runtime/dispatch/`` reads or
writes another object's private attribute (a name with one leading underscore on
anything but ``self`` or ``cls``); each part asks for what it needs of the dispatcher
through its own protocol, and the dispatcher provides every one."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import Protocol, get_type_hints

import pytest

from metasched.runtime.dispatch.dispatcher import Dispatcher

DISPATCH = Path(__file__).resolve().parents[1] / "metasched" / "runtime" / "dispatch"
MODULES = sorted(p.relative_to(DISPATCH).as_posix() for p in DISPATCH.rglob("*.py"))


def private_reads(source: str) -> list[str]:
    """``obj._name`` in ``source`` where ``obj`` is not ``self`` or ``cls`` (dunders
    aside), as "line: expression"."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("module", MODULES)
def test_no_part_reads_another_objects_private_attributes(module):
    assert private_reads((DISPATCH / module).read_text()) == []


@pytest.mark.parametrize("source,expected", [
    ("def f(d):\n    return d._jobs\n", ["2: d._jobs"]),
    ("class A:\n    def f(self):\n        self.d._loop.call_soon(self._x)\n",
     ["3: self.d._loop"]),
    ("def f(d):\n    d.gate._open(1)\n", ["2: d.gate._open"]),
    ("class A:\n    def f(self):\n        return self._x, type(self).__name__\n", []),
])
def test_a_private_read_is_seen(source, expected):
    assert private_reads(source) == expected


HOSTS = [
    ("admission", "AdmissionHost"), ("cancellation", "CancelHost"),
    ("completion", "CompletionHost"), ("journal_writer", "WriterHost"),
    ("kernels", "KernelHost"), ("policy", "PolicyHost"), ("sandbox_gate", "GateHost"),
    ("sharing", "SharingHost"), ("status", "StatusHost"), ("trajectories", "TrajectoryHost"),
    ("executors.base", "ExecutorHost"), ("executors.local", "LocalExecutorHost"),
    ("executors.nodes", "NodeExecutorHost"),
]


@pytest.mark.parametrize("module,name", HOSTS, ids=[h[1] for h in HOSTS])
def test_the_dispatcher_provides_what_each_part_asks(module, name):
    host = getattr(importlib.import_module(f"metasched.runtime.dispatch.{module}"), name)
    assert issubclass(host, Protocol) and host._is_protocol
    asked = set(get_type_hints(host)) | {
        n for n, v in vars(host).items() if callable(v) and not n.startswith("_")}
    for base in host.__mro__[1:]:
        if getattr(base, "_is_protocol", False) and base is not Protocol:
            asked |= set(get_type_hints(base))
    # what the dispatcher sets in __init__ (attributes) or defines (methods)
    init = ast.unparse(ast.parse((DISPATCH / "dispatcher.py").read_text()))
    given = {n for n in asked if hasattr(Dispatcher, n) or f"self.{n} =" in init
             or f"self.{n}:" in init or f"self.{n}," in init}
    assert given == asked, sorted(asked - given)
