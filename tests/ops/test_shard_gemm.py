"""CPU simulations of TP/SP sharded strict GEMMs (strict contract v2, docs/strict-arithmetic.md).

Each test splits an operand the way a rank would hold it, computes the per-rank partial with the
public contract-v2 pieces (``segment_spans``/``row_segment_spans``, ``shard_spans``,
``linear_partial``/``outer_partial``/``rows_partial``), finishes the tree over the rank partials
as the owner would (``tree_finish``), and compares raw bytes with the unsharded strict operator:

* TP row-parallel (K split into T ∈ {2, 4, 8}) for K ∈ {3072, 12288, 3584, 64}, forward, and the
  dX reduction over N of the backward (column-parallel backward);
* TP column-parallel (N split into T): concatenated outputs, dW row blocks and db;
* SP rows: the weight/bias gradient of a sample whose rows are split on segment boundaries
  (6889 rows = 108 blocks, unequal segments; a 130-row and a 5-row sample);
* trailing zero-gradient rows (prompt padding) across several 64-row blocks, including −0.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import drifttool.ops  # noqa: F401
from drifttool.errors import UnsupportedConfigError
from drifttool.ops.strict import grad
from drifttool.ops.strict_gemm import (
    column_shard_spans, finish_linear, linear_is_exact, linear_partial, tiled_linear,
)
from drifttool.ops.strict_math import gelu_tanh32
from drifttool.ops.strict_trees import (
    halving_spans, local_spans, row_segment_spans, segment_spans, shard_spans, tree_finish,
)
from tests.conftest import assert_same_bytes
from tests.harness import Target, targets

WIDTHS = (3072, 12288, 3584, 64)  # every Qwen-Image GEMM reduction width
SHARDS = (2, 4, 8)
STRICT = targets("strict")
"""The unsharded strict operators the simulations must equal, per strict target (``strict-cpu``;
``strict-cuda`` once registered): the simulations define what a strict CUDA family reproduces."""


def _rn(g: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * scale


def _n_for(k: int, exact: bool) -> int:
    """An output width giving the exact (N·K ≤ 65536) or the tiled kernel for reduction width k."""
    n = 3 if exact else 65536 // k + 7
    assert linear_is_exact(n, k) == exact
    return n


def _rank_spans(length: int, shards: int, rank: int, rows: bool = False):
    """(lo, hi, spans inside the shard) of a rank's part of a reduction axis."""
    spans = shard_spans(row_segment_spans(length) if rows else segment_spans(length), shards, rank)
    return spans[0][0], spans[-1][1], local_spans(spans)


def _op_grads(op: str, x, w, b, gy, target: Target):
    """(y, dx, dw, db) of ``target``'s strict operator ``op`` (x [1, M, K] FP32) under ``gy``,
    on the CPU (``Target.fn``)."""
    x, w, b = (t.detach().clone().requires_grad_(True) for t in (x, w, b))
    y = target.fn(op)(x, w, b)
    return (y.detach(), *torch.autograd.grad(y, [x, w, b], gy))


# ----------------------------------------------------------------------------- the trees


