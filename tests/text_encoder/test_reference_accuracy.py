"""Each text-encoder operator, strict and production, against its independent FP64 reference
(``references/text_encoder.py``), in FP32 on awkward tiny shapes (prompt lengths 7 and 13,
batch 3, GQA 4 query heads on 2 K/V heads). The data-movement operators are byte-equal to the
reference rounded to their dtype; the arithmetic ones are within the tolerance below
(elementwise |c − r| ≤ atol + rtol·|r|; measured maxima are an order of magnitude lower).

    $ python -m pytest tests/text_encoder/test_reference_accuracy.py -q -n 0
"""

from __future__ import annotations

import pytest
import torch

import drifttool.ops  # noqa: F401  (registers the operators)
from drifttool.ops.registry import implementation
from drifttool.ops.specs import TEXT_ENCODER_OPERATORS, VISION_OPERATORS
from drifttool.references import text_encoder as ref

TOL = {  # (atol, rtol) in FP32
    "te_rmsnorm": (2e-6, 2e-6),
    "te_qkv_bias_gemm": (5e-6, 5e-6),
    "te_mrope": (2e-6, 2e-6),
    "te_causal_attention": (5e-6, 5e-6),
    "te_attn_out_residual": (5e-6, 5e-6),
    "te_mlp_gate_up_silu": (5e-6, 5e-6),
    "te_mlp_down_residual": (5e-6, 5e-6),
}
EXACT = ("te_tokenize", "te_embed_tokens", "te_prompt_extract")
LANGUAGE_MODEL = tuple(n for n in TEXT_ENCODER_OPERATORS if n not in VISION_OPERATORS)
"""The language model's rows (the vision rows: tests/text_encoder/test_vision_reference_accuracy.py)."""


def _cases() -> dict[str, tuple]:
    g = torch.Generator().manual_seed(3)
    r = lambda *s, scale=1.0: scale * torch.randn(*s, generator=g)  # noqa: E731
    b, n, d, h, kv, dh, i = 3, 13, 64, 4, 2, 16, 96
    mask = torch.zeros(b, n, dtype=torch.int64)
    for row, ln in enumerate((7, 13, 10)):
        mask[row, :ln] = 1
    pos = torch.arange(n).view(1, 1, n).expand(3, b, n).clone()
    pos[1] += 2  # three distinct axes, as an image token's
    pos[2] += 5
    return {
        "te_tokenize": (["ab", "abcab", "c"], "<{}>", lambda ts: [[ord(c) for c in t] for t in ts], 0, 5),
        "te_embed_tokens": (torch.randint(0, 50, (b, n), generator=g), r(50, d)),
        "te_rmsnorm": (r(b, n, d, scale=2.0), 1 + 0.1 * r(d), 1e-6),
        "te_qkv_bias_gemm": (r(b, n, d), r(h * dh, d, scale=d ** -0.5), 0.1 * r(h * dh),
                             r(kv * dh, d, scale=d ** -0.5), 0.1 * r(kv * dh),
                             r(kv * dh, d, scale=d ** -0.5), 0.1 * r(kv * dh), h, kv),
        "te_mrope": (r(b, n, h, dh), pos, 1e6, (2, 3, 3)),
        "te_causal_attention": (r(b, n, h, dh, scale=1.5), r(b, n, kv, dh, scale=1.5), r(b, n, kv, dh), mask),
        "te_attn_out_residual": (r(b, n, d), r(b, n, h * dh), r(d, h * dh, scale=(h * dh) ** -0.5)),
        "te_mlp_gate_up_silu": (r(b, n, d), r(i, d, scale=d ** -0.5), r(i, d, scale=d ** -0.5)),
        "te_mlp_down_residual": (r(b, n, d), r(b, n, i), r(d, i, scale=i ** -0.5)),
        "te_prompt_extract": (r(b, n, d), mask, 4),
    }


CASES = _cases()


def _tuple(x):
    return x if isinstance(x, tuple) else (x,)


@pytest.mark.parametrize("family", ["strict", "production"])
@pytest.mark.parametrize("op", LANGUAGE_MODEL)
def test_operator_against_fp64_reference(op, family):
    args = CASES[op]
    got, want = _tuple(implementation(op, family)(*args)), _tuple(getattr(ref, op)(*args))
    for c, r in zip(got, want):
        assert c.shape == r.shape, (op, c.shape, r.shape)
        if op in EXACT:
            assert c.equal(r.to(c.dtype)), op
            continue
        atol, rtol = TOL[op]
        err = (c.double() - r).abs()
        assert bool((err <= atol + rtol * r.abs()).all()), (op, family, float(err.max()))


def test_every_text_encoder_operator_has_a_case():
    assert set(CASES) == set(LANGUAGE_MODEL) == set(TOL) | set(EXACT)
