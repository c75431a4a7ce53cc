"""Strict CUDA backward of ``joint_attention_fused`` (contract
``qwenimage.joint_attention_fused.grad.cuda1``): a ``torch.autograd.Function`` whose forward is
the cuda1 fused kernel and whose backward is ``kernels.attention_backward``.

    >>> o = JointAttention.apply(q, k, v, key_mask, text_len)   # as joint_attention_fused
    >>> o.backward(do)                                          # dQ, dK, dV in fixed orders

Without a gradient wanted, the forward is the forward-only kernel, unchanged. With one, the same
kernel also writes each row's (m, 1/l) — the two numbers its pass 2 reads — which are saved with
q, k, v and the output; the output's bytes are the same either way. The backward recomputes P
from them bit for bit and walks the forward's blocks (the kernel module's docstring has the
orders). Masked positions (key_mask False) get dQ = dK = dV = +0 and their output gradient is
not read, so prompt padding moves no valid gradient byte; a key mask needs the joint
self-attention layout (as many query rows as keys), checked at the forward.

Only the fused operator has a backward: its decomposition (``joint_attn_qk_gemm`` →
``joint_attn_softmax`` → ``joint_attn_av_gemm``, run when a capture at L2 wants the internals)
stays forward only and refuses a gradient in one line. Not supported: double backward.
"""

from __future__ import annotations

import torch

from drifttool.capture import produced


def _kernels():
    from drifttool.ops.strict_cuda.kernels import attention  # lazy: Triton only when a call runs

    return attention


def _bwd():
    from drifttool.ops.strict_cuda.kernels import attention_backward  # lazy: Triton only when a call runs

    return attention_backward


class JointAttention(torch.autograd.Function):
    """softmax(q·kᵀ/√Dh over the valid keys)·v by the strict CUDA fused kernel, with its backward."""

    @staticmethod
    def forward(ctx, q, k, v, key_mask, text_len):
        digest = produced.wanted()  # the output digested where it is written, for its capture
        if not any(ctx.needs_input_grad[:3]):
            return _kernels().attention(q, k, v, key_mask, text_len=text_len, digest=digest)
        o, ml = _kernels().attention(q, k, v, key_mask, text_len=text_len, with_stats=True, digest=digest)
        ctx.save_for_backward(q, k, v, o, ml, key_mask)
        ctx.text_len = text_len
        return o

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        q, k, v, o, ml, key_mask = ctx.saved_tensors
        dq, dk, dv = _bwd().attention_grads(do, q, k, v, o, ml, key_mask, text_len=ctx.text_len,
                                            needs=ctx.needs_input_grad[:3])
        return dq, dk, dv, None, None
