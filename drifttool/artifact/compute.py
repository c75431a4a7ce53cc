"""Arrow compute functions without importing ``pyarrow.compute`` (a start-up cost of ``drifttool diff``).

    >>> from drifttool.artifact import compute as ac
    >>> ac.filter(table, ac.call("greater_equal", table["step"], 0))
    >>> ac.is_in(table["role"], ["output", "internal"])

``import pyarrow.compute`` builds a Python wrapper with a docstring for every one of Arrow's
~290 compute functions: 40–200 ms of a command that otherwise runs in a few hundred
(docs/benchmarks.md, "CLI start-up"). pyarrow's own methods that compute (``Table.filter``,
``take``, ``Array.unique``, ``dictionary_encode``, ``is_null``, ``cast``) import it on first
use. The functions here call the same Arrow kernels through ``call_function`` of pyarrow's
extension module ``pyarrow._compute`` (which ``pyarrow.compute`` wraps; the fallback is
``pyarrow.compute`` itself where a pyarrow lacks it), so the results are those of the methods.
``tests/cli/test_import_cost.py`` keeps ``pyarrow.compute`` out of ``diff`` and ``trace``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa

try:
    from pyarrow._compute import CastOptions, SetLookupOptions, call_function
except ImportError:  # pragma: no cover - a pyarrow without the extension module's names
    from pyarrow.compute import CastOptions, SetLookupOptions, call_function


def call(name: str, *args: Any, options: Any = None) -> Any:
    """Arrow's compute function ``name`` (``"equal"``, ``"invert"``, ``"and"``, ``"sum"``, …) on
    ``args`` (arrays, chunked arrays, tables, scalars or Python values), as
    ``pyarrow.compute.<name>`` would call it."""
    return call_function(name, list(args), options)


def filter(data: Any, mask: Any) -> Any:  # noqa: A001 - Arrow's name
    """``data.filter(mask)``: the rows of a table, record batch or array where ``mask`` is true
    (null mask entries drop the row)."""
    return call_function("filter", [data, mask])


def take(data: Any, indices: Any) -> Any:
    """``data.take(indices)``: the rows at ``indices`` (an Arrow integer array), in that order."""
    return call_function("take", [data, indices])


def unique(values: Any) -> Any:
    """``values.unique()``: the distinct values in order of first appearance."""
    return call_function("unique", [values])


def dictionary_encode(values: Any) -> Any:
    """``values.dictionary_encode()``: indices into the distinct values (order of first
    appearance); nulls stay null."""
    return call_function("dictionary_encode", [values])


def is_null(values: Any) -> Any:
    """``values.is_null()``: a boolean array, true where ``values`` is null."""
    return call_function("is_null", [values])


def is_in(values: Any, value_set: Sequence[Any] | pa.Array) -> Any:
    """``pyarrow.compute.is_in(values, value_set)``: true where a value is one of ``value_set``
    (nulls are never in the set)."""
    return call_function("is_in", [values], SetLookupOptions(pa.array(value_set)))


def cast(values: Any, target: pa.DataType) -> Any:
    """``values.cast(target)``, the safe cast (an overflow or truncation raises)."""
    return call_function("cast", [values], CastOptions.safe(target))
