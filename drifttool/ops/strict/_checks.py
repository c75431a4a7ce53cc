"""Fail-closed input checks shared by the strict backends."""

from __future__ import annotations

import torch

from drifttool.errors import UnsupportedConfigError
from drifttool.ops.registry import spec


def check(op: str, *tensors: torch.Tensor | None) -> torch.dtype:
    """Check device and dtype of an operator's tensor inputs; return the activation dtype.

    Raises:
        UnsupportedConfigError: a tensor is not on the CPU (the strict GPU backend is not built
            yet), or its dtype is not one the operator declares.
    """
    allowed = spec(op).dtypes
    first = None
    for t in tensors:
        if t is None:
            continue
        if t.device.type != "cpu":
            raise UnsupportedConfigError(
                f"{op}: strict backend supports CPU tensors only, got device {t.device}"
            )
        if t.dtype not in allowed:
            names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
            raise UnsupportedConfigError(
                f"{op}: strict backend supports dtypes ({names}), got {str(t.dtype).removeprefix('torch.')}"
            )
        first = first or t.dtype
    return first or torch.float32


def f32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(torch.float32)


def out(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The declared output boundary: round to FP32 (if wider), then cast once to ``dtype``."""
    return t.to(torch.float32).to(dtype)
