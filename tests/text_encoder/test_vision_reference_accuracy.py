"""Each vision operator of the text encoder, strict and production, against its independent FP64
reference (``references/text_encoder_vision.py``), in FP32 on awkward tiny shapes (segments of 7,
13 and 16 rows, 3 heads of 8, widths 24 / 40, a merger over 4 rows). The data-movement and
integer operators are byte-equal to the reference; the arithmetic ones are within the tolerance
below (elementwise |c − r| ≤ atol + rtol·|r|; measured maxima are several times lower). The
resampling and patches are judged in tests/text_encoder/test_vision_input.py.

    $ python -m pytest tests/text_encoder/test_vision_reference_accuracy.py -q -n 0
"""

from __future__ import annotations

import pytest
import torch

import drifttool.ops  # noqa: F401  (registers the operators)
from drifttool.ops.registry import implementation
from drifttool.ops.specs import VISION_OPERATORS
from drifttool.references import text_encoder_vision as ref

TOL = {  # (atol, rtol) in FP32
    "te_vision_patch_embed": (2e-6, 2e-6),
    "te_vision_rope_table": (1e-7, 1e-7),
    "te_vision_rmsnorm": (5e-7, 5e-7),
    "te_vision_qkv": (2e-6, 2e-6),
    "te_vision_rope": (3e-7, 3e-7),
    "te_vision_attention": (2e-6, 2e-6),
    "te_vision_attn_out_residual": (2e-6, 2e-6),
    "te_vision_mlp_gate_up_silu": (2e-6, 2e-6),
    "te_vision_mlp_down_residual": (2e-6, 2e-6),
    "te_vision_merger": (2e-6, 2e-6),
}
EXACT = ("te_vision_rope_index", "te_vision_scatter")
INPUTS = ("te_vision_resize", "te_vision_patchify")  # test_vision_input.py


def _cases() -> dict[str, tuple]:
    g = torch.Generator().manual_seed(5)
    r = lambda *s, scale=1.0: scale * torch.randn(*s, generator=g)  # noqa: E731
    n, h, dh, d, i = 36, 3, 8, 24, 40
    cu = torch.tensor([0, 7, 20, 36], dtype=torch.int32)
    pos = torch.stack([torch.randint(0, 40, (n,), generator=g), torch.randint(0, 40, (n,), generator=g)], -1)
    ang = r(n, dh // 2, scale=3.0)
    ids = torch.tensor([[5, 9, 9, 9, 9, 7, 1, 0], [9, 9, 3, 9, 9, 9, 9, 4]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    return {
        "te_vision_patch_embed": (r(n, 3 * 2 * 4 * 4), r(d, 3, 2, 4, 4, scale=96 ** -0.5)),
        "te_vision_rope_table": (pos, dh, 10000.0),
        "te_vision_rmsnorm": (r(n, d, scale=2.0), 1 + 0.1 * r(d), 1e-6),
        "te_vision_qkv": (r(n, d), r(3 * h * dh, d, scale=d ** -0.5), 0.1 * r(3 * h * dh), h),
        "te_vision_rope": (r(n, h, dh), r(n, h, dh), torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)),
        "te_vision_attention": (r(n, h, dh, scale=1.5), r(n, h, dh, scale=1.5), r(n, h, dh), cu),
        "te_vision_attn_out_residual": (r(n, d), r(n, h, dh), r(d, h * dh, scale=(h * dh) ** -0.5), 0.1 * r(d)),
        "te_vision_mlp_gate_up_silu": (r(n, d), r(i, d, scale=d ** -0.5), 0.1 * r(i), r(i, d, scale=d ** -0.5),
                                       0.1 * r(i)),
        "te_vision_mlp_down_residual": (r(n, d), r(n, i), r(d, i, scale=i ** -0.5), 0.1 * r(d)),
        "te_vision_merger": (r(n, d), 1 + 0.1 * r(d), r(4 * d, 4 * d, scale=(4 * d) ** -0.5), 0.1 * r(4 * d),
                             r(20, 4 * d, scale=(4 * d) ** -0.5), 0.1 * r(20), 4),
        # two images in prompt 0 (grids 2x4 and 2x2 patches), one in prompt 1 (4x4)
        "te_vision_rope_index": (torch.tensor([[5, 9, 9, 6, 9, 7, 1, 0], [9, 9, 9, 9, 3, 3, 4, 4]]),
                                 mask, 9, torch.tensor([[1, 2, 4], [1, 2, 2], [1, 4, 4]]), 2),
        "te_vision_scatter": (r(2, 8, d), ids, 9, r(int((ids == 9).sum()), d)),
    }


CASES = _cases()


def _tuple(x):
    return x if isinstance(x, tuple) else (x,)


@pytest.mark.parametrize("family", ["strict", "production"])
@pytest.mark.parametrize("op", [n for n in VISION_OPERATORS if n not in INPUTS])
def test_operator_against_fp64_reference(op, family):
    args = CASES[op]
    got, want = _tuple(implementation(op, family)(*args)), _tuple(getattr(ref, op)(*args))
    assert len(got) == len(want), op
    for c, r in zip(got, want):
        assert c.shape == r.shape, (op, c.shape, r.shape)
        if op in EXACT:
            assert c.equal(r.to(c.dtype)), op
            continue
        atol, rtol = TOL[op]
        err = (c.double() - r).abs()
        assert bool((err <= atol + rtol * r.abs()).all()), (op, family, float(err.max()))


def test_every_vision_operator_has_a_case():
    assert set(CASES) | set(INPUTS) == set(VISION_OPERATORS) and set(CASES) == set(TOL) | set(EXACT)


def test_the_rope_index_walks_text_and_image_runs():
    """Prompt 0: text 5, image 2×4 patches (1×2 tokens), text 6, image 2×2 (one token), text
    7, 1, then padding: positions 0, (1,1,1) (1,1,2), 3, (4,4,4), 5, 6, pad 0."""
    pos = implementation("te_vision_rope_index", "strict")(*CASES["te_vision_rope_index"])
    assert pos[:, 0].tolist() == [[0, 1, 1, 3, 4, 5, 6, 0], [0, 1, 1, 3, 4, 5, 6, 0], [0, 1, 2, 3, 4, 5, 6, 0]]
    assert pos[:, 1, :4].tolist() == [[0, 0, 0, 0], [0, 0, 1, 1], [0, 1, 0, 1]]  # 2×2 tokens from 0
    assert pos[:, 1, 4:].tolist() == [[2, 3, 4, 5]] * 3  # text after max(4, 4)/2 = 2