def test_segment_spans_are_subtrees_of_every_tp_shard():
    """Every Qwen-Image width splits into 8 equal segments; each TP shard is 8/T whole segments;
    short axes give empty segments; the halving rule is lo + ceil((hi − lo)/2)."""
    for k in WIDTHS:
        spans = segment_spans(k)
        assert [hi - lo for lo, hi in spans] == [k // 8] * 8
        for t in SHARDS:
            ranges = [_rank_spans(k, t, r)[:2] for r in range(t)]
            assert ranges == [(r * k // t, (r + 1) * k // t) for r in range(t)], (k, t)
    assert halving_spans(5) == [(0, 1), (1, 2), (2, 3), (3, 3), (3, 4), (4, 4), (4, 5), (5, 5)]
    assert [hi - lo for lo, hi in halving_spans(108)] == [14, 13] * 4
    assert row_segment_spans(6889)[-1] == (6080, 6889) and row_segment_spans(5)[1:] == [(5, 5)] * 7
    with pytest.raises(UnsupportedConfigError, match="3 shards"):
        shard_spans(segment_spans(3072), 3, 0)


def _pairwise(v: list[float]) -> float:
    """Reference pairwise tree on FP32 scalars (zero-padded to a power of two)."""
    v = [torch.tensor(a, dtype=torch.float32) for a in v]
    while len(v) & (len(v) - 1):
        v.append(torch.tensor(0.0))
    while len(v) > 1:
        v = [v[i] + v[i + 1] for i in range(0, len(v), 2)]
    return v[0]


def test_exact_kernel_follows_the_documented_order():
    """An independent scalar implementation of contract v2 (segments by halving, 64-chunks, pairwise
    tree inside a chunk, chunks sequential, ((s0+s1)+(s2+s3))+((s4+s5)+(s6+s7)), empty segments
    absent, bias last) gives the exact kernel's bytes for K = 133 and K = 5."""
    g = torch.Generator().manual_seed(3)
    for k in (133, 5):
        x, w, b = _rn(g, 2, k), _rn(g, 3, k), _rn(g, 3)
        got = tiled_linear(x, w, b)
        for i in range(2):
            for j in range(3):
                prods = (x[i] * w[j]).tolist()  # correctly rounded FP32 products
                segs = []
                for lo, hi in halving_spans(k):
                    acc = None
                    for a in range(lo, hi, 64):
                        c = _pairwise(prods[a : min(a + 64, hi)])
                        acc = c if acc is None else acc + c
                    segs.append(acc)
                while len(segs) > 1:
                    segs = [p if q is None else q if p is None else p + q for p, q in zip(segs[::2], segs[1::2])]
                want = segs[0] + b[j]
                assert got[i, j].view(torch.int32) == want.view(torch.int32), (k, i, j)


# ----------------------------------------------------------------------------- TP row-parallel


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "tiled"])
@pytest.mark.parametrize("k", WIDTHS)
@pytest.mark.parametrize("target", STRICT)
def test_tp_row_parallel_forward(k, exact, target):
    """K split into T shards: each rank's ``linear_partial`` of its K shard, finished by the tree
    over ranks plus the bias, is byte-equal to the strict ``mlp_down_gemm`` (M = 5)."""
    g = torch.Generator().manual_seed(k + exact)
    n = _n_for(k, exact)
    x, w, b = _rn(g, 1, 5, k), _rn(g, n, k, scale=k ** -0.5), _rn(g, n)
    want = target.fn("mlp_down_gemm")(x, w, b)[0]
    for t in SHARDS:
        parts = []
        for r in range(t):
            lo, hi, spans = _rank_spans(k, t, r)
            parts.append(linear_partial(x[0, :, lo:hi], w[:, lo:hi], spans, exact=linear_is_exact(n, k)))
        assert_same_bytes(finish_linear(parts, b, (5, n)), want, f"K={k} TP{t} row-parallel forward")
        if t == 4:  # control: adding the rank partials sequentially is not the contract's tree
            seq = ((parts[0] + parts[1]) + parts[2]) + parts[3] + b
            assert not torch.equal(seq.view(torch.int32), want.view(torch.int32)), "control"


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "tiled"])
@pytest.mark.parametrize("n", WIDTHS)
@pytest.mark.parametrize("target", STRICT)
def test_tp_backward_dx_reduction_over_n(n, exact, target):
    """dX = dY·W reduces over N: a column-parallel rank holding W[N-shard] and dY[:, N-shard]
    computes its subtree; the finished tree equals the strict operator's dX bytes. The same
    ranks' dX of a row-parallel layer (W[:, K-shard]) are the unsharded dX columns."""
    g = torch.Generator().manual_seed(n + 7 * exact)
    k = _n_for(n, exact)
    x, w, b = _rn(g, 1, 5, k), _rn(g, n, k, scale=k ** -0.5), _rn(g, n)
    gy = _rn(g, 1, 5, n)
    _, dx, dw, _ = _op_grads("latent_proj_gemm", x, w, b, gy, target)
    for t in SHARDS:
        parts = []
        for r in range(t):
            lo, hi, spans = _rank_spans(n, t, r)
            parts.append(linear_partial(gy[0, :, lo:hi], w[lo:hi].t(), spans, exact=linear_is_exact(n, k)))
        assert_same_bytes(finish_linear(parts, None, (5, k)), dx[0], f"N={n} TP{t} dX over N")


