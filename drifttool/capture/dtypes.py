"""How captured tensors are spelled in artifacts: dtype names and raw bytes.

    >>> dtype_name(torch.bfloat16), dtype_from_name("float32")
    ('bfloat16', torch.float32)
    >>> raw_bytes(torch.tensor([1.0], dtype=torch.float16))
    array([  0, 60], dtype=uint8)
"""

from __future__ import annotations

import numpy as np
import torch


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (the spelling stored in artifacts)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of ``dtype_name``; raises ``ValueError`` for an unknown name."""
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def raw_bytes(t: torch.Tensor) -> np.ndarray:
    """The bytes of ``t`` in row-major order as a flat ``uint8`` array (no copy when ``t`` is a
    contiguous CPU tensor; a GPU tensor is copied to the host)."""
    t = t.detach().resolve_conj().resolve_neg()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()
