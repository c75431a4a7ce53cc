"""Strict family on device ``cuda``: Triton kernels with one fixed sequential order per reduction.

Contract ``cuda1`` (docs/strict-arithmetic.md, "The strict CUDA family"): FP32 accumulation, bf16
operands on tensor cores (FP32 operands in IEEE FP32, never TF32), one fixed launch configuration
per operator (no autotuning across shapes), no split-K, split-KV, stream-K or atomics, so a row's
bytes depend on that row's inputs alone — not on the batch, its position, the prompt padding or
the launch geometry. Each reduction axis is walked once, in ascending order, in fixed-width
chunks; layouts stay byte-identical because strict never splits a reduction axis across ranks
(TP shards output features, SP shards rows, attention keeps a head's keys on one rank).

Registration needs no Triton: each operator registers through ``_register.strict_cuda`` with its
declared constraints (CUDA tensors, a qualified GPU, Triton importable, the operator's dtypes,
forward only — except the token-row GEMMs and ``lora_merge`` (``backward``) and the row
operators ``qk_rmsnorm``, ``txt_in_rmsnorm_linear``, ``adaln_modulation``, ``adaln_gate_residual``
and ``multi_axis_rope`` (``row_backward``) and ``joint_attention_fused`` (``attention_backward``),
which have a backward, contract ``grad.cuda1``); the kernels (``kernels/``) are imported when a
call runs. The CPU bytes (contract
v2) and these differ inside a chunk; the tolerance profile declares by how much.
"""

from drifttool.ops.strict_cuda import _register  # noqa: F401
from drifttool.ops.strict_cuda import rows  # noqa: F401,E402
from drifttool.ops.strict_cuda import sampler  # noqa: F401,E402
from drifttool.ops.strict_cuda import linear  # noqa: F401,E402
from drifttool.ops.strict_cuda import attention  # noqa: F401