@pytest.mark.parametrize("t", SHARDS)
@pytest.mark.parametrize("target", STRICT)
def test_tp_row_parallel_backward_shards(t, target):
    """Row-parallel layer (W[:, K-shard] on each rank, tiled kernel): each rank's dX columns
    (``linear_input_grad`` with the unsharded weight shape) and dW columns equal the unsharded
    strict operator's, byte for byte."""
    g = torch.Generator().manual_seed(40 + t)
    n, k = 40, 3072
    x, w, b = _rn(g, 1, 5, k), _rn(g, n, k, scale=k ** -0.5), _rn(g, n)
    gy = _rn(g, 1, 5, n)
    _, dx, dw, _ = _op_grads("attn_out_bias_gemm", x, w, b, gy, target)
    for r in range(t):
        lo, hi, _ = _rank_spans(k, t, r)
        dx_r = grad.linear_input_grad(gy, w[:, lo:hi], weight_shape=(n, k))
        dw_r = grad.weight_grad(gy, x[..., lo:hi], weight_shape=(n, k))
        assert_same_bytes(dx_r, dx[..., lo:hi], f"TP{t} rank {r} dX columns")
        assert_same_bytes(dw_r, dw[:, lo:hi], f"TP{t} rank {r} dW columns")


# ----------------------------------------------------------------------------- TP column-parallel


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "tiled"])
@pytest.mark.parametrize("target", STRICT)
def test_tp_column_parallel_forward_and_backward(exact, target):
    """N split into T shards (tiled: widths multiples of 128): each rank's output columns, dW rows
    and db, computed with the unsharded weight shape's kernel, concatenate to the unsharded strict
    ``mlp_up_gemm_gelu`` output and gradients."""
    g = torch.Generator().manual_seed(77 + exact)
    n, k = (16, 64) if exact else (1024, 3072)
    assert linear_is_exact(n, k) == exact
    x, w, b = _rn(g, 1, 5, k), _rn(g, n, k, scale=k ** -0.5), _rn(g, n)
    gy = _rn(g, 1, 5, n)
    y, dx, dw, db = _op_grads("mlp_up_gemm_gelu", x, w, b, gy, target)
    for t in SHARDS:
        ys, dws, dbs, dx_parts = [], [], [], []
        for r, (lo, hi) in enumerate(column_shard_spans(n, k, t)):
            pre = tiled_linear(x, w[lo:hi], b[lo:hi], weight_shape=(n, k))
            ys.append(gelu_tanh32(pre))
            dpre = gy[..., lo:hi] * grad.gelu_tanh_grad32(pre)
            dws.append(grad.weight_grad(dpre, x, weight_shape=(n, k)))
            dbs.append(grad.sample_sum(grad.row_sum(dpre)))
            slo, shi, spans = _rank_spans(n, t, r)
            assert (slo, shi) == (lo, hi)
            dx_parts.append(linear_partial(dpre[0], w[lo:hi].t(), spans, exact=exact))
        what = f"{'exact' if exact else 'tiled'} N={n} TP{t} column-parallel"
        assert_same_bytes(torch.cat(ys, -1), y, f"{what}: output")
        assert_same_bytes(torch.cat(dws, 0), dw, f"{what}: dW")
        assert_same_bytes(torch.cat(dbs, 0), db, f"{what}: db")
        assert_same_bytes(finish_linear(dx_parts, None, (5, k)), dx[0], f"{what}: dX over the N shards")


def test_column_shards_of_the_tiled_kernel_must_be_tile_aligned():
    assert column_shard_spans(3072 * 3, 3072, 8)[1] == (1152, 2304)
    with pytest.raises(UnsupportedConfigError, match="multiple of the 128-column tile"):
        column_shard_spans(1000, 3072, 2)
    with pytest.raises(UnsupportedConfigError, match="not divisible"):
        column_shard_spans(1001, 8, 2)
    assert column_shard_spans(24, 8, 8)[0] == (0, 3)  # exact kernel: any equal split


# ----------------------------------------------------------------------------- SP rows


@pytest.mark.parametrize("exact,rows", [
    (True, 6889), (True, 130), (True, 5), (False, 130), (False, 5),
    pytest.param(False, 6889, marks=pytest.mark.slow),  # ~10 s on the 2-core CI CPU
], ids=["exact-6889", "exact-130", "exact-5", "tiled-130", "tiled-5", "tiled-6889"])
@pytest.mark.parametrize("target", STRICT)
def test_sp_row_shards_reproduce_parameter_gradients(exact, rows, target):
    """A batch of 2 samples of ``rows`` rows; each sample's rows split on segment boundaries into
    T ∈ {2, 4, 8} SP shards (6889 rows = 108 blocks: segments of 14/13 blocks; 5 rows: one block,
    ranks with nothing). Per-rank dW and db partials, finished by the tree over ranks, then the
    pairwise tree over samples, equal the strict operator's dW and db bytes."""
    g = torch.Generator().manual_seed(rows + exact)
    n, k = (6, 10) if exact else (130, 520)
    assert linear_is_exact(n, k) == exact
    x, w, b = _rn(g, 2, rows, k), _rn(g, n, k, scale=k ** -0.5), _rn(g, n)
    gy = _rn(g, 2, rows, n)
    _, _, dw, db = _op_grads("latent_proj_gemm", x, w, b, gy, target)
    for t in SHARDS:
        dws, dbs = [], []
        for s in range(2):
            pw, pb = [], []
            for r in range(t):
                lo, hi, spans = _rank_spans(rows, t, r, rows=True)
                pw.append(grad.outer_partial(gy[s, lo:hi], x[s, lo:hi], spans, exact=exact))
                pb.append(grad.rows_partial(gy[s, lo:hi], spans))
            dws.append(tree_finish(pw))
            dbs.append(tree_finish(pb))
        assert_same_bytes(dws[0] + dws[1], dw, f"{rows} rows SP{t}: dW")
        assert_same_bytes(dbs[0] + dbs[1], db, f"{rows} rows SP{t}: db")


