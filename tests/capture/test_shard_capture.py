"""Sharded capture: each rank digests its block of an operator output where the TP/SP plan
placed it, and the combined partials equal the one-device record of the logical output —
digest, row digests, shape, count of non-finite values and max |x| — bit for bit.

The blocks are cut from a fresh random logical tensor the way the ranks hold them (SP: the
text rows every rank repeats and the rank's image rows of ``sp_row_spans``, possibly empty;
TP: equal head or channel slices; Ulysses' internals: an SP slice of the TP rank's heads), and
placed by the plan's own placer (``distributed.placement.place``, reading ``rules.RULES``), so the
test covers the placement the runs use, without processes. Payloads of ±0, NaN payloads and
infinities count.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from drifttool.capture import shards
from drifttool.capture.digest import digest_pending, materialize
from drifttool.capture.layout import canonicalize
from drifttool.distributed.placement import place
from drifttool.distributed.rules import RULES
from drifttool.distributed.plan import ParallelDims, ParallelPlan
from drifttool.shards import sp_row_spans

NUM_LAYERS = 2


def _plan(dims: ParallelDims, s: int, t: int, n_img: int, text_len: int) -> ParallelPlan:
    plan = ParallelPlan(dims=dims, num_layers=NUM_LAYERS)
    plan.coords.update(sp=s, tp=t)
    plan.state.update(n_img=n_img, text_len=text_len)
    return plan


def _place(plan, op, stream, block, t, dims=None):
    """The placement of ``t`` (as ``ParallelPlan.for_capture``); ``dims`` collects the mesh
    dimensions that placed it."""
    placement, placed = place(plan, block, op, stream, t)
    if dims is not None:
        dims.update(placed)
    return placement


def _awkward(shape, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype)
    flat = x.view(-1)
    if flat.numel() >= 4:  # ±0, an infinity and a NaN with a payload: bits that count
        flat[0], flat[1], flat[2] = 0.0, -0.0, -math.inf
        bits = flat.view(torch.int16 if dtype.itemsize == 2 else torch.int32)
        bits[3] = 0x7FC3 if dtype.itemsize == 2 else 0x7FC00123
    return x


def _one_device(site, x, layout, keep_rows):
    return materialize([digest_pending(p.tensor, row_axis=p.row_axis,
                                       keep_rows=keep_rows and p.row_axis is not None)
                        for p in canonicalize(site, x, layout)])


def _sharded(site, blocks, layout, keep_rows, drop=None):
    """The payloads of the ranks that differ in a placing dimension, reduced as
    ``ParallelPlan.for_capture`` does (in one reduction: the combination is exact in any
    grouping); ``drop`` leaves one rank out."""
    pays, parts = [], None
    for r, (t, placement, coords, dims) in enumerate(blocks):
        if any(coords[d] for d in ("sp", "tp") if d not in dims):
            continue  # a replica of a placed rank's block (or of the owner's whole output)
        parts, pay = shards.shard_payload(site, t, layout, placement, keep_rows)
        if r != drop:
            pays.append(pay)
    total = shards.reduce_payloads(torch.stack(pays), shards.payload_widths(parts, keep_rows))
    return parts, materialize(shards.combine_payloads(parts, total, blocks[0][0].dtype, keep_rows))


def _same(a, b) -> None:
    assert (a.dtype, a.shape, a.digest, a.nonfinite) == (b.dtype, b.shape, b.digest, b.nonfinite)
    assert a.maxabs == b.maxabs or (math.isnan(a.maxabs) and math.isnan(b.maxabs))
    if a.rows is None or b.rows is None:
        assert a.rows is None and b.rows is None
    else:
        assert np.array_equal(a.rows, b.rows)


def _blocks(x, dims, op, stream, block, text_len, n_img, *, row_axis=None, head_axis=None):
    """Each rank's block of the logical ``x`` and its placement."""
    out = []
    heads = x.shape[head_axis] if head_axis is not None else 0
    ulysses = dims.sp_attention == "ulysses" and stream == "joint" and RULES[op].heads is not None
    for s in range(dims.sp):
        lo, hi = sp_row_spans(n_img, dims.sp)[s]
        for t in range(dims.tp):
            b = x
            if head_axis is not None and dims.tp > 1 and RULES[op].heads is not None and 0 <= block < NUM_LAYERS:
                per = heads // dims.tp
                b = b.narrow(head_axis, t * per, per)
            if ulysses and dims.sp > 1:
                per = b.shape[head_axis] // dims.sp
                b = b.narrow(head_axis, s * per, per)
            elif row_axis is not None and dims.sp > 1 and stream in ("img", "joint"):
                pre = text_len if stream == "joint" else 0
                idx = list(range(pre)) + [pre + i for i in range(lo, hi)]
                b = b.index_select(row_axis, torch.tensor(idx, dtype=torch.long))
            plan, placed = _plan(dims, s, t, n_img, text_len), set()
            out.append((b.contiguous(), _place(plan, op, stream, block, b, placed),
                        {"sp": s, "tp": t}, placed))
    return out


