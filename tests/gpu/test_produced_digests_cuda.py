"""Row tables written by the kernels that produce an output (``capture.produced``) on a GPU: at
full width (6,889 + 3 rows, d = 3072 and 12,288) the strict GEMM's digesting epilogue, under
every launch configuration the operators use (the bf16 tile, the 128 × 128 tile with an FP32
output, the register-capped GELU, the FP32 tile with a merge), and the gate residual's, the
rotation's, the head-wise RMSNorm's and the modulated LayerNorm's digesting launches and the fused
attention's digesting epilogue write the row kernel's table of the same output (T, T', max, min, NaN/±inf counts; Σx²
within rounding), and the outputs' bytes are those of the launches without it; a captured strict
forward (eager L1 and L2, and replayed from a CUDA graph) files the same records with these tables
as with the row kernel alone, and launches the row kernel fewer times. Skipped without CUDA."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from drifttool.capture import gpu_rows, produced
from drifttool.capture.recorder import Recorder
from drifttool.model.config import tiny
from drifttool.model.graphs import GraphedForward
from drifttool.model.mmdit import MMDiT, random_init_
from drifttool.runtime import Runtime
from tests.conftest import assert_same_records

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _same_table(a, b) -> None:
    (ra, sa), (rb, sb) = gpu_rows.combine_splits(*a), gpu_rows.combine_splits(*b)
    assert torch.equal(ra, rb), "T, T' differ from the row kernel's"
    assert torch.equal(sa[:, 1:], sb[:, 1:]), "max, min or the non-finite count differ"
    fin = torch.isfinite(sa[:, 0])
    assert torch.equal(fin, torch.isfinite(sb[:, 0]))
    assert torch.allclose(sa[fin, 0], sb[fin, 0], rtol=1e-12, atol=0)


def _check_produced(plain: torch.Tensor, o: torch.Tensor, cols: int) -> None:
    """``o`` (a digesting launch's output) has ``plain``'s bytes, and its offered table of rows of
    ``cols`` elements is the row kernel's."""
    assert torch.equal(o.view(torch.uint8), plain.view(torch.uint8)), "the digest changed the output"
    flat = o.view(-1, cols)
    made = produced.table(flat)
    assert made is not None, "no table was offered"
    _same_table(made, gpu_rows.launch(flat, gpu_rows.TILE))


@pytest.mark.parametrize("n,k,kind", [(3072, 3072, "bf16"), (12288, 3072, "gelu"), (3072, 12288, "fp32_out"),
                                      (3072, 16, "merge"), (200, 96, "fp32_operand")])
def test_epilogue_tables_equal_the_row_kernels_at_full_width(n, k, kind):
    from drifttool.ops.strict_cuda.kernels import gemm

    g = torch.Generator().manual_seed(n + k)
    m = 6889 + 3
    x = torch.randn(m, k, generator=g).bfloat16().cuda()
    w = (torch.randn(n, k, generator=g) / math.sqrt(k)).bfloat16().cuda()
    b = torch.randn(n, generator=g).bfloat16().cuda()
    kw = dict(out_dtype=torch.bfloat16)
    if kind == "gelu":
        kw.update(act="gelu_tanh_f32", config=gemm.GemmConfig(maxnreg=128))
    elif kind == "fp32_out":
        kw.update(out_dtype=torch.float32)
    elif kind == "merge":
        x, w = x.float(), w.float()
        kw.update(merge_into=torch.randn(m, n, generator=g).cuda(), scale=0.5, act="gelu_tanh_f32")
    elif kind == "fp32_operand":
        w = w.float()
        b[:3] = torch.tensor([float("nan"), float("inf"), -0.0])
    plain = gemm.linear(x, w, b, **kw)
    y = gemm.linear(x, w, b, digest=True, **kw)
    assert torch.equal(y.view(torch.uint8), plain.view(torch.uint8)), "the digest changed the output"
    made = produced.table(y)
    assert made is not None
    _same_table(made, gpu_rows.launch(y, gpu_rows.TILE))
    assert gpu_rows.row_table(y) is made


def test_gate_residual_tables_equal_the_row_kernels_at_full_width():
    from drifttool.ops.strict_cuda.kernels import elementwise

    g = torch.Generator().manual_seed(2)
    x, y = (torch.randn(2, 6889 + 3, 3072, generator=g).bfloat16().cuda() for _ in range(2))
    gate = torch.randn(2, 3072, generator=g).bfloat16().cuda()
    plain = elementwise.gate_residual(x, gate, y, torch.bfloat16)
    o = elementwise.gate_residual(x, gate, y, torch.bfloat16, digest=True)
    _check_produced(plain, o, 3072)


def test_rope_tables_equal_the_row_kernels_at_full_width():
    from drifttool.ops.strict_cuda.kernels import elementwise

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 6889 + 3, 24, 128, generator=g).bfloat16().cuda()
    freqs = torch.polar(torch.ones(6889 + 3, 64), torch.randn(6889 + 3, 64, generator=g)).cuda()
    plain = elementwise.rope(x, freqs)
    o = elementwise.rope(x, freqs, digest=True)
    _check_produced(plain, o, 24 * 128)


