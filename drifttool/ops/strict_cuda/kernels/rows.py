"""The conventions and shared pieces of the strict CUDA family's row kernels (contract ``cuda1``):
``kernels.latent`` (latent pack/unpack and normalize), ``kernels.elementwise`` (the gate residual,
RoPE), ``kernels.norms`` (the RMS norms and the AdaLN LayerNorm) and ``kernels.sampler``.

Every kernel does the strict CPU family's arithmetic (``drifttool.ops.strict``) in the same order,
so its bytes equal the CPU's:

* elementwise work is one IEEE FP32 operation per step, in the CPU's written order, launched with
  ``enable_fp_fusion=False`` (no FMA contraction: each product is rounded before its sum), FP32
  divisions by ``tl.div_rn`` (correctly rounded; Triton's ``/`` on FP32 is not);
* a row reduction (over d, Dh or Dj) zero-pads the row to the next power of two P and adds it by
  the canonical pairwise tree of ``strict_trees.tree_sum``: adjacent pairs (element 2i + element
  2i+1), level after level, until one element is left (``_pair_tree``). Short rows (P ≤
  ``SHORT_ROW``) are held whole by one program; a long row is one program's, summed as aligned
  subtrees: octets of leaves added elementwise from stride-8 loads, the tree over a tile's octet
  sums, then over the tile sums (``kernels.norms``, "long rows") — the same additions. The tree
  depends on the row length alone; padded lanes are +0 and are made +0 again before
  every sum that follows an operation on them;
* mean = sum ÷ D (FP32, correctly rounded); rstd = 1 ÷ sqrt(var + eps) in FP64 (eps an FP64
  value, sqrt and division correctly rounded), rounded once to FP32;
* inputs are widened to FP32 in the kernel and the output is cast once (round to nearest even).

A program owns ``ROWS`` whole rows (a fixed constexpr per operator); no reduction crosses rows,
so a row's bytes depend on its own inputs only, never on the batch, position or launch geometry
(``rows_per_program`` overrides ``ROWS`` for tests that prove it).

Wrappers take and return torch tensors on any device (outputs on the input's device), so
``TRITON_INTERPRET=1`` runs them on CPU tensors.
"""

from __future__ import annotations

import triton
import triton.language as tl

ELEMENTS = 1024
"""Elements per program of the elementwise kernels."""

MAX_ROW = 16384
"""Longest reduced row held in one program's registers (d = 3072, Dj = 3584, Dh = 128 fit)."""


def _launch(kernel, grid, *args, **meta):
    kernel[grid](*args, enable_fp_fusion=False, **meta)


def pow2(n: int) -> int:
    """The next power of two ≥ n (≥ 1): the padded width P of the pairwise tree."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@triton.jit
def _pair_tree(x, LOG2: tl.constexpr):
    """Pairwise tree over axis 1 of ``x`` [R, 2**LOG2] → [R]: adjacent pairs, level by level
    (``strict_trees.tree_sum``'s order)."""
    for _ in tl.static_range(LOG2):
        a, b = tl.split(tl.reshape(x, (x.shape[0], x.shape[1] // 2, 2)))
        x = a + b
    return tl.reshape(x, (x.shape[0],))

