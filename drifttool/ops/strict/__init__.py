"""Strict family on device ``cpu``: FP32 accumulation, fixed reduction trees, batch/padding
invariant. Each operator registers through ``_checks.strict_cpu`` with its declared constraints
(CPU tensors, the operator's dtypes); a strict family for another device registers the same
operators from its own module.

Cast policy (RFC "Cast FP32→BF16 only at the declared kernel output boundary"): every operator
upcasts its inputs to FP32, computes in FP32 (FP64 inside transcendentals), and casts its output
once to the activation dtype. See docs/strict-arithmetic.md for each reduction order.

Public surface for code that writes strict arithmetic outside this package (the TP rules of
``drifttool.distributed.tp``): the cast policy (``act_dtype``, ``f32``, ``out``) and the backward
helpers (``g32``, ``cast_like``, ``gelu_tanh_grad32``). ``_checks`` is this package's own.
"""

from drifttool.ops.strict import adaln, attention, attention_fused, embed, latent, linear  # noqa: F401
from drifttool.ops.strict._checks import act_dtype, f32, out
from drifttool.ops.strict.grad import cast_like, g32, gelu_tanh_grad32

__all__ = ["act_dtype", "cast_like", "f32", "g32", "gelu_tanh_grad32", "out"]
