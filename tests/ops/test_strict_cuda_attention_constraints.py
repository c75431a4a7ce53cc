"""The strict CUDA attention operators' declared constraints, read without a GPU: unsupported
head dims and shapes fail closed in one line before any kernel is built."""

from __future__ import annotations

import torch

import drifttool.ops  # noqa: F401
from drifttool.ops.registry import impls


def failures(op: str, *args, **kwargs) -> list[str]:
    """``name: reason`` of each declared constraint of the strict CUDA ``op`` that fails (the
    device and GPU constraints skipped: the tensors here are CPU tensors)."""
    impl = impls(op, "strict", "cuda")[0]
    bound = impl.signature.bind(*args, **kwargs)
    bound.apply_defaults()
    skip = ("device cuda", "qualified GPU (sm_90)")
    return [f"{c.name}: {why}" for c in impl.constraints
            if c.name not in skip and (why := c(bound.arguments)) is not None]


def test_all_four_are_registered_with_the_fused_one_decomposable():
    ops = ("joint_attention_fused", "joint_attn_qk_gemm", "joint_attn_softmax", "joint_attn_av_gemm")
    found = {op: impls(op, "strict", "cuda") for op in ops}
    assert all(len(v) == 1 for v in found.values())
    assert [op for op, v in found.items() if v[0].decomposable] == ["joint_attention_fused"]
    assert len({v[0].kernel for v in found.values()}) == 1  # one kernel, four modes


def test_supported_call_passes():
    q = torch.randn(2, 30, 3, 128, dtype=torch.bfloat16)
    km = torch.ones(2, 30, dtype=torch.bool)
    assert failures("joint_attention_fused", q, q, q, km, text_len=7) == []
    assert failures("joint_attn_softmax", torch.randn(2, 3, 30, 30), km, text_len=7) == []
    assert failures("joint_attn_av_gemm", torch.randn(2, 3, 30, 30), q, km, text_len=7) == []


def test_unsupported_calls_name_what_is_unsupported():
    q24 = torch.randn(1, 9, 2, 24)
    assert any("head dim 24" in f for f in failures("joint_attention_fused", q24, q24, q24, None))
    q, k = torch.randn(1, 9, 2, 16), torch.randn(1, 8, 2, 16)
    assert any("share B, H, Dh and dtype" in f for f in failures("joint_attention_fused", q, k, q, None))
    assert failures("joint_attention_fused", q, k, k, None, text_len=5) == []  # an SP rank's rows
    assert any("exceeds the 8 query rows" in f for f in failures("joint_attention_fused", k, q, q, None, text_len=9))
    assert any("share B, H, Dh and dtype" in f for f in failures("joint_attn_qk_gemm", q, q.bfloat16()))
    assert any("[B, H, Sq, S]" in f for f in failures("joint_attn_softmax", torch.randn(2, 9, 8)))
    p, v = torch.randn(1, 2, 9, 9), torch.randn(1, 9, 3, 16)
    assert any("must be [B, S, H, Dh]" in f for f in failures("joint_attn_av_gemm", p, v))
    assert any("text_len" in f for f in failures("joint_attention_fused", q, q, q, None, text_len=10))
