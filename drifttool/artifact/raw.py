"""The tensors of a safetensors file as dtype name + numpy array of their bytes, read without torch.

    >>> t = read_raw("runs/a/inputs.safetensors")["noise"]
    >>> t.dtype, t.array.shape, t.array.dtype, hex(t.digest())
    ('float32', (4, 2, 24, 64), dtype('float32'), '0x…')

What the diff needs of the replay inputs (``drifttool.diff.context``) is their identity, not their
values, so it reads them with ``safetensors.deserialize`` (raw little-endian row-major bytes,
the safetensors format) instead of importing torch (seconds of the diff's wall time).
``RawTensor.digest`` is digest v2 (``drifttool.capture.digest``, docs/digest.md) computed with
numpy by ``drifttool.digestcore`` — exact integer arithmetic, so it equals the torch value on any
device: the same tensor digests the same either way.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
from safetensors import SafetensorError, deserialize

from drifttool.digestcore import digest_array
from drifttool.errors import ArtifactError

# safetensors dtype code -> (torch's spelling as stored in artifacts, numpy dtype of the elements
# or, where numpy has none, an unsigned integer of the same width that holds their bits)
_DTYPES = {
    "BOOL": ("bool", np.bool_), "U8": ("uint8", np.uint8), "I8": ("int8", np.int8),
    "I16": ("int16", np.int16), "U16": ("uint16", np.uint16), "I32": ("int32", np.int32),
    "U32": ("uint32", np.uint32), "I64": ("int64", np.int64), "U64": ("uint64", np.uint64),
    "F16": ("float16", np.float16), "F32": ("float32", np.float32), "F64": ("float64", np.float64),
    "C64": ("complex64", np.complex64), "BF16": ("bfloat16", np.uint16),
    "F8_E4M3": ("float8_e4m3fn", np.uint8), "F8_E5M2": ("float8_e5m2", np.uint8),
}


@dataclass(frozen=True)
class RawTensor:
    """One tensor: ``dtype`` in torch's spelling (``"bfloat16"``), ``array`` its elements with
    that shape (bf16 and fp8 as ``uint16``/``uint8`` holding their bits)."""

    dtype: str
    array: np.ndarray

    def nonfinite(self) -> int:
        """Count of NaN/±inf elements (0 for integers and bool); bf16 and fp8 by their bits."""
        bits = {"bfloat16": (0x7F80, 0x7F80), "float8_e5m2": (0x7C, 0x7C),
                "float8_e4m3fn": (0x7F, 0x7F)}.get(self.dtype)  # (mask, all-ones pattern)
        if bits is not None:  # e4m3fn has no inf: only S.1111.111 is NaN
            return int(np.count_nonzero((self.array & bits[0]) == bits[1]))
        if np.issubdtype(self.array.dtype, np.inexact):
            return int(np.count_nonzero(~np.isfinite(self.array)))
        return 0

    def digest(self, row_axis: int | None = None) -> int:
        """Digest v2 ``V`` (rows along ``row_axis``, or one row): equal to
        ``drifttool.capture.digest.digest`` of the same tensor.

        Raises:
            UnsupportedConfigError: a dtype without a digest code.
        """
        return digest_array(self.array, self.dtype, row_axis)[0]


def read_raw(path: str | os.PathLike) -> dict[str, RawTensor]:
    """Every tensor of the safetensors file at ``path``, by name.

    Raises:
        ArtifactError: unreadable or corrupt file, or a dtype this reader does not know.
    """
    try:
        with open(path, "rb") as f:
            entries = deserialize(f.read())
        out = {}
        for name, e in entries:
            if e["dtype"] not in _DTYPES:
                raise ArtifactError(f"{path}: tensor {name!r} has dtype {e['dtype']}, which this "
                                    f"reader does not support (supports {sorted(_DTYPES)})")
            dtype, np_dtype = _DTYPES[e["dtype"]]
            out[name] = RawTensor(dtype, np.frombuffer(e["data"], np.dtype(np_dtype).newbyteorder("<"))
                                  .reshape(e["shape"]))
    except (SafetensorError, OSError, ValueError, OverflowError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ArtifactError(f"{path}: corrupt safetensors ({first[:200]})") from None
    return out
