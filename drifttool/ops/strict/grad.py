"""Strict backward primitives: fixed-order input and parameter gradients built from the strict
forward primitives (``tree_sum``, ``exact_matmul`` / ``tiled_linear``, exact-op transcendentals).

    >>> dx = linear_input_grad(dy, w)            # [..., N] @ [N, K] → [..., K], row-invariant
    >>> dw = weight_grad(dy, x)                  # per sample (contract v2), then over samples: [N, K]
    >>> db = sample_sum(row_sum(dy))             # [N]

Two kinds of gradient, two orders (docs/strict-arithmetic.md, "Backward"):

* **Per-row gradients** (dX) reduce only over the row's own axis (N of a GEMM output, D of a
  norm, keys of attention), with the forward's kernels (for a GEMM: contract v2 over N): a row's
  bytes do not depend on its batch companions, its position, or the row count.
* **Per-sample row reductions** (dW, db, norm gains, and the gradients of per-sample inputs:
  shift, scale, gate) reduce over a sample's rows by contract v2: the sample's live rows
  (``live_rows``: trailing rows whose gradient is all ±0 — prompt padding — are dropped) are cut
  into 64-row blocks; the block list is split into 8 segments by recursive halving; the blocks
  of a segment are added sequentially, the segments by the depth-3 tree
  (``rows_partial`` / ``outer_partial``). A sequence-parallel rank holding whole segments of a
  sample computes their subtree; the owner finishes the tree (``strict_trees.tree_finish``).
  Parameter gradients then sum the per-sample partials over the samples in batch order with the
  pairwise tree (``sample_sum`` / ``TreeAccumulator``). Consequences, tested in
  tests/ops/test_backward.py and tests/ops/test_shard_gemm.py: the per-sample partial does not
  depend on its companions, so aligned power-of-two microbatches combined with
  ``tree_sum_stack`` give the batch's bytes; swapping aligned halves of the samples changes
  nothing; trailing zero-gradient rows change nothing; SP row shards on segment boundaries
  reproduce the bytes. Other reorderings of samples or rows change the bytes (floating-point
  addition is not associative; the model presents samples in ascending logical id).

All functions take and return FP32; callers cast each gradient once to its input's dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from drifttool.ops.strict_gemm import N_TILE, _EXACT_BLOCK, linear_is_exact, tiled_linear
from drifttool.ops.strict_math import (  # noqa: F401  (TreeAccumulator re-exported)
    TreeAccumulator,
    exp64,
    pointwise32,
    tanh64,
    tree_sum,
)
from drifttool.ops.strict_trees import row_segment_spans, segmented_sum


# ----------------------------------------------------------------------------- row and sample sums


def sample_rows(t: torch.Tensor) -> torch.Tensor:
    """View ``t [B, ..., C]`` as ``[B, R, C]``: the sample axis first, the rows of a sample (all
    middle axes, row-major) second. A 2-D ``[B, C]`` tensor has one row per sample."""
    if t.dim() == 1:
        return t.reshape(1, 1, -1)
    return t.reshape(t.shape[0], -1, t.shape[-1])


def live_rows(t2: torch.Tensor) -> int:
    """The rows of one sample that take part in its gradient reductions: ``t2 [R, C]`` up to and
    including the last row with an element that is not ±0 (NaN counts as nonzero). Trailing
    zero-gradient rows — padded prompt rows — are dropped, so a padded sample reduces exactly the
    rows of the unpadded one (same blocks, segments and ±0 signs)."""
    nz = (t2 != 0).any(dim=1).nonzero()
    return int(nz[-1, 0]) + 1 if nz.numel() else 0


def rows_partial(t2: torch.Tensor, spans) -> torch.Tensor | None:
    """Contract-v2 partial of a sum over rows: ``t2 [R, C]``, ``spans`` row segments (coordinates
    of t2, power-of-two list); each 64-row block summed by the pairwise ``tree_sum``, the blocks of
    a segment added sequentially, the segments by ``tree_finish``. What an SP rank computes from
    its rows (``spans = local_spans(shard_spans(row_segment_spans(R), T, rank))``). [C] or None."""
    return segmented_sum(spans, lambda a, b: tree_sum(t2[a:b], dim=0))


def row_sum(t: torch.Tensor) -> torch.Tensor:
    """Per-sample sum over rows: ``[B, ..., C] → [B, C]`` FP32, contract v2 over the sample's
    live rows (``live_rows``: trailing zero rows dropped; none live → +0). The gradient of a
    per-sample input (shift, scale, gate) and, summed over samples, of a bias or gain."""
    t3 = sample_rows(t)
    out = torch.zeros(t3.shape[0], t3.shape[2], dtype=t3.dtype, device=t3.device)
    for i in range(t3.shape[0]):
        r = live_rows(t3[i])
        part = rows_partial(t3[i, :r], row_segment_spans(r))
        if part is not None:
            out[i] = part
    return out


def sample_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over the sample axis ``[B, ...] → [...]`` with the pairwise tree, in batch order
    (the same bytes as ``tree_sum_stack`` of the B slices)."""
    return tree_sum(t, dim=0)