LAYOUTS = [ParallelDims(tp=2), ParallelDims(tp=4), ParallelDims(sp=2), ParallelDims(sp=4),
           ParallelDims(sp=8), ParallelDims(sp=2, sp_attention="ulysses"),
           ParallelDims(tp=2, sp=2), ParallelDims(tp=2, sp=2, sp_attention="ulysses"),
           ParallelDims(tp=4, sp=2)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dims=st.sampled_from(LAYOUTS), batch=st.sampled_from([1, 3]),
       h=st.integers(1, 19), w=st.integers(1, 21), pad=st.integers(0, 5), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]), keep_rows=st.booleans(),
       kind=st.sampled_from(["img_qkv", "joint_out", "joint_qk", "img_mlp", "img_resid"]))
def test_sharded_capture_equals_one_device(dims, batch, h, w, pad, seed, dtype, keep_rows, kind):
    n_img, heads, dh = h * w, 8, 3
    rng = np.random.default_rng(seed)
    txt_lens = [int(rng.integers(0, pad + 1)) for _ in range(batch)]
    site = {"samples": [5 + b for b in range(batch)], "txt_lens": txt_lens, "img_grid": (h, w)}
    if kind == "img_qkv":
        op, stream, layout, shape, rows, hax = "qkv_bias_gemm", "img", "BS..", (batch, n_img, heads, dh), 1, 2
    elif kind == "img_mlp":
        op, stream, layout, shape, rows, hax = "mlp_up_gemm_gelu", "img", "BS.", (batch, n_img, 16), 1, 2
    elif kind == "img_resid":
        op, stream, layout, shape, rows, hax = "adaln_gate_residual", "img", "BS.", (batch, n_img, 12), 1, None
    elif kind == "joint_out":
        op, stream, layout, shape, rows, hax = ("joint_attention_fused", "joint", "BS..",
                                                (batch, pad + n_img, heads, dh), 1, 2)
    else:
        op, stream, layout, shape, rows, hax = ("joint_attn_qk_gemm", "joint", "B.SK",
                                                (batch, 4, pad + n_img, pad + n_img), 2, 1)
    site["stream"] = stream
    x = _awkward(shape, dtype, seed)
    blocks = _blocks(x, dims, op, stream, 0, pad, n_img, row_axis=rows, head_axis=hax)
    want = _one_device(site, x, layout, keep_rows)
    parts, got = _sharded(site, blocks, layout, keep_rows)
    assert [p.sample for p in parts] == site["samples"]
    for a, b in zip(want, got):
        _same(a, b)


def test_6889_image_tokens_sp4_tp2():
    """The issue's awkward length: 6889 image rows (83²) over SP4 × TP2, an odd padded prompt."""
    dims = ParallelDims(tp=2, sp=4)
    n_img, pad = 6889, 13
    site = {"stream": "joint", "samples": [0, 1, 2], "txt_lens": [13, 5, 0], "img_grid": (83, 83)}
    x = _awkward((3, pad + n_img, 4, 8), torch.bfloat16, 6889)
    blocks = _blocks(x, dims, "joint_attention_fused", "joint", 1, pad, n_img, row_axis=1, head_axis=2)
    for keep in (False, True):
        for a, b in zip(_one_device(site, x, "BS..", keep), _sharded(site, blocks, "BS..", keep)[1]):
            _same(a, b)


def test_missing_or_doubled_rank_changes_the_digest():
    """The combination can fail: a rank's partial left out, or a rank's block placed where
    another rank's lies, gives another digest."""
    dims = ParallelDims(tp=2, sp=2)
    site = {"stream": "img", "samples": [0], "txt_lens": None, "img_grid": (9, 15)}
    x = _awkward((1, 135, 4, 2), torch.float32, 1)
    blocks = _blocks(x, dims, "qkv_bias_gemm", "img", 0, 0, 135, row_axis=1, head_axis=2)
    assert all(b[0].numel() for b in blocks)  # rows 0..127 and 128..134, two heads each
    want = _one_device(site, x, "BS..", True)[0]
    assert _sharded(site, blocks, "BS..", True)[1][0].digest == want.digest
    assert _sharded(site, blocks, "BS..", True, drop=1)[1][0].digest != want.digest
    moved = list(blocks)
    moved[1] = (blocks[1][0], *blocks[0][1:])  # TP rank 1's heads placed at TP rank 0's
    assert _sharded(site, blocks, "BS..", True, drop=2)[1][0].digest != want.digest
    assert _sharded(site, moved, "BS..", True)[1][0].digest != want.digest


def test_replicated_outputs_are_not_placed():
    """Outputs the plan does not shard stay whole: the text stream, the per-sample modulation,
    ``proj_out`` (gathered by the plan), the sampler's calls."""
    plan = _plan(ParallelDims(tp=2, sp=2), 1, 1, 15, 4)
    t = torch.zeros(1, 4, 8, 2)
    assert _place(plan, "qkv_bias_gemm", "txt", 0, t) == {2: shards.AxisShard(16, ((0, 8, 8),))}
    assert _place(plan, "adaln_mod_projection", "img", 0, torch.zeros(1, 12)) == {}
    assert _place(plan, "latent_proj_gemm", "img", NUM_LAYERS, torch.zeros(1, 15, 4)) == {}
    assert _place(plan, "cfg_combine_renorm", "img", -2, torch.zeros(1, 15, 4)) == {}


@pytest.mark.parametrize("placement", [{0: shards.AxisShard(2, ((0, 1, 0),))}])
def test_batch_axis_cannot_be_placed(placement):
    with pytest.raises(ValueError, match="batch axis"):
        shards.shard_payload({"stream": "img", "img_grid": (1, 2)}, torch.zeros(1, 2, 3), "BS.",
                             placement, False)
