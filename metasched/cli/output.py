"""What the apps write: ``results.json`` (standard JSON, non-finite numbers as null) and
``results.md``; any file written whole or not at all (:func:`write_atomic`)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_report(out: Path, doc: dict[str, Any], table: str) -> None:
    """Write ``results.json`` and ``results.md`` into ``out`` and print the table."""
    (out / "results.json").write_text(json.dumps(json_safe(doc), indent=2, default=repr) + "\n")
    (out / "results.md").write_text(table)
    print(table)
    print(f"results written to {out}")


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: a reader (or a run stopped
    mid-write) sees the old file or the new one, never part of one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def json_safe(x: Any) -> Any:
    """``x`` with non-finite floats as None, so the JSON written is standard."""
    if isinstance(x, float):
        return x if x == x and abs(x) != float("inf") else None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x
