"""JSON-ready data for every ``--json`` output: numbers stay numbers, enums become their values.

    >>> plain({"max_abs": float("nan"), "maxabs": (0.5, float("inf")), "kind": Verdict.DRIFT})
    {'max_abs': None, 'max_abs_nonfinite': 'nan', 'maxabs': [0.5, None],
     'maxabs_nonfinite': [None, 'inf'], 'kind': 'drift'}

Strict JSON has no NaN or infinity: a non-finite float becomes ``null`` and a sibling key
``<key>_nonfinite`` says which (``"nan"``, ``"inf"``, ``"-inf"``); in a list, the sibling is a
list of the same length with ``null`` at the finite entries. Every document carries
``schema_version``.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any

SCHEMA_VERSION = 1
"""Version of every ``--json`` document's shape (``tests/cli/test_json_shapes.py`` pins it)."""

NONFINITE_SUFFIX = "_nonfinite"


def _word(x: float) -> str:
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def _is_nonfinite(x: Any) -> bool:
    return isinstance(x, float) and not math.isfinite(x)


def _scalar(x: Any) -> Any:
    """A numpy scalar as its Python value; anything else as it is."""
    return x.item() if getattr(x, "ndim", None) == 0 and hasattr(x, "item") else x


def _nonfinite(v: Any) -> Any:
    """What ``<key>_nonfinite`` holds for the value ``v``, or None when it needs none."""
    if _is_nonfinite(v):
        return _word(v)
    if isinstance(v, (list, tuple)) and any(_is_nonfinite(_scalar(e)) for e in v):
        return [_word(_scalar(e)) if _is_nonfinite(_scalar(e)) else None for e in v]
    return None


def plain(x: Any) -> Any:
    """``x`` (dicts, lists, tuples, dataclasses, enums, numpy scalars) as strict-JSON-ready data
    (module docstring)."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return plain({f.name: getattr(x, f.name) for f in dataclasses.fields(x)})
    if isinstance(x, enum.Enum):
        return plain(x.value)
    x = _scalar(x)
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        out: dict[str, Any] = {}
        for k, v in x.items():
            v = _scalar(v)
            out[str(k)] = plain(v)
            marks = _nonfinite(v)
            if marks is not None:
                out[f"{k}{NONFINITE_SUFFIX}"] = marks
        return out
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    return x


def document(command: str, data: dict[str, Any]) -> dict[str, Any]:
    """One ``--json`` document: ``{"schema_version", "command", **data}``, ``plain``."""
    return {"schema_version": SCHEMA_VERSION, "command": command, **plain(data)}
