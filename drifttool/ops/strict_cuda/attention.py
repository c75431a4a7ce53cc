"""Strict joint attention on CUDA (contract cuda1): ``joint_attention_fused`` and its declared
decomposition ``joint_attn_qk_gemm`` → ``joint_attn_softmax`` → ``joint_attn_av_gemm``, all four
one Triton kernel (``kernels/attention.py``) in four modes, so the unfused chain reproduces the
fused operator's bytes (``decomposable=True``: dispatch may expand it at L2).

Arithmetic (the kernel module's docstring has it in full): keys in fixed 64-key blocks in global
key order — text blocks from key 0, image blocks from key ``text_len`` — FP32 scores, two passes
(row max and sum merged block by block, then P = exp2(x − m) · (1/l) cast to v's dtype and
accumulated block by block on tensor cores), output cast once to v's dtype. Masked keys never
enter; a text block without a valid key is skipped, so prompt padding (with ``text_len`` the
padded length) changes no valid row's bytes. Rows of masked queries are computed like any other
row (as the CPU does). The bytes differ from strict CPU (contract v2) inside a block: the
tolerance profile declares by how much.

Every operator takes ``text_len`` (keyword; ``None`` = 0: every position an image position) and
raises ``UnsupportedConfigError`` for a sample without a valid key (checked on the host: one
device synchronisation per call with a key mask).

Backward (contract ``qwenimage.joint_attention_fused.grad.cuda1``): ``joint_attention_fused``
runs through ``attention_backward.JointAttention`` (dQ, dK, dV by ``kernels/attention_backward.py``;
with a gradient wanted and a key mask, the query rows must be the keys' positions, Sq = S). The
three unfused operators are forward only: a gradient through them (the decomposition runs when a
capture at L2 wants the internals) is refused in one line.
"""

from __future__ import annotations

import weakref

import torch

from drifttool.capture import produced
from drifttool.errors import UnsupportedConfigError
from drifttool.ops.constraints import Args, Constraint, key_mask_fits, text_len_fits
from drifttool.ops.strict_cuda._register import forward_only, strict_cuda, wants_grad
from drifttool.ops.strict_cuda.attention_backward import JointAttention

HEAD_DIMS = (16, 32, 64, 128)
"""Head dims the kernel is built for (powers of two, a multiple of the tensor-core K step 16)."""

KERNEL = "triton.attention.block64.two_pass.bm128w4s2.tma|fp32.bm64w4s1"
"""The kernel and its one configuration: 64-key blocks; bf16 operands 128 query rows, 4 warps,
2 stages, K and V of whole image blocks loaded through TMA where their layout allows (the same
values as pointer loads); FP32 operands 64 rows, 4 warps, 1 stage, pointer loads."""


def _head_dim(ref: str) -> Constraint:
    def test(args: Args) -> str | None:
        dh = args[ref].shape[-1]
        return None if dh in HEAD_DIMS else f"head dim {dh} is not one of {list(HEAD_DIMS)}"

    return Constraint(f"head dim in {list(HEAD_DIMS)}", test, (ref,))


def _qkv(*names: str) -> Constraint:
    """q [B,Sq,H,Dh] and k (, v) [B,S,H,Dh] of one dtype, B, H and Dh alike, text_len ≤ Sq:
    the query rows are the joint sequence's (Sq = S) or its text rows and some image rows (an
    SP rank's)."""

    def test(args: Args) -> str | None:
        ts = [args[n] for n in names]
        if any(t.dim() != 4 for t in ts):
            return f"{', '.join(names)} must be [B, S, H, Dh], got {[list(t.shape) for t in ts]}"
        q, keys = ts[0], ts[1:]
        if (len({tuple(t.shape) for t in keys}) > 1 or len({t.dtype for t in ts}) > 1
                or (q.shape[0], q.shape[2], q.shape[3]) != (keys[0].shape[0], keys[0].shape[2], keys[0].shape[3])):
            return (f"{', '.join(names)} must share B, H, Dh and dtype ({', '.join(names[1:])} one shape), got "
                    f"{[(list(t.shape), str(t.dtype).removeprefix('torch.')) for t in ts]}")
        return _rows_hold_text(args, q.shape[1])

    return Constraint(f"{', '.join(names)} [B,S,H,Dh] alike", test, names)


