"""Strict backward primitives: fixed-order input and parameter gradients built from the strict
forward primitives (``tree_sum``, ``exact_matmul`` / ``tiled_linear``, exact-op transcendentals).

    >>> dx = linear_input_grad(dy, w)            # [..., N] @ [N, K] → [..., K], row-invariant
    >>> dw = weight_grad(dy, x)                  # per sample over its rows, then over samples: [N, K]
    >>> db = sample_sum(row_sum(dy))             # [N]

Two kinds of gradient, two orders (docs/strict-arithmetic.md, "Backward"):

* **Per-row gradients** (dX, and the gradient of every per-sample input such as shift, scale,
  gate, temb) reduce only over the row's own axis (N of a GEMM output, D of a norm, keys of
  attention), with the forward's kernels: a row's bytes do not depend on its batch companions,
  its position, or the row count.
* **Parameter gradients** (dW, db, norm gains) reduce over the logical rows of the whole batch
  in a two-level pairwise tree: first per sample over that sample's rows in ascending row order
  (``row_sum`` / ``_sample_outer_sum``), then over the samples in batch order (``sample_sum`` /
  ``TreeAccumulator``). Consequences, tested in tests/ops/test_backward.py: the bytes are the
  same for the same samples in the same order however the batch is split into aligned
  power-of-two microbatches that are then combined with ``tree_sum_stack`` (in particular, the
  per-sample partial of a sample does not depend on its companions), and trailing zero-gradient
  rows (prompt padding) change nothing; swapping the aligned halves of any power-of-two block of
  samples (a tree automorphism) changes nothing either. Other reorderings of the samples, or of
  the rows within a sample, change the bytes: floating-point addition is not associative, and the
  order is the order the rows are presented in (the model presents samples in ascending logical
  id).

All functions take and return FP32; callers cast each gradient once to its input's dtype.
"""

from __future__ import annotations

import math

import torch

from drifttool.ops.strict_math import (  # noqa: F401  (TreeAccumulator re-exported)
    EXACT_MAX_WEIGHT,
    _EXACT_BLOCK,
    TreeAccumulator,
    _pad_rows,
    exp64,
    pointwise32,
    tanh64,
    tiled_linear,
    tree_sum,
)

GRAD_ROW_CHUNK = 128
"""Rows per fixed-shape matmul member of a tiled weight gradient ([N, 128] @ [128, K])."""

# ----------------------------------------------------------------------------- row and sample sums


def sample_rows(t: torch.Tensor) -> torch.Tensor:
    """View ``t [B, ..., C]`` as ``[B, R, C]``: the sample axis first, the rows of a sample (all
    middle axes, row-major) second. A 2-D ``[B, C]`` tensor has one row per sample."""
    if t.dim() == 1:
        return t.reshape(1, 1, -1)
    return t.reshape(t.shape[0], -1, t.shape[-1])


def row_sum(t: torch.Tensor) -> torch.Tensor:
    """Per-sample sum over rows: ``[B, ..., C] → [B, C]``, pairwise tree over the sample's rows
    in ascending order. The gradient of a per-sample input (shift, scale, gate)."""
    return tree_sum(sample_rows(t), dim=1)


def sample_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over the sample axis ``[B, ...] → [...]`` with the pairwise tree, in batch order
    (the same bytes as ``tree_sum_stack`` of the B slices)."""
    return tree_sum(t, dim=0)


# ----------------------------------------------------------------------------- GEMM gradients


def linear_input_grad(dy: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """dX = dY · W for ``y = x·Wᵀ``: dy ``[..., N]``, w ``[N, K]`` → ``[..., K]`` FP32.

    ``tiled_linear`` with the transposed weight: the kernel is chosen from the weight's shape
    alone (N·K ≤ 65536 → exact products summed by the pairwise tree over N, portable bytes;
    otherwise 16-row tiles over 128-wide chunks of N summed by the tree), so each row's bytes are
    independent of the other rows.
    """
    return tiled_linear(dy, w.t())


def _sample_outer_sum(dy: torch.Tensor, x: torch.Tensor, exact: bool) -> torch.Tensor:
    """Σ_r dy[r] ⊗ x[r] for one sample: dy ``[R, N]``, x ``[R, K]`` → ``[N, K]`` FP32.

    R = 1: the correctly rounded products themselves. Exact: every element the pairwise tree over
    the R rows of correctly rounded products. Tiled: rows zero-padded to chunks of 128, one
    fixed-shape matmul [N, 128] @ [128, K] per chunk, chunk partials summed by the pairwise tree.
    All three agree for R = 1 (zero rows add nothing), so a prompt padded from 1 to more rows
    keeps its bytes.
    """
    r, n = dy.shape
    k = x.shape[1]
    if r == 1:
        return dy[0, :, None] * x[0, None, :]
    if exact:
        out = torch.empty(n, k, dtype=torch.float32, device=dy.device)
        step = max(1, _EXACT_BLOCK // max(1, r * k))
        for i in range(0, n, step):
            out[i : i + step] = tree_sum(dy[:, i : i + step, None] * x[:, None, :], dim=0)
        return out
    dy, _ = _pad_rows(dy, GRAD_ROW_CHUNK)
    x, _ = _pad_rows(x, GRAD_ROW_CHUNK)
    acc = TreeAccumulator()
    for c in range(0, dy.shape[0], GRAD_ROW_CHUNK):
        acc.add(torch.mm(dy[c : c + GRAD_ROW_CHUNK].t(), x[c : c + GRAD_ROW_CHUNK]))  # [N, K]
    return acc.result()


def weight_grad(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dW = Σ over logical rows of dy ⊗ x for ``y = x·Wᵀ``: dy ``[B, ..., N]``, x ``[B, ..., K]``
    → ``[N, K]`` FP32.

    Two-level pairwise tree: per sample over its rows in ascending order (``_sample_outer_sum``;
    exact products when N·K ≤ 65536, the weight-shape rule of the forward, else 128-row matmul
    chunks), then over the samples in batch order (``TreeAccumulator``).
    """
    dy3, x3 = sample_rows(dy), sample_rows(x)
    exact = dy3.shape[-1] * x3.shape[-1] <= EXACT_MAX_WEIGHT
    acc = TreeAccumulator()
    for b in range(dy3.shape[0]):
        acc.add(_sample_outer_sum(dy3[b], x3[b], exact))
    return acc.result()


def linear_grads(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, needs: tuple[bool, bool, bool]):
    """(dx, dw, db) of ``y = x·Wᵀ + b`` in FP32, each only where ``needs`` asks (else None)."""
    dx = linear_input_grad(dy, w) if needs[0] else None
    dw = weight_grad(dy, x) if needs[1] else None
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
