"""RoPE tables (numerics §2.2): ``polar`` byte-equal to diffusers' QwenEmbedRope, ``exact``
computed as specified (portability across dispatch levels: tests/test_portable_inputs.py),
chosen by the backend, positions as specified."""

import struct

import pytest
import torch

from drifttool.model import mmdit
from drifttool.model.config import tiny
from drifttool.model.rope import (BACKEND_TABLES, image_positions, rope_inv_freqs, rope_table, rope_tables,
                                  text_positions)
from drifttool.runtime import Runtime

GRIDS = [(4, 6, 7), (5, 3, 1), (1, 1, 3), (7, 2, 5), (64, 64, 30), (3, 8, 0)]


@pytest.mark.parametrize("axes", [(4, 6, 6), (8, 12, 12), (16, 56, 56)])
def test_tables_byte_equal_diffusers(axes):
    from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope

    pe = QwenEmbedRope(theta=10000, axes_dim=list(axes), scale_rope=True)
    for h, w, L in GRIDS:
        vid, txt = pe([(1, h, w)], max_txt_seq_len=L, device=torch.device("cpu"))
        img_t, txt_t = rope_tables((h, w), L, axes_dims=axes, algorithm="polar")
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


def f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


@pytest.mark.parametrize("algorithm", ["exact", "polar"])
def test_inv_freqs_and_identity_frame_axis(algorithm):
    inv = rope_inv_freqs(6, algorithm=algorithm)
    assert inv.dtype == torch.float32 and inv.tolist() == pytest.approx([1.0, 10000 ** (-1 / 3), 10000 ** (-2 / 3)])
    img, _ = rope_tables((3, 4), 2, axes_dims=(4, 6, 6), algorithm=algorithm)
    assert torch.equal(img[:, :2], torch.ones(12, 2, dtype=torch.complex64))  # frame axis: no rotation
    with pytest.raises(ValueError):
        rope_inv_freqs(5, algorithm=algorithm)


@pytest.mark.parametrize("dim", [4, 6, 16, 56])
def test_exact_inv_freqs_are_the_specified_roundings(dim):
    """inv[i] = fp32(1 / fp32(10000^e)), e = fp32(fp32(2i)/D): Python's FP64 pow rounded as specified."""
    want = [f32(1.0 / f32(10000.0 ** f32(f32(2 * i) / dim))) for i in range(dim // 2)]
    assert rope_inv_freqs(dim, algorithm="exact").tolist() == want


def test_exact_table_is_fp64_sincos_of_the_fp32_angle_rounded_once():
    """Each entry = fp32(cos θ) + i·fp32(sin θ) of the fp32 angle θ (Python math, FP64); the
    FP32 angle is one IEEE product, so only cos/sin rounding is left (ties aside: none here)."""
    import math

    pos = text_positions(83, 83, 40)
    table = rope_table(pos, (16, 56, 56), algorithm="exact")
    inv = torch.cat([rope_inv_freqs(d, algorithm="exact") for d in (16, 56, 56)]).tolist()
    for row in (0, 17, 39):
        p = float(pos[row, 0])
        for j in range(64):
            angle = f32(p * inv[j])
            assert table[row, j].real.item() == f32(math.cos(angle)), (row, j)
            assert table[row, j].imag.item() == f32(math.sin(angle)), (row, j)


def test_unknown_algorithm_raises():
    with pytest.raises(ValueError, match="unknown RoPE table algorithm 'sleef'"):
        rope_tables((2, 2), 1, axes_dims=(4, 6, 6), algorithm="sleef")


@pytest.mark.parametrize("mode", ["strict", "audit", "auto", "off"])
def test_model_takes_the_tables_of_its_backend(mode, monkeypatch):
    """strict/audit forwards use the portable ``exact`` tables, production ones diffusers' ``polar``."""
    seen = []

    def spy(*args, **kwargs):
        seen.append(kwargs["algorithm"])
        return rope_tables(*args, **kwargs)

    monkeypatch.setattr(mmdit, "rope_tables", spy)
    model = mmdit.random_init_(mmdit.MMDiT(tiny()), seed=0)
    g = torch.Generator().manual_seed(0)
    x, txt = torch.randn(1, 6, 64, generator=g), torch.randn(1, 3, 32, generator=g)
    with torch.no_grad():
        model(x, txt, None, torch.tensor([0.5]), (2, 3), Runtime(mode=mode))
    rt = Runtime(mode=mode)
    assert seen == [BACKEND_TABLES[rt.mode.family]]
    assert seen == (["exact"] if mode in ("strict", "audit") else ["polar"])


def test_cached_and_deterministic():
    a = rope_tables((4, 6), 7, axes_dims=(4, 6, 6))
    b = rope_tables((4, 6), 7, axes_dims=(4, 6, 6))
    assert a[0] is b[0] and a[1] is b[1]
    assert rope_tables((4, 6), 7, axes_dims=(4, 6, 6), algorithm="polar")[0] is not a[0]
    from drifttool.model.rope import _cached_tables

    _cached_tables.cache_clear()
    c = rope_tables((4, 6), 7, axes_dims=(4, 6, 6))
    assert torch.equal(torch.view_as_real(a[0]), torch.view_as_real(c[0]))