# ----------------------------------------------------------------------------- GEMM gradients


def linear_input_grad(dy: torch.Tensor, w: torch.Tensor, weight_shape=None) -> torch.Tensor:
    """dX = dY · W for ``y = x·Wᵀ``: dy ``[..., N]``, w ``[N, K]`` → ``[..., K]`` FP32.

    ``tiled_linear`` with the transposed weight: contract v2 over N (8 segments by halving, 64-
    chunks sequential, depth-3 tree), the kernel chosen from the weight's shape alone
    (``weight_shape``, default w.shape; a TP rank passes the unsharded one), so each row's bytes
    are independent of the other rows. A column-parallel TP rank holding W[N-shard] computes its
    subtree with ``strict_gemm.linear_partial(dy_shard, w_shard.t(), spans, exact=…)``.
    """
    return tiled_linear(dy, w.t(), weight_shape=weight_shape or tuple(w.shape))


def _pad_cols(t: torch.Tensor, tile: int) -> torch.Tensor:
    pad = -t.shape[1] % tile
    return torch.nn.functional.pad(t, (0, pad)) if pad else t


def _outer_chunks(dy: torch.Tensor, x: torch.Tensor, exact: bool):
    """block_partial(a, b) = Σ_{r∈[a,b)} dy[r] ⊗ x[r] for dy ``[R, N]``, x ``[R, K]``.

    Exact: every element the pairwise tree over the block's rows of correctly rounded products
    → [N, K]. Tiled: N and K zero-padded to tiles of 128, one batched matmul with members
    [128, c] @ [c, 128] (c = b − a ≤ 64 rows; c = 1 the correctly rounded outer product) in tile
    layout [N/128, K/128, 128, 128], so N and K shards of the weight (TP) give the same bytes.
    """
    n, k = dy.shape[1], x.shape[1]
    if exact:
        def block(a: int, b: int) -> torch.Tensor:
            out = torch.empty(n, k, dtype=torch.float32, device=dy.device)
            step = max(1, _EXACT_BLOCK // max(1, (b - a) * k))
            for i in range(0, n, step):
                out[i : i + step] = tree_sum(dy[a:b, i : i + step, None] * x[a:b, None, :], dim=0)
            return out
        return block
    dyp, xp = _pad_cols(dy, N_TILE), _pad_cols(x, N_TILE)  # [R, Np], [R, Kp]

    def block(a: int, b: int) -> torch.Tensor:
        c = b - a
        dyt = dyp[a:b].t().reshape(-1, 1, N_TILE, c)  # [Nt, 1, 128, c]
        xt = xp[a:b].reshape(c, -1, N_TILE).transpose(0, 1).unsqueeze(0)  # [1, Kt, c, 128]
        return dyt * xt if c == 1 else torch.matmul(dyt, xt)  # [Nt, Kt, 128, 128]

    return block


def outer_partial(dy2: torch.Tensor, x2: torch.Tensor, spans, *, exact: bool) -> torch.Tensor | None:
    """Contract-v2 partial of Σ_r dy2[r] ⊗ x2[r] over the row segments ``spans`` (coordinates of
    the given rows; a power-of-two list): 64-row blocks (``_outer_chunks``), blocks of a segment
    added sequentially, segments by ``tree_finish``. What an SP rank computes from its rows of
    one sample; ``exact`` from ``linear_is_exact`` of the unsharded weight.

    Args:
        dy2: [R, N] FP32.  x2: [R, K] FP32.
    Returns:
        [N, K] FP32, or None when every segment is empty.
    """
    n, k = dy2.shape[1], x2.shape[1]
    if all(lo == hi for lo, hi in spans):
        return None  # a rank whose segments are all empty (a short sample)
    y = segmented_sum(spans, _outer_chunks(dy2, x2, exact))
    if y is None or exact:
        return y
    return y.permute(0, 2, 1, 3).reshape(y.shape[0] * N_TILE, y.shape[1] * N_TILE)[:n, :k]


def sample_weight_grads(dy: torch.Tensor, x: torch.Tensor, weight_shape=None) -> list[torch.Tensor]:
    """The per-sample partials of ``weight_grad``, one ``[N, K]`` FP32 tensor per batch row, in
    batch order: each over the sample's live rows by contract v2 (no live row → +0)."""
    dy3, x3 = sample_rows(dy), sample_rows(x)
    n, k = dy3.shape[-1], x3.shape[-1]
    exact = linear_is_exact(*(weight_shape or (n, k)))
    out = []
    for i in range(dy3.shape[0]):
        r = live_rows(dy3[i])
        part = outer_partial(dy3[i, :r], x3[i, :r], row_segment_spans(r), exact=exact)
        out.append(torch.zeros(n, k, dtype=torch.float32, device=dy.device) if part is None else part)
    return out


def weight_grad(dy: torch.Tensor, x: torch.Tensor, weight_shape=None) -> torch.Tensor:
    """dW = Σ over logical rows of dy ⊗ x for ``y = x·Wᵀ``: dy ``[B, ..., N]``, x ``[B, ..., K]``
    → ``[N, K]`` FP32.

    Per sample: its live rows (``live_rows`` of dy: trailing zero-gradient rows dropped) by
    contract v2 (``outer_partial`` over ``row_segment_spans``; no live row → +0); then over the
    samples in batch order by the pairwise tree (``TreeAccumulator``). The kernel follows the
    weight-shape rule of the forward (``weight_shape``, default [N, K]).
    """
    acc = TreeAccumulator()
    for part in sample_weight_grads(dy, x, weight_shape):
        acc.add(part)
    return acc.result()


Sink = Callable[..., None]
"""``sink(dy, x, partials=None)``: the output gradient ``[B, ..., N]`` and input ``[B, ..., K]``
of one GEMM backward of the weight (one batch row per logical sample and branch). ``partials``:
the backward family's own per-sample partials ``partials(dy, x) -> [B, N, K]`` FP32 — the strict
CUDA backward passes its ``sample_weight_grads`` (contract ``grad.cuda1``); None (the CPU family)
means contract v2's ``sample_weight_grads`` of this module."""

_SINKS: dict[tuple, Sink] = {}


def sink_key(w: torch.Tensor) -> tuple:
    """A weight's storage, offset, shape and strides: the same for the tensor and its
    ``detach()``-ed aliases (activation checkpointing unpacks recomputed tensors detached)."""
    return (w.device, w.untyped_storage().data_ptr(), w.storage_offset(), tuple(w.shape), tuple(w.stride()))


def attach_grad_sink(w: torch.Tensor, sink: Sink) -> tuple:
    """Collect ``w``'s weight gradient per logical sample: the strict GEMM backward hands its
    ``(dy, x)`` to ``sink`` instead of reducing them (``training.ledger`` builds the per-sample
    partials, ``sample_weight_grads``, with what it knows of the layout).
    Returns the key for ``detach_grad_sinks``. The weight must stay alive while its backward
    runs (a saved tensor does); a later weight on the same storage replaces the entry."""
    key = sink_key(w)
    _SINKS[key] = sink
    return key


def detach_grad_sinks(keys) -> None:
    """Forget the sinks attached under ``keys`` (``attach_grad_sink``'s returns)."""
    for key in keys:
        _SINKS.pop(key, None)


def grad_sink(w: torch.Tensor | None):
    """The per-sample gradient sink attached to the weight ``w`` (``attach_grad_sink``), or None."""
    if w is None or not _SINKS:
        return None
    return _SINKS.get(sink_key(w))


def weight_grad_or_sink(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor | None:
    """``weight_grad(dy, x)``, or — when the weight ``w`` carries a sink (``grad_sink``) —
    ``(dy, x)`` handed to the sink and None returned (the canonical gradient reduction over
    logical samples, branches and steps happens there, not in autograd)."""
    sink = grad_sink(w)
    if sink is None:
        return weight_grad(dy, x)
    sink(dy, x)
    return None


def linear_grads(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor | None,
                 needs: tuple[bool, bool, bool]):
    """(dx, dw, db) of ``y = x·Wᵀ + b`` in FP32, each only where ``needs`` asks (else None)."""
    dx = linear_input_grad(dy, w) if needs[0] else None
    dw = weight_grad_or_sink(dy, x, w) if needs[1] else None
    db = sample_sum(row_sum(dy)) if needs[2] else None
    return dx, dw, db


# ----------------------------------------------------------------------------- norms


def layer_norm_grad(g: torch.Tensor, xhat: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """dx of xhat = (x − mean)·rstd over the last axis D, given g = dL/dxhat (FP32):
    dx = rstd·((g − Σg/D) − xhat·(Σ(g·xhat)/D)), both sums the pairwise tree over D."""
    d = g.shape[-1]
    a = tree_sum(g) / d
    c = tree_sum(g * xhat) / d
    return rstd.unsqueeze(-1) * ((g - a.unsqueeze(-1)) - xhat * c.unsqueeze(-1))


def rms_norm_grad(g: torch.Tensor, xhat: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """dx of xhat = x·rstd, rstd = 1/√(mean(x²) + eps), given g = dL/dxhat (FP32):
    dx = rstd·(g − xhat·(Σ(g·xhat)/D)), the sum the pairwise tree over D."""
    c = tree_sum(g * xhat) / g.shape[-1]
    return rstd.unsqueeze(-1) * (g - xhat * c.unsqueeze(-1))


# ----------------------------------------------------------------------------- transcendentals
# Derivatives in FP64 from exact operations (``exp64``/``tanh64``), rounded once to FP32.


def silu_grad64(x: torch.Tensor) -> torch.Tensor:
    """SiLU'(x) = σ(x)·(1 + x·(1 − σ(x))), σ(x) = 1/(1 + exp(−x)), FP64."""
    x = x.to(torch.float64)
    sig = 1.0 / (1.0 + exp64(-x))
    return sig * (1.0 + x * (1.0 - sig))


_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_A = 0.044715


def gelu_tanh_grad64(x: torch.Tensor) -> torch.Tensor:
    """d/dx of ½x(1 + tanh(u)), u = √(2/π)(x + 0.044715x³), FP64:
    ½(1 + t) + (½x)·((1 − t²)·(√(2/π)·(1 + 3·0.044715·x²))), t = tanh(u)."""
    x = x.to(torch.float64)
    t = tanh64(_GELU_C * (x + _GELU_A * (x * x * x)))
    du = _GELU_C * (1.0 + (3.0 * _GELU_A) * (x * x))
    return 0.5 * (1.0 + t) + (0.5 * x) * ((1.0 - t * t) * du)


def silu_grad32(x: torch.Tensor) -> torch.Tensor:
    """SiLU'(x) rounded once to FP32."""
    return pointwise32(silu_grad64, x)


def gelu_tanh_grad32(x: torch.Tensor) -> torch.Tensor:
    """tanh-GELU'(x) rounded once to FP32."""
    return pointwise32(gelu_tanh_grad64, x)


# ----------------------------------------------------------------------------- casts


def g32(t: torch.Tensor) -> torch.Tensor:
    """An incoming output gradient as contiguous FP32 (bf16 upcasts exactly)."""
    return t.contiguous().to(torch.float32)


def cast_like(g: torch.Tensor | None, like: torch.Tensor | None) -> torch.Tensor | None:
    """The declared gradient boundary: one cast from FP32 to the input's dtype."""
    if g is None or like is None:
        return None
    return g.to(like.dtype)
