"""Strict CUDA GEMM-bearing operators: latent_proj_gemm, qkv_bias_gemm, attn_out_bias_gemm,
mlp_up_gemm_gelu, mlp_down_gemm, adaln_mod_projection, timestep_embed_mlp, lora_merge.

Each is the strict CPU operator's arithmetic (``drifttool.ops.strict``: inputs upcast to FP32,
FP32 accumulation, FP64 exact-op transcendentals, one cast to the activation dtype) with the K
reduction of contract ``cuda1``, chosen by operator (never by shape): ``kernels.gemm.linear`` (one
program per output tile walks all of K in 64-wide chunks, ascending, MMA-accumulated in FP32; bias
once in FP32; activation; one cast) for the token-row GEMMs and ``lora_merge``; ``kernels.gemv.gemv``
(one program per row: 64 lane sums over K, ascending, then a pairwise tree) for the few-row
FP32-operand GEMMs ``adaln_mod_projection`` and ``timestep_embed_mlp``.
Byte-equal to the CPU where the arithmetic is elementwise and done the CPU's way (the SiLU of a
given FP32 value, the timestep sinusoid; the GELU only with ``GELU_EPILOGUE = "f64"``); the K sums
differ inside a chunk (the tolerance profile declares by how much).

Backward (``strict_cuda.backward``, contract ``qwenimage.<op>.grad.cuda1``) for the five token-row
GEMMs and ``lora_merge``: each runs through a ``torch.autograd.Function`` whose forward is the code
here unchanged. ``adaln_mod_projection`` and ``timestep_embed_mlp`` are forward only (the family's
``forward_only`` constraint). Triton is imported when a call runs.
"""

from __future__ import annotations

import torch

import drifttool.ops.lora  # noqa: F401  (declares lora_merge)
from drifttool.ops.constraints import dtypes
from drifttool.ops.registry import implements, spec
from drifttool.ops.strict_cuda import backward as bwd
from drifttool.ops.strict_cuda._register import QUALIFIED_GPU, TRITON_READY, strict_cuda

KERNEL = "triton.gemm.k64.seq.bm128bn128w8s3.tma|fp32.ieee.bm16bn64w4s1"
"""Kernel identity of the strict CUDA GEMM (``kernels.gemm.KERNEL_ID``; a test keeps them equal)."""

GEMV = "triton.gemv.row.lanes64.seq.pairtree.fp32.bn64w4u4"
"""Kernel identity of the strict CUDA GEMV (``kernels.gemv.GEMV_ID``; a test keeps them equal): the
order of ``adaln_mod_projection`` and ``timestep_embed_mlp`` (few rows, an FP32 operand), by
operator, whatever the number of rows."""


GELU_EPILOGUE = "f32"
"""The GELU of ``mlp_up_gemm_gelu``'s epilogue: ``"f32"`` (the default:
``kernels.exact_math._gelu_tanh_f32``, an FP32 formula of exact FP32 operations in a stated order,
within a few FP32 ulps of the true GELU) or ``"f64"`` (FP64 from exact operations: the CPU's bytes given
the same FP32 pre-activation). The GEMM before it differs from the CPU's inside a K chunk anyway,
so the FP64 form bought no byte of CPU parity in the model; on the H200 it cost 1.55× production
against 1.06× for the FP32 form. ``benchmarks/bench_strict_cuda.py`` times both; the kernel id
names the one in use."""

GELU_ACTS = {"f64": "gelu_tanh", "f32": "gelu_tanh_f32"}
"""``GELU_EPILOGUE`` → the kernel's activation name."""

GELU_MAXNREG = {"f64": None, "f32": 128}
"""``GELU_EPILOGUE`` → the register cap of ``mlp_up_gemm_gelu``'s bf16 GEMM: with the FP32 GELU,
128 registers per thread let two 8-warp CTAs share an SM, one's epilogue beside the other's MMAs
(the cap moves no byte: ``tests/gpu/test_strict_cuda_gemm.py``). ``None``: the compiler's."""


def _mlp_up_kernel() -> str:
    cap = GELU_MAXNREG[GELU_EPILOGUE]
    return f"{KERNEL}+gelu_tanh.{GELU_EPILOGUE}" + (f".r{cap}" if cap else "")


def _act_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """The dtype of the first non-``None`` tensor (FP32 when none): the strict output dtype."""
    return next((t.dtype for t in tensors if t is not None), torch.float32)


def _gemm():
    """The GEMM kernels' module (imported at the first call, so importing drifttool needs no Triton)."""
    from drifttool.ops.strict_cuda.kernels import gemm  # lazy: Triton only when a strict CUDA call runs

    return gemm


def _embed():
    """The SiLU and sinusoid kernels' module (imported at the first call, as ``_gemm``)."""
    from drifttool.ops.strict_cuda.kernels import embed  # lazy: Triton only when a strict CUDA call runs

    return embed


def _linear(x, w, b, **kw):
    return _gemm().linear(x, w, b, **kw)


def _gemv(x, w, b, **kw):
    from drifttool.ops.strict_cuda.kernels import gemv  # lazy: Triton only when a strict CUDA call runs

    return gemv.gemv(x, w, b, **kw)


def _plain(x, w, b):
    return _linear(x, w, b, out_dtype=_act_dtype(x, w, b))


def _token_gemm(x, w, b):
    """The strict GEMM with its backward (``backward.Linear``)."""
    return bwd.Linear.apply(x, w, b, _plain, None)


@strict_cuda("latent_proj_gemm", "x", "w", "b", kernel=KERNEL, trainable=True)
def latent_proj_gemm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """img_in ([B,N,64]→[B,N,d]) or proj_out ([B,N,d]→[B,N,64]), in x's dtype."""
    return _token_gemm(x, w, b)


