"""Lazily loaded package exports (PEP 562): a package names what it exports and where
each name lives, and a submodule is imported only when one of its names is first used,
so that importing the package stays cheap (no Ray, no NumPy) for a process that needs
one light submodule."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(module_name: str, exports: Mapping[str, str]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of package ``module_name``,
    which exports each name of ``exports`` from the module it maps to::

        __getattr__, __dir__ = lazy_exports(__name__, {"Dispatcher": "pkg.dispatcher"})

    A name is imported from its module on first use and then kept in the package's
    namespace, so later uses are plain attribute reads. An unknown name raises
    ``AttributeError`` as for any module.
    """
    exports = dict(exports)

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[module_name], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[module_name])) | set(exports))

    return __getattr__, __dir__