def test_head_rmsnorm_tables_equal_the_row_kernels_at_full_width():
    from drifttool.ops.strict_cuda.kernels import norms

    g = torch.Generator().manual_seed(4)
    x = (torch.randn(2, 6889 + 3, 24, 128, generator=g) * 3).bfloat16().cuda()
    gain = torch.randn(128, generator=g).bfloat16().cuda()
    plain = norms.rms_norm(x, gain, 1e-6, torch.bfloat16)
    o = norms.rms_norm(x, gain, 1e-6, torch.bfloat16, digest=True)
    _check_produced(plain, o, 24 * 128)


def test_layernorm_tables_equal_the_row_kernels_at_full_width():
    from drifttool.ops.strict_cuda.kernels import norms

    g = torch.Generator().manual_seed(5)
    x = (torch.randn(2, 6889 + 3, 3072, generator=g) * 2).bfloat16().cuda()
    mod = torch.randn(2, 6144, generator=g).bfloat16().cuda()
    plain = norms.ln_modulation(x, mod[:, :3072], mod[:, 3072:], 1e-6, torch.bfloat16)
    o = norms.ln_modulation(x, mod[:, :3072], mod[:, 3072:], 1e-6, torch.bfloat16, digest=True)
    _check_produced(plain, o, 3072)


def test_attention_tables_equal_the_row_kernels_at_full_width():
    from drifttool.ops.strict_cuda.kernels import attention
    from tests.strict_cuda_cases import joint

    q, k, v, km = joint([128, 77], 128, 6889, 24, 128, dtype=torch.bfloat16, seed=6, device="cuda")
    plain = attention.attention(q, k, v, km, text_len=128)
    o = attention.attention(q, k, v, km, text_len=128, digest=True)
    _check_produced(plain, o, 24 * 128)


@pytest.fixture(scope="module")
def model():
    return random_init_(MMDiT(tiny(), dtype=torch.bfloat16), seed=8).cuda()


def _records(model, level: str, graphed: bool, *, use_epilogue: bool, monkeypatch) -> tuple[list, int]:
    launches = [0]
    launch = gpu_rows.launch

    def counted(x, tile):
        launches[0] += 1
        return launch(x, tile)

    with monkeypatch.context() as m:
        m.setattr(gpu_rows, "launch", counted)
        if not use_epilogue:
            m.setattr(produced, "table", lambda x: None)
        # a graph's batched row kernel takes every output the producers would digest
        # (produced.batched): their tables in a graph are those of one without the batch
        fwd = GraphedForward(model, batch_digests=False) if graphed else model
        rec = Recorder(level)
        rt = Runtime(mode="strict", recorder=rec)
        with torch.no_grad():
            for step in range(3):
                g = torch.Generator().manual_seed(step)
                x = torch.randn(3, 35, 64, generator=g).bfloat16().cuda()
                txt = torch.randn(3, 11, tiny().joint_attention_dim, generator=g).bfloat16().cuda()
                mask = (torch.arange(11)[None, :] < torch.tensor([11, 6, 9])[:, None]).cuda()
                tau = torch.rand(3, generator=g).cuda()
                with rt.scope(phase="rollout", step=step, sigma=1.0 - step / 3, samples=[0, 1, 2],
                              txt_lens=[11, 6, 9], img_grid=(5, 7)):
                    fwd(x, txt, mask, tau, (5, 7), rt)
        rec.flush()
    rows = rec.ops_table().to_pylist()
    return rows, launches[0]


@pytest.mark.parametrize("level,graphed", [("L1", False), ("L2", False), ("L1", True)])
def test_captured_records_are_the_row_kernels(model, level, graphed, monkeypatch):
    with_tables, n_with = _records(model, level, graphed, use_epilogue=True, monkeypatch=monkeypatch)
    without, n_without = _records(model, level, graphed, use_epilogue=False, monkeypatch=monkeypatch)
    assert_same_records(with_tables, without, "producers' tables against the row kernel's")
    assert n_with < n_without, "no captured output took its table from the GEMM's epilogue"


