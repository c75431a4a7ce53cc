"""numpy arrays as Arrow arrays without loading ``numpy.ma`` (a start-up cost of ``drifttool diff``).

    >>> t.take(arrow_array(rows))            # rows: a numpy integer array
    >>> t.filter(arrow_array(keep))          # keep: a numpy bool array

``pa.array(ndarray)`` (and ``Table.take``/``filter`` given an ndarray) checks whether its argument is
a ``numpy.ma.MaskedArray``, which imports ``numpy.ma`` on first use: 20–90 ms of a command that
otherwise runs in a few hundred (docs/benchmarks.md, "CLI start-up"). ``arrow_array`` wraps the
array's bytes instead (``pa.Array.from_buffers``; no null bitmap), bit-packing a bool array as
Arrow stores booleans. The values are the same as ``pa.array``'s.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

_TYPES = {np.dtype(np.int64): pa.int64(), np.dtype(np.int32): pa.int32(),
          np.dtype(np.uint64): pa.uint64(), np.dtype(np.float64): pa.float64(),
          np.dtype(np.float32): pa.float32()}


def arrow_array(values: np.ndarray) -> pa.Array:
    """The 1-D numpy array ``values`` (bool, int32/64, uint64, float32/64) as an Arrow array of
    the same type and values, no nulls.

    Raises:
        TypeError: another dtype, or not one-dimensional.
    """
    values = np.asarray(values)
    if values.ndim != 1:
        raise TypeError(f"arrow_array takes a 1-D array, got shape {values.shape}")
    n = len(values)
    if values.dtype == np.bool_:
        bits = np.packbits(values, bitorder="little")
        return pa.Array.from_buffers(pa.bool_(), n, [None, pa.py_buffer(bits)])
    kind = _TYPES.get(values.dtype)
    if kind is None:
        raise TypeError(f"arrow_array: unsupported dtype {values.dtype}")
    return pa.Array.from_buffers(kind, n, [None, pa.py_buffer(np.ascontiguousarray(values))])
