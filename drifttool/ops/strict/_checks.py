"""Registration and cast helpers shared by the strict CPU family.

    >>> @strict_cpu("qk_rmsnorm", "x", "gain", kernel="tree_rmsnorm")
    ... def qk_rmsnorm(x, gain, eps=1e-6): ...

``strict_cpu`` registers an implementation for family ``strict``, device ``cpu`` with the
declared constraints every strict CPU operator has: tensors on the CPU (added by ``implements``)
and the listed tensor arguments in the operator's declared dtypes (``OpSpec.dtypes``, FP32 or
BF16). Dispatch checks them on every call and fails closed with ``UnsupportedConfigError``
naming the operator, family, device and constraint (``drifttool.ops.registry``).
"""

from __future__ import annotations

from typing import Callable

import torch

import drifttool.ops.specs  # noqa: F401  (the operators strict implements are declared there)
from drifttool.ops.constraints import Constraint, dtypes
from drifttool.ops.registry import implements, spec


def strict_cpu(op: str, *dtype_args: str, kernel: str, constraints: tuple[Constraint, ...] = (),
               decomposable: bool = False) -> Callable[[Callable], Callable]:
    """Register a strict CPU implementation of ``op``; ``dtype_args`` name the tensor arguments
    whose dtype must be one of the operator's declared dtypes (``None`` values allowed)."""
    declared = (dtypes(spec(op).dtypes, *dtype_args),) if dtype_args else ()
    return implements(op, "strict", device="cpu", kernel=kernel,
                      constraints=declared + tuple(constraints), decomposable=decomposable)


def act_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """The activation dtype of a strict operator: that of its first non-``None`` tensor (FP32
    when none); its output is cast once to it (``out``)."""
    return next((t.dtype for t in tensors if t is not None), torch.float32)


def f32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(torch.float32)


def out(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The declared output boundary: round to FP32 (if wider), then cast once to ``dtype``."""
    return t.to(torch.float32).to(dtype)
