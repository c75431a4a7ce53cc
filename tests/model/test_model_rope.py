"""RoPE tables (numerics §2.2): byte-equal to diffusers' QwenEmbedRope, positions as specified."""

import pytest
import torch

from drifttool.model.rope import image_positions, rope_inv_freqs, rope_tables, text_positions

GRIDS = [(4, 6, 7), (5, 3, 1), (1, 1, 3), (7, 2, 5), (64, 64, 30), (3, 8, 0)]


@pytest.mark.parametrize("axes", [(4, 6, 6), (8, 12, 12), (16, 56, 56)])
def test_tables_byte_equal_diffusers(axes):
    from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope

    pe = QwenEmbedRope(theta=10000, axes_dim=list(axes), scale_rope=True)
    for h, w, L in GRIDS:
        vid, txt = pe([(1, h, w)], max_txt_seq_len=L, device=torch.device("cpu"))
        img_t, txt_t = rope_tables((h, w), L, axes_dims=axes)
        assert img_t.dtype == txt_t.dtype == torch.complex64
        assert img_t.shape == (h * w, sum(axes) // 2) and txt_t.shape == (L, sum(axes) // 2)
        assert torch.equal(torch.view_as_real(vid).view(torch.int32), torch.view_as_real(img_t).view(torch.int32))
        assert torch.equal(torch.view_as_real(txt).view(torch.int32), torch.view_as_real(txt_t).view(torch.int32))


def test_positions():
    # h=4 -> rows -2..1; h=5 -> rows -3..1; frame axis 0; row-major token order
    p = image_positions(4, 6)
    assert p[:, 0].eq(0).all()
    assert p[:, 1].view(4, 6)[:, 0].tolist() == [-2, -1, 0, 1]
    assert p[:, 2].view(4, 6)[0].tolist() == [-3, -2, -1, 0, 1, 2]
    assert image_positions(5, 3)[:, 1].view(5, 3)[:, 0].tolist() == [-3, -2, -1, 0, 1]
    # text starts at max(h//2, w//2) on all three axes
    t = text_positions(5, 3, 4)
    assert t.tolist() == [[2, 2, 2], [3, 3, 3], [4, 4, 4], [5, 5, 5]]
    assert text_positions(64, 64, 1).tolist() == [[32, 32, 32]]


def test_inv_freqs_and_identity_frame_axis():
    inv = rope_inv_freqs(6)
    assert inv.dtype == torch.float32 and inv.tolist() == pytest.approx([1.0, 10000 ** (-1 / 3), 10000 ** (-2 / 3)])
    img, _ = rope_tables((3, 4), 2, axes_dims=(4, 6, 6))
    assert torch.equal(img[:, :2], torch.ones(12, 2, dtype=torch.complex64))  # frame axis: no rotation
    with pytest.raises(ValueError):
        rope_inv_freqs(5)


def test_cached_and_deterministic():
    a = rope_tables((4, 6), 7, axes_dims=(4, 6, 6))
    b = rope_tables((4, 6), 7, axes_dims=(4, 6, 6))
    assert a[0] is b[0] and a[1] is b[1]
    from drifttool.model.rope import _cached_tables

    _cached_tables.cache_clear()
    c = rope_tables((4, 6), 7, axes_dims=(4, 6, 6))
    assert torch.equal(torch.view_as_real(a[0]), torch.view_as_real(c[0]))