def _rows_hold_text(args: Args, sq: int) -> str | None:
    n = args.get("text_len")
    if isinstance(n, int) and not isinstance(n, bool) and n > sq:
        return f"text_len {n} exceeds the {sq} query rows (they start with the text rows)"
    return None


def _probs_shape(ref: str, v: str | None = None) -> Constraint:
    """``args[ref]`` is [B,H,Sq,S] (and matches v [B,S,H,Dh] when given)."""

    def test(args: Args) -> str | None:
        x = args[ref]
        if x.dim() != 4:
            return f"{ref} must be [B, H, Sq, S], got {list(x.shape)}"
        if v is not None:
            w = args[v]
            want = [x.shape[0], x.shape[3], x.shape[1]]
            if w.dim() != 4 or list(w.shape[:3]) != want:
                return f"{v} must be [B, S, H, Dh] = {want + ['Dh']} for {ref} {list(x.shape)}, got {list(w.shape)}"
        return _rows_hold_text(args, x.shape[2])

    return Constraint(f"{ref} [B,H,Sq,S]", test, (ref,) if v is None else (ref, v))


def _grad_layout(args: Args) -> str | None:
    """With a gradient wanted and a key mask, Sq = S: the backward reads a masked position's
    query row as padding (``kernels.attention_backward``), which needs query row i = position i."""
    q, k = args["q"], args["k"]
    if args.get("key_mask") is not None and q.shape[1] != k.shape[1] and wants_grad(args):
        return (f"the strict CUDA attention backward with a key mask needs the joint self-attention layout "
                f"(as many query rows as keys), got {q.shape[1]} query rows and {k.shape[1]} keys")
    return None


GRAD_LAYOUT = Constraint("backward: query rows = keys with a key mask", _grad_layout, ("q", "k", "key_mask"))

UNFUSED_FORWARD_ONLY = forward_only(
    "the strict CUDA attention backward is joint_attention_fused's; its decomposition into "
    "joint_attn_qk_gemm/joint_attn_softmax/joint_attn_av_gemm (run when a capture at L2 wants the "
    "internals) is forward only — to train, capture at L1 or below, or at L2 without the internals "
    "(recompute --no-internals)")
"""The unfused operators' refusal of a gradient."""


_CHECKED: list = [None, -1]
"""The last key mask found valid: (a weak reference to it, its version counter). The model hands
every block the same mask; checking it once per forward instead of once per block saves a device
synchronisation per block. An in-place change to the mask bumps its version and re-checks."""


