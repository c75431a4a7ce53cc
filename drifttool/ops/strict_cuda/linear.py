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

Unfused LoRA (``lora=``, LoRA mode ``unfused-fp32``; contract cuda1): the four block GEMMs
``qkv_bias_gemm``, ``attn_out_bias_gemm``, ``mlp_up_gemm_gelu`` and ``mlp_down_gemm`` take ``lora``
= ``(A [r, K] FP32, B [N, r] FP32, s)`` (for ``qkv_bias_gemm`` a 3-tuple of those or ``None``, q, k,
v) and keep W in its dtype (bf16 W on the tensor cores):

    u   = narrow.linear(x, A)                                           # [..., r], IEEE FP32, K in segments
    pre = linear(x, W, b, out_dtype=fp32)                               # [..., N]
    y   = linear(u, B, merge_into=pre, scale=s, act=act, out_dtype=dt)  # act(pre + fp32(s)·(u·Bᵀ))

(the product and the sum each rounded to FP32, then the activation, then one cast). Such a call
runs the operator's second registration, kernel id ``<kernel>`` + ``LORA_SUFFIX``; its backward is
``backward.AdaptedLinear`` / ``backward.AdaptedQKV``.

Backward (``strict_cuda.backward``, contract ``qwenimage.<op>.grad.cuda1``) for the five token-row
GEMMs and ``lora_merge``: each runs through a ``torch.autograd.Function`` whose forward is the code
here unchanged. ``adaln_mod_projection`` and ``timestep_embed_mlp`` are forward only (the family's
``forward_only`` constraint). Triton is imported when a call runs.
"""

from __future__ import annotations

import functools

import torch

from drifttool.capture import produced
from drifttool.ops.lora import adapter_given, lora_factors  # (importing it declares lora_merge)
from drifttool.ops.constraints import Constraint, dtypes
from drifttool.ops.registry import implements, spec
from drifttool.ops.strict_cuda import backward as bwd
from drifttool.ops.strict_cuda._register import QUALIFIED_GPU, TRITON_READY, strict_cuda

KERNEL = "triton.gemm.k64.seq.bm128bn256w8s3.tma.p1|wide.bm128bn256w8s4.tma|fp32.ieee.bm64bn128w4s1"
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


LORA_SUFFIX = "+lora.unfused.kseg256"
"""Kernel id suffix of a block GEMM called with an unfused adapter (``lora``; ``kseg``: the
rank-wide GEMMs' segment length, ``kernels.narrow.SEG_K``): u = x·Aᵀ and the
epilogue merge pre + fp32(s)·(u·Bᵀ), both IEEE FP32 (u by ``kernels.narrow``: K in segments, the
merge by ``FP32_CONFIG``, ``MERGE_ACT_CONFIG`` with the activation)."""


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


def _narrow():
    """The rank-wide GEMM's module (imported at the first call, as ``_gemm``)."""
    from drifttool.ops.strict_cuda.kernels import narrow  # lazy: Triton only when a strict CUDA call runs

    return narrow


def _embed():
    """The SiLU and sinusoid kernels' module (imported at the first call, as ``_gemm``)."""
    from drifttool.ops.strict_cuda.kernels import embed  # lazy: Triton only when a strict CUDA call runs

    return embed


def _linear(x, w, b, *, output: bool = False, **kw):
    """The strict GEMM; ``output``: this launch writes the operator's output, which the epilogue
    then digests when the call is captured (``capture.produced``)."""
    return _gemm().linear(x, w, b, digest=output and produced.wanted(), **kw)


def _gemv(x, w, b, **kw):
    from drifttool.ops.strict_cuda.kernels import gemv  # lazy: Triton only when a strict CUDA call runs

    return gemv.gemv(x, w, b, **kw)


def _plain(x, w, b):
    return _linear(x, w, b, out_dtype=_act_dtype(x, w, b), output=True)


def _token_gemm(x, w, b):
    """The strict GEMM with its backward (``backward.Linear``)."""
    return bwd.Linear.apply(x, w, b, _plain, None)


# ----------------------------------------------------------------------------- unfused LoRA


def _adapter(present: bool) -> Constraint:
    """The call has an unfused adapter (``present``) or has none: which of an operator's two
    registrations runs it (and so which kernel id the trace records)."""

    def test(args) -> str | None:
        if adapter_given(args["lora"]) == present:
            return None
        return ("no lora given (the operator's plain registration runs it)" if present
                else "lora given (the registration with kernel id ...+lora.unfused.kseg256 runs it)")

    return Constraint("an unfused LoRA adapter" if present else "no LoRA adapter", test, ("lora",))


def _block_gemm(op: str, *dtype_args: str, kernel: str, weights: tuple[str, ...] = ("w",)):
    """Register ``fn`` as the strict CUDA ``op`` twice: without an adapter (kernel id ``kernel``,
    the one ``registry.kernel_id`` names) and with one (``kernel + LORA_SUFFIX``)."""

    def deco(fn):
        strict_cuda(op, *dtype_args, kernel=kernel, trainable=True, constraints=(_adapter(False),))(fn)
        strict_cuda(op, *dtype_args, kernel=kernel + LORA_SUFFIX, trainable=True,
                    constraints=(_adapter(True), lora_factors("x", *weights)))(fn)
        return fn

    return deco


def _pre(x, w, b):
    """The base pre-activation x·Wᵀ + b, FP32 [..., N] (bf16 x and W: the tensor cores)."""
    return _linear(x, w, b, out_dtype=torch.float32)


def _branch_input(x, a):
    """u = x·Aᵀ: [..., r] FP32 (IEEE FP32: A is FP32; r columns: K in segments, ``kernels.narrow``)."""
    return _narrow().linear(x, a)


def _merge_branch(pre, u, bl, scale, act, dt, output=False):
    """act(pre + fp32(s)·(u·Bᵀ)) cast once to ``dt`` (the GEMM's epilogue merge; with ``act``
    on ``MERGE_ACT_CONFIG``)."""
    return _linear(u, bl, None, merge_into=pre, scale=float(scale), act=act, out_dtype=dt, output=output,
                   config=_gemm().MERGE_ACT_CONFIG if act is not None else None)


def _adapted(x, w, b, a, bl, scale, act=None):
    """(y, u) of one adapted projection: y = act(pre + fp32(s)·(u·Bᵀ)) in the activation dtype."""
    u = _branch_input(x, a)  # [..., r] fp32
    return _merge_branch(_pre(x, w, b), u, bl, scale, act, _act_dtype(x, w, b), output=True), u


def _adapted_pre(x, w, b, u, bl, scale):
    """The adapted FP32 pre-activation pre + fp32(s)·(u·Bᵀ), recomputed for mlp_up's backward
    (the forward's GEMMs and merge without the GELU: the forward's FP32 bytes)."""
    return _merge_branch(_pre(x, w, b), u, bl, scale, None, torch.float32)


def _one(x, w, b, lora, plain, pre_fn=None, act=None):
    """One projection with its backward: ``plain`` (``backward.Linear``) without an adapter, else
    the adapted arithmetic (``backward.AdaptedLinear``; ``act`` in the merge's epilogue)."""
    if not adapter_given(lora):
        return bwd.Linear.apply(x, w, b, plain, pre_fn)
    a, bl, scale = lora
    return bwd.AdaptedLinear.apply(x, w, b, a, bl, float(scale), functools.partial(_adapted, act=act),
                                   _adapted_pre if act is not None else None)


@strict_cuda("latent_proj_gemm", "x", "w", "b", kernel=KERNEL, trainable=True)
def latent_proj_gemm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """img_in ([B,N,64]→[B,N,d]) or proj_out ([B,N,d]→[B,N,64]), in x's dtype."""
    return _token_gemm(x, w, b)


def _qkv(x, wq, bq, wk, bk, wv, bv, heads):
    dt = _act_dtype(x, wq, bq, wk, bk, wv, bv)
    return tuple(_linear(x, w, b, out_dtype=dt, output=True).unflatten(-1, (heads, -1))  # [B,S,H,Dh]
                 for w, b in ((wq, bq), (wk, bk), (wv, bv)))


def _qkv_adapted(x, wq, bq, wk, bk, wv, bv, aq, bbq, ak, bbk, av, bbv, scales, heads):
    """((q, k, v), (uq, uk, uv)): a projection with factors by ``_adapted``, one without (None
    factors, u None) by the plain GEMM."""
    dt = _act_dtype(x, wq, bq, wk, bk, wv, bv)
    outs, us = [], []
    for w, b, a, bl, s in ((wq, bq, aq, bbq, scales[0]), (wk, bk, ak, bbk, scales[1]), (wv, bv, av, bbv, scales[2])):
        y, u = (_linear(x, w, b, out_dtype=dt, output=True), None) if a is None else _adapted(x, w, b, a, bl, s)
        outs.append(y.unflatten(-1, (heads, -1)))  # [B,S,H,Dh]
        us.append(u)  # [B,S,r] fp32 or None
    return tuple(outs), tuple(us)


@_block_gemm("qkv_bias_gemm", "x", "wq", "bq", "wk", "bk", "wv", "bv", kernel=KERNEL, weights=("wq", "wk", "wv"))
def qkv_bias_gemm(x, wq, bq, wk, bk, wv, bv, heads: int, lora=None):
    """Per-stream Q/K/V: x [B,S,d] → three [B,S,H,Dh] in x's dtype, each its own GEMM. ``lora``:
    None or (q, k, v) entries, each None or (A, B, s) (module docstring, "Unfused LoRA")."""
    if not adapter_given(lora):
        return bwd.QKV.apply(x, wq, bq, wk, bk, wv, bv, lambda *t: _qkv(*t, heads))
    fs = [(None, None, 0.0) if e is None else (e[0], e[1], float(e[2])) for e in lora]
    return bwd.AdaptedQKV.apply(x, wq, bq, wk, bk, wv, bv, *fs[0][:2], *fs[1][:2], *fs[2][:2],
                                tuple(f[2] for f in fs), lambda *t: _qkv_adapted(*t, heads))


@_block_gemm("attn_out_bias_gemm", "x", "w", "b", kernel=KERNEL)
def attn_out_bias_gemm(x, w, b, lora=None):
    """to_out.0 / to_add_out: [B,S,d] → [B,S,d]; ``lora``: None or (A, B, s)."""
    return _one(x, w, b, lora, _plain)


def _mlp_up_config(x, w):
    cap = GELU_MAXNREG[GELU_EPILOGUE]
    if cap and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16:
        return _gemm().GemmConfig(maxnreg=cap)
    return None


def _mlp_up(x, w, b):
    return _linear(x, w, b, act=GELU_ACTS[GELU_EPILOGUE], out_dtype=_act_dtype(x, w, b),
                   config=_mlp_up_config(x, w), output=True)


def _mlp_up_pre(x, w, b):
    """The FP32 pre-activation of ``_mlp_up`` (its GEMM and bias, no activation): the backward's."""
    return _linear(x, w, b, out_dtype=torch.float32, config=_mlp_up_config(x, w))


@_block_gemm("mlp_up_gemm_gelu", "x", "w", "b", kernel=_mlp_up_kernel())
def mlp_up_gemm_gelu(x, w, b, lora=None):
    """GELU_tanh(x·wᵀ + b) [B,S,4d]: the GELU in the GEMM's epilogue (``GELU_EPILOGUE``; by
    default the FP32 formula, rounded once to FP32), then one cast. Backward: the pre-activation
    recomputed by the same GEMM, dpre = dy·GELU'(pre) of the FP32 formula (``backward``).
    ``lora``: None or (A, B, s); the GELU then takes pre + fp32(s)·(u·Bᵀ) in the merge's epilogue."""
    return _one(x, w, b, lora, _mlp_up, _mlp_up_pre, act=GELU_ACTS[GELU_EPILOGUE])


@_block_gemm("mlp_down_gemm", "x", "w", "b", kernel=KERNEL)
def mlp_down_gemm(x, w, b, lora=None):
    """img_mlp.net.2 / txt_mlp.net.2: [B,S,4d] → [B,S,d]; ``lora``: None or (A, B, s)."""
    return _one(x, w, b, lora, _plain)


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
