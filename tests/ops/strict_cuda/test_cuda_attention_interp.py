"""The strict CUDA attention kernel (``kernels/attention.py``) under Triton's interpreter, FP32 on
CPU tensors: accuracy against the FP64 references, the fused mode equal to its three unfused modes,
and raw-byte invariance of a sample's rows under batch size, batch position, prompt padding,
launch geometry and garbage in masked key slots. Tiny shapes: the interpreter is slow."""

from __future__ import annotations

import pytest
import torch

from references import ops as ref
from tests.conftest import assert_same_bytes
from tests.strict_cuda_cases import joint

H, DH = 2, 16


@pytest.fixture(scope="module")
def kern():
    from drifttool.ops.strict_cuda.kernels import attention

    return attention


def _joint(lens, text_len, n_img, seed=0, heads=H, dh=DH):
    """q, k, v [B, L+N, H, Dh] FP32 and the joint key mask [txt valid prefix, image ones]."""
    return joint(lens, text_len, n_img, heads, dh, seed=seed)


def _unfused(kern, q, k, v, km, text_len, config=None):
    p = kern.softmax(kern.scores(q, k, text_len=text_len, config=config), km, text_len=text_len, config=config)
    return kern.attend(p, v, km, text_len=text_len, config=config), p


def test_fused_matches_fp64_and_its_unfused_modes(kern):
    """Odd text length 13 (valid 13, 7, 10), 70 image keys (one whole and one partial block)."""
    q, k, v, km = _joint([13, 7, 10], 13, 70)
    o = kern.attention(q, k, v, km, text_len=13)
    r = ref.joint_attention_fused(q, k, v, km)
    assert o.dtype == torch.float32 and o.shape == q.shape
    assert (o.double() - r).abs().max() < 2e-6
    s = kern.scores(q, k, text_len=13)
    assert (s.double() - ref.joint_attn_qk_gemm(q, k)).abs().max() < 2e-6
    p = kern.softmax(s, km, text_len=13)
    assert (p.double() - ref.joint_attn_softmax(ref.joint_attn_qk_gemm(q, k), km)).abs().max() < 1e-6
    masked = p.masked_select(~km[:, None, None, :])
    assert masked.numel() > 0 and torch.equal(masked.view(torch.int32), torch.zeros_like(masked).view(torch.int32))
    o2 = kern.attend(p, v, km, text_len=13)
    assert_same_bytes(o2, o, "fused vs unfused modes")


def test_padding_batch_and_garbage_in_masked_slots(kern):
    """A sample's rows: padded from 7 to 70 text slots (a text block with no valid key appears)
    inside a batch of 3 at position 2, NaN in every masked K/V slot — vs alone, unpadded, no mask."""
    n_img, lmax = 67, 70
    q, k, v, km = _joint([20, 3, 7], lmax, n_img, seed=1)
    pad = ~km
    k = k.masked_fill(pad[:, :, None, None], float("nan"))
    v = v.masked_fill(pad[:, :, None, None], float("nan"))
    o = kern.attention(q, k, v, km, text_len=lmax)
    assert torch.isfinite(o).all()
    keep = torch.cat([torch.arange(7), torch.arange(lmax, lmax + n_img)])
    alone = kern.attention(q[2:, keep], k[2:, keep], v[2:, keep], None, text_len=7)
    assert_same_bytes(o[2:, keep], alone, "sample 2: padded in a batch of 3 vs alone")
    unf, _ = _unfused(kern, q, k, v, km, lmax)
    assert_same_bytes(unf, o, "fused vs unfused with NaN in masked slots")


def test_launch_geometry_and_image_key_mask(kern):
    """Another query tile / warp count gives the same bytes, and a key mask reaching into the
    image keys (the masked image-block path) matches FP64."""
    q, k, v, km = _joint([5, 11], 11, 60, seed=2)
    km[0, 11 + 3] = False
    km[1, -2:] = False
    o = kern.attention(q, k, v, km, text_len=11)
    r = ref.joint_attention_fused(q, k, v, km)
    assert (o.double() - r).abs().max() < 2e-6
    o2 = kern.attention(q, k, v, km, text_len=11, config=(32, 2, 1))
    assert_same_bytes(o2, o, "query tile 32, 2 warps vs the fixed configuration")
    unf, _ = _unfused(kern, q, k, v, km, 11, config=(32, 2, 1))
    assert_same_bytes(unf, o, "unfused modes at another geometry vs fused")


def test_sp_rank_rows_equal_the_full_rows(kern):
    """An SP rank's queries (the text rows and image rows [64, 130)) against every key give the
    full call's bytes for those rows, fused and unfused (AG/RS attention on one device)."""
    q, k, v, km = _joint([9, 4], 9, 130, seed=3)
    o = kern.attention(q, k, v, km, text_len=9)
    rows = torch.cat([torch.arange(9), torch.arange(9 + 64, 9 + 130)])
    mine = kern.attention(q[:, rows], k, v, km, text_len=9)
    assert mine.shape == (2, len(rows), H, DH)
    assert_same_bytes(mine, o[:, rows], "SP rank's rows vs the full call")
    unf, _ = _unfused(kern, q[:, rows], k, v, km, 9)
    assert_same_bytes(unf, mine, "SP rank's rows: unfused vs fused")


def test_tma_loads_of_whole_image_blocks_give_the_pointer_loads_bytes(kern):
    """The fused mode with TMA descriptors for the whole image blocks (``CONFIG``'s fourth entry)
    equals the pointer loads' bytes: unmasked, masked text only (TMA on the image blocks) and a
    mask reaching into the image keys (pointers throughout); and a K whose heads are not adjacent
    falls back to pointers."""
    q, k, v, km = _joint([13, 6], 13, 150, seed=4)  # 2 whole image blocks and a partial one
    km_img = km.clone()
    km_img[1, 13 + 70] = False
    for mask in (None, km, km_img):
        ptr = kern.attention(q, k, v, mask, text_len=13, config=(64, 4, 1))
        tma = kern.attention(q, k, v, mask, text_len=13, config=(64, 4, 1, True))
        assert_same_bytes(tma, ptr, f"TMA vs pointer loads, mask {'none' if mask is None else 'given'}")
    assert kern._kv_descriptors(k, v, k.shape[1], DH) is not None
    k_t = k.transpose(1, 2).contiguous().transpose(1, 2)  # [B,S,H,Dh] view, heads not adjacent
    assert kern._kv_descriptors(k_t, v, k.shape[1], DH) is None
    assert_same_bytes(kern.attention(q, k_t, v, km, text_len=13, config=(64, 4, 1, True)),
                      kern.attention(q, k, v, km, text_len=13, config=(64, 4, 1)), "non-adjacent heads")
