"""Strict backends: FP32 accumulation, fixed reduction trees, batch/padding invariant, CPU.

Cast policy (RFC "Cast FP32→BF16 only at the declared kernel output boundary"): every operator
upcasts its inputs to FP32, computes in FP32 (FP64 inside transcendentals), and casts its output
once to the activation dtype. See docs/strict-arithmetic.md for each reduction order.
"""

from drifttool.ops.strict import adaln, attention, attention_fused, embed, latent, linear  # noqa: F401