def _qkv(x, wq, bq, wk, bk, wv, bv, heads):
    dt = _act_dtype(x, wq, bq, wk, bk, wv, bv)
    return tuple(_linear(x, w, b, out_dtype=dt).unflatten(-1, (heads, -1))  # [B,S,H,Dh]
                 for w, b in ((wq, bq), (wk, bk), (wv, bv)))


@strict_cuda("qkv_bias_gemm", "x", "wq", "bq", "wk", "bk", "wv", "bv", kernel=KERNEL, trainable=True)
def qkv_bias_gemm(x, wq, bq, wk, bk, wv, bv, heads: int):
    """Per-stream Q/K/V: x [B,S,d] → three [B,S,H,Dh] in x's dtype, each its own GEMM."""
    return bwd.QKV.apply(x, wq, bq, wk, bk, wv, bv, lambda *t: _qkv(*t, heads))


@strict_cuda("attn_out_bias_gemm", "x", "w", "b", kernel=KERNEL, trainable=True)
def attn_out_bias_gemm(x, w, b):
    """to_out.0 / to_add_out: [B,S,d] → [B,S,d]."""
    return _token_gemm(x, w, b)


def _mlp_up_config(x, w):
    cap = GELU_MAXNREG[GELU_EPILOGUE]
    if cap and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16:
        return _gemm().GemmConfig(maxnreg=cap)
    return None


def _mlp_up(x, w, b):
    return _linear(x, w, b, act=GELU_ACTS[GELU_EPILOGUE], out_dtype=_act_dtype(x, w, b),
                   config=_mlp_up_config(x, w))


def _mlp_up_pre(x, w, b):
    """The FP32 pre-activation of ``_mlp_up`` (its GEMM and bias, no activation): the backward's."""
    return _linear(x, w, b, out_dtype=torch.float32, config=_mlp_up_config(x, w))


@strict_cuda("mlp_up_gemm_gelu", "x", "w", "b", kernel=_mlp_up_kernel(), trainable=True)
def mlp_up_gemm_gelu(x, w, b):
    """GELU_tanh(x·wᵀ + b) [B,S,4d]: the GELU in the GEMM's epilogue (``GELU_EPILOGUE``; by
    default the FP32 formula, rounded once to FP32), then one cast. Backward: the pre-activation
    recomputed by the same GEMM, dpre = dy·GELU'(pre) of the FP32 formula (``backward``)."""
    return bwd.Linear.apply(x, w, b, _mlp_up, _mlp_up_pre)


@strict_cuda("mlp_down_gemm", "x", "w", "b", kernel=KERNEL, trainable=True)
def mlp_down_gemm(x, w, b):
    """img_mlp.net.2 / txt_mlp.net.2: [B,S,4d] → [B,S,d]."""
    return _token_gemm(x, w, b)


@strict_cuda("adaln_mod_projection", "temb", "w", "b", kernel="silu_f64+" + GEMV)
def adaln_mod_projection(temb, w, b):
    """SiLU(temb)·wᵀ + b: temb [B,d] → [B,6d] in temb's dtype. The SiLU is the CPU's ``silu32``
    (byte-equal); its FP32 rows go through the GEMV (FP32 products, lane sums, pairwise tree)."""
    return _gemv(_embed().silu32(temb), w, b, out_dtype=_act_dtype(temb, w, b))


@strict_cuda("timestep_embed_mlp", "w1", "b1", "w2", "b2", kernel="sincos_f64+" + GEMV,
             constraints=(dtypes((torch.float32,), "tau"),))
def timestep_embed_mlp(tau, w1, b1, w2, b2):
    """temb = linear_2(SiLU(linear_1(φ(τ)))): tau [B] fp32 → [B,d] in the weights' dtype.

    φ is the CPU's sinusoid (byte-equal); linear_1 and linear_2 are GEMVs (FP32 products, lane
    sums, pairwise tree); linear_1's FP32 result takes the SiLU in its epilogue and stays FP32;
    linear_2 casts once.
    """
    phi = _embed().sinusoid(tau, w1.shape[1])  # [B,256] fp32
    h = _gemv(phi, w1, b1, act="silu", out_dtype=torch.float32)  # [B,d] fp32
    return _gemv(h, w2, b2, out_dtype=_act_dtype(b1, w1, b2, w2))  # b1: W (w1 may be LoRA-merged FP32)


@implements("lora_merge", "strict", device="cuda",
            kernel="triton.gemm.k64.seq.fp32.ieee.bm64bn64w4s1+merge(fp32(W)+fp32(s)·BA)",
            contract="drifttool.lora_merge.cuda1",
            constraints=(TRITON_READY, QUALIFIED_GPU,
                         dtypes(spec("lora_merge").dtypes, "w", "a", "b")))
def lora_merge(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W' = fp32(W) + fp32(scale)·(B·A), FP32 result, as the strict CPU ``lora_merge``; B·A by the
    strict CUDA GEMM (FP32 operands, IEEE products, r walked once in ascending order), the scale
    and the add in its epilogue (each rounded to FP32 as the two torch operations would be).

    Args:
        w: [out, in] base weight (fp32 or bf16).  a: [r, in].  b: [out, r].
        scale: α / r (python float, rounded once to fp32).

    Backward (``backward.LoraMerge``): dB = (s·D)·A, dA = Bᵀ·(s·D), each axis walked once.
    """
    return bwd.LoraMerge.apply(w, a, b, float(scale), _merge)


def _merge(w, a, b, scale):
    return _linear(b.to(torch.float32), a.to(torch.float32).t(), None, out_dtype=torch.float32,
                   merge_into=w, scale=float(scale), config=_gemm().LORA_CONFIG)  # [out, in] fp32