def _check_valid_keys(op: str, key_mask: torch.Tensor | None) -> None:
    """Refuse a sample without a valid key (a host synchronisation, once per mask). Skipped while
    a CUDA graph is being captured (``drifttool.model.graphs``), where no host read can run: the
    model's key mask holds every image key of every sample, so it always passes there."""
    if key_mask is None or (key_mask.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    ref, version = _CHECKED
    if ref is not None and ref() is key_mask and version == key_mask._version:
        return
    if not bool(key_mask.any(dim=1).all()):
        raise UnsupportedConfigError(f"{op}: a sample has no valid key (its key_mask is all False)")
    _CHECKED[:] = [weakref.ref(key_mask), key_mask._version]


def _kernels():
    from drifttool.ops.strict_cuda.kernels import attention  # lazy: Triton only when a strict CUDA call runs

    return attention


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


def _fused_internals(scope, q, k, v, key_mask=None, *, text_len: int | None = None):
    """``joint_attention_fused``'s output with the row tables of its internals (``Impl.internals``):
    the scores and the probabilities that ``joint_attn_qk_gemm`` and ``joint_attn_softmax`` would
    store, digested by the fused kernel in its second pass at the columns of their ``B.SK`` records
    (the scope's valid prompt keys, then the image keys), never stored
    (``kernels.attention.attention``'s ``internals``); a zero-stride stand-in of their shape beside
    each.

    None (the decomposition runs: the same records) for heads the internals launch does not take
    (``kernels.attention.INTERNALS_MIN_HEAD_DIM``).

    Raises:
        UnsupportedConfigError: a sample without a valid key."""
    _check_valid_keys("joint_attention_fused", key_mask)
    b, sq, h, dh = q.shape
    if dh < _kernels().INTERNALS_MIN_HEAD_DIM:
        return None
    s, L = k.shape[1], int(text_len or 0)
    starts, lens = scope.get("txt_starts"), scope.get("txt_lens")
    t0 = [0] * b if starts is None else [int(x) for x in starts]
    n = [L - a for a in t0] if lens is None else [int(x) for x in lens]
    o, scores, probs = _kernels().attention(q, k, v, key_mask, text_len=text_len, digest=produced.wanted(),
                                            internals=(t0, n))
    like = torch.zeros((), dtype=torch.float32, device=q.device).expand(b, h, sq, s)
    return o, {"joint_attn_qk_gemm": (scores, like), "joint_attn_softmax": (probs, like)}


@strict_cuda("joint_attention_fused", "q", "k", "v", kernel=KERNEL, decomposable=True, trainable=True,
             internals=_fused_internals,
             constraints=(_qkv("q", "k", "v"), _head_dim("q"), key_mask_fits("k"), text_len_fits("k"),
                          GRAD_LAYOUT))
def joint_attention_fused(q, k, v, key_mask=None, *, text_len: int | None = None):
    """softmax(q·kᵀ/√Dh over the valid keys)·v: q [B,Sq,H,Dh], k, v [B,S,H,Dh] → [B,Sq,H,Dh] in
    v's dtype (Sq = S, or the text rows and some image rows: an SP rank's);
    byte-equal to ``joint_attn_av_gemm(joint_attn_softmax(joint_attn_qk_gemm(...)))`` here.
    Differentiable (``attention_backward.JointAttention``): dQ, dK, dV in fixed orders; masked
    positions get +0 gradients and their output gradient is not read.

    Raises:
        UnsupportedConfigError: a sample without a valid key."""
    _check_valid_keys("joint_attention_fused", key_mask)
    return JointAttention.apply(q, k, v, key_mask, text_len)


@strict_cuda("joint_attn_qk_gemm", "q", "k", kernel=KERNEL, refuse_grad=UNFUSED_FORWARD_ONLY,
             constraints=(_qkv("q", "k"), _head_dim("q"), key_mask_fits("k"), text_len_fits("k")))
def joint_attn_qk_gemm(q, k, key_mask=None, *, text_len: int | None = None):
    """scores[b,h,i,j] = fp32(q_i · k_j) · fp32(1/√Dh) for every key (masked ones too), the fused
    kernel's tiles: q [B,Sq,H,Dh], k [B,S,H,Dh] → [B,H,Sq,S] FP32.

    Raises:
        UnsupportedConfigError: a sample without a valid key."""
    kern = _kernels()
    _check_valid_keys("joint_attn_qk_gemm", key_mask)
    return kern.scores(q, k, text_len=text_len)


@strict_cuda("joint_attn_softmax", "scores", kernel=KERNEL, refuse_grad=UNFUSED_FORWARD_ONLY,
             constraints=(_probs_shape("scores"), key_mask_fits("scores", seq_axis=-1),
                          text_len_fits("scores", seq_axis=-1)))
def joint_attn_softmax(scores, key_mask=None, *, text_len: int | None = None):
    """The fused kernel's probabilities: row max and sum merged over the 64-key blocks in order,
    P = exp2(s·log2 e − m) · (1/l); scores [B,H,Sq,S] → probs [B,H,Sq,S] FP32, masked keys +0.

    Raises:
        UnsupportedConfigError: a sample without a valid key."""
    kern = _kernels()
    _check_valid_keys("joint_attn_softmax", key_mask)
    return kern.softmax(_f32(scores), key_mask, text_len=text_len)


@strict_cuda("joint_attn_av_gemm", "probs", "v", kernel=KERNEL, refuse_grad=UNFUSED_FORWARD_ONLY,
             constraints=(_probs_shape("probs", "v"), _head_dim("v"), key_mask_fits("v"), text_len_fits("v")))
def joint_attn_av_gemm(probs, v, key_mask=None, *, text_len: int | None = None):
    """out_i = Σ_j P̃_ij v_j over the 64-key blocks in order, P̃ = probs cast to v's dtype per
    tile, FP32 accumulation on tensor cores; masked keys' P and v taken as +0. probs [B,H,Sq,S],
    v [B,S,H,Dh] → [B,Sq,H,Dh] in v's dtype.

    Raises:
        UnsupportedConfigError: a sample without a valid key."""
    kern = _kernels()
    _check_valid_keys("joint_attn_av_gemm", key_mask)
    return kern.attend(_f32(probs), v, key_mask, text_len=text_len, digest=produced.wanted())