@pytest.fixture(scope="module")
def wide_heads():
    """The tiny model with heads of 32 values (the internals launch declines Dh 16)."""
    cfg = replace(tiny(), attention_head_dim=32, axes_dims_rope=(8, 12, 12))
    return random_init_(MMDiT(cfg, dtype=torch.bfloat16), seed=8).cuda()


@pytest.mark.parametrize("graphed", [False, True])
def test_l2_internals_from_the_fused_kernels_tables_are_the_decompositions(wide_heads, graphed, monkeypatch):
    """At L2 the strict CUDA fused attention files its scores' and probabilities' records from the
    tables its second pass wrote (``Impl.internals``): the same records as running the
    decomposition, eager and replayed from a CUDA graph, and the scores are never stored."""
    from drifttool.ops import registry, sink
    from drifttool.ops.strict_cuda.kernels import attention

    monkeypatch.setattr(registry, "internals_from_tables", lambda rt: False)
    unfused, _ = _records(wide_heads, "L2", graphed, use_epilogue=True, monkeypatch=monkeypatch)
    monkeypatch.setattr(registry, "internals_from_tables", sink.internals_from_tables)

    def refused(*a, **k):
        raise AssertionError("the scores were stored")

    monkeypatch.setattr(attention, "scores", refused)
    fused, _ = _records(wide_heads, "L2", graphed, use_epilogue=True, monkeypatch=monkeypatch)
    assert_same_records(fused, unfused, "internals from the fused kernel's tables")


def _record_rows(x: torch.Tensor, b: int, keep: torch.Tensor) -> torch.Tensor:
    """Sample ``b``'s record of scores or probabilities ``x`` [B,H,Sq,S]: its kept query rows, each
    the heads' kept keys side by side (``B.SK``: per head the valid prompt keys, then the image's)."""
    xb = x[b].index_select(1, keep).index_select(2, keep)  # [H, R, Kv]
    return xb.permute(1, 0, 2).reshape(len(keep), -1)


def test_internals_launch_at_full_width_gives_the_fused_output_and_the_decompositions_tables():
    """The launch that digests the internals (8 warps) stores the registered launch's output bytes,
    and its scores' and probabilities' tables hold, on every row of their records, the row
    kernel's digest of those records as ``scores`` and ``softmax`` store them (a prompt padded on
    the right, one on both sides)."""
    from drifttool.ops.strict_cuda.kernels import attention
    from tests.strict_cuda_cases import joint

    L, n_img, t0, n = 128, 6889, [0, 30], [128, 77]
    q, k, v, km = joint([128, 128], L, n_img, 24, 128, dtype=torch.bfloat16, seed=7, device="cuda")
    slot = torch.arange(L, device="cuda")
    km[1, :L] = (slot >= t0[1]) & (slot < t0[1] + n[1])
    plain = attention.attention(q, k, v, km, text_len=L)
    o, s_table, p_table = attention.attention(q, k, v, km, text_len=L, internals=(t0, n))
    assert torch.equal(o.view(torch.uint8), plain.view(torch.uint8))
    sq = L + n_img
    assert s_table[0].shape == (24, 2 * sq, 2) and p_table[0].shape == s_table[0].shape
    x = attention.scores(q, k, text_len=L)
    p = attention.softmax(x, km, text_len=L)
    for name, table, full in (("scores", s_table, x), ("probabilities", p_table, p)):
        rows, stats = gpu_rows.combine_splits(*table)
        for b in range(2):
            keep = torch.cat([torch.arange(t0[b], t0[b] + n[b]), torch.arange(L, sq)]).cuda()
            want_rows, want_stats = gpu_rows.combine_splits(*gpu_rows.launch(_record_rows(full, b, keep),
                                                                             gpu_rows.TILE))
            got_rows, got_stats = rows[b * sq + keep], stats[b * sq + keep]
            assert torch.equal(got_rows, want_rows), f"{name}, sample {b}: T, T' differ"
            assert torch.equal(got_stats[:, 1:], want_stats[:, 1:]), f"{name}, sample {b}: max, min, counts"
            assert torch.allclose(got_stats[:, 0], want_stats[:, 0], rtol=1e-12, atol=0), name