# ----------------------------------------------------------------------------- padding, ±0


def test_trailing_zero_rows_across_blocks_change_nothing_including_minus_zero():
    """320 valid rows (5 blocks) padded to 640 (10 blocks: other segments) with zero-gradient
    rows of garbage x: dW, db and d(shift) are byte-equal, exact and tiled, including a column
    whose valid exact sum is −0 (all its products −0: padding must not turn it into +0)."""
    g = torch.Generator().manual_seed(9)
    n, k, valid, pad = 40, 3072 // 2, 320, 320
    x = _rn(g, 1, valid, k)
    gy = _rn(g, 1, valid, n)
    gy[..., 3] = -0.0
    x[..., 5] = x[..., 5].abs() + 1  # products of column 3 with x[:, 5] are all −0
    xp = torch.cat([x, _rn(g, 1, pad, k, scale=5.0)], 1)
    gyp = torch.cat([gy, torch.zeros(1, pad, n)], 1)
    for exact, shape in ((True, (n, 64)), (False, (n, k))):
        a = grad.weight_grad(gy, x, weight_shape=shape)
        if exact:
            assert a[3, 5].item() == 0 and torch.signbit(a[3, 5]), "the planted −0"
        assert_same_bytes(grad.weight_grad(gyp, xp, weight_shape=shape), a,
                          f"{'exact' if exact else 'tiled'} dW with {pad} padded rows")
    assert torch.signbit(grad.row_sum(gy)[0, 3])
    assert_same_bytes(grad.row_sum(gyp), grad.row_sum(gy), "db / d(shift) with padded rows")
    # controls: without dropping the zero rows, the padded sample's trees differ
    full = grad.rows_partial(gyp[0], row_segment_spans(valid + pad))
    assert not torch.signbit(full[3]), "+0 padding rows would flip the −0"
    full = grad.outer_partial(gyp[0], xp[0], row_segment_spans(valid + pad), exact=False)
    assert not torch.equal(full.view(torch.int32), grad.weight_grad(gy, x).view(torch.int32))


# ----------------------------------------------------------------------------- dispatch


_PROBE = """
import hashlib, numpy as np, torch
from drifttool.ops.strict_gemm import tiled_linear
from drifttool.ops.strict import grad
rng = np.random.default_rng(1)  # numpy inputs: torch.randn itself depends on the dispatch
def rn(*s): return torch.from_numpy(rng.standard_normal(s, dtype=np.float32))
out = []
for n, k in ((17, 133), (40, 3072)):  # exact, tiled
    x, w, gy = rn(37, k), rn(n, k), rn(1, 37, n)
    out += [tiled_linear(x, w), grad.linear_input_grad(gy, w), grad.weight_grad(gy, x[None]), grad.row_sum(gy)]
print(hashlib.sha256(b"".join(t.contiguous().numpy().tobytes() for t in out)).hexdigest())
"""


@pytest.mark.slow
def test_gemm_kernels_do_not_depend_on_the_simd_dispatch():
    """The exact and tiled GEMM kernels and their gradients give the same bytes under
    ATEN_CPU_CAPABILITY=default, avx2 and avx512 (MKL picks its own kernels; on a host without
    AVX-512 torch falls back to avx2, which is still compared)."""
    digests = {}
    for cap in ("default", "avx2", "avx512"):
        env = dict(os.environ, ATEN_CPU_CAPABILITY=cap)
        res = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True)
        digests[cap] = res.stdout.strip()
    assert len(set(digests.values())) == 1, digests
