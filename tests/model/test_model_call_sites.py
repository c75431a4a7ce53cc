"""The MMDiT forward as operator calls: order, identity (block, stream), layouts, backends."""

from __future__ import annotations

import pytest
import torch

import drifttool.ops  # noqa: F401
from drifttool.errors import UnsupportedConfigError
from drifttool.model.config import tiny
from drifttool.model.mmdit import MMDiT, random_init_
from drifttool.ops.registry import implementation, specs
from drifttool.runtime import Runtime
from tests.conftest import bits

SCHEDULER_OPS = {"cfg_combine_renorm", "flow_sigma_table", "flow_sde_step_logp"}


class ListRecorder:
    """Minimal capture sink at capture ``level``: keeps (block, stream, op, call, index, layout,
    shape, dtype) and, in ``tensors``, each captured tensor."""

    def __init__(self, level="L2"):
        self.level = level
        self.rows = []
        self.tensors = []

    def capture(self, site, tensor, layout, index=0, role="output"):
        self.rows.append((site["block"], site["stream"], site["op"], site["call"], index, layout,
                          tuple(tensor.shape), tensor.dtype))
        self.tensors.append(tensor.detach().cpu())


def _run(mode, dtype=torch.float32, mask=True, level="L2", device="cpu", recorder=None):
    model = random_init_(MMDiT(tiny(), dtype=dtype), seed=0).to(device)
    g = torch.Generator().manual_seed(0)
    B, h, w, L = 2, 4, 6, 5
    x = torch.randn(B, h * w, 64, generator=g).to(dtype).to(device)
    txt = torch.randn(B, L, 32, generator=g).to(dtype).to(device)
    m = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool, device=device) if mask else None
    rec = recorder or ListRecorder(level)
    rt = Runtime(mode=mode, recorder=rec)
    with rt.scope(phase="rollout", step=0, branch="cond", samples=[0, 1], txt_lens=[5, 3], img_grid=(h, w)):
        v = model(x, txt, m, torch.tensor([0.9, 0.3], device=device), (h, w), rt)
    return v, rec.rows, rt


def test_every_model_operator_has_a_production_backend():
    for name in specs():
        if name not in SCHEDULER_OPS:
            assert callable(implementation(name, "production")), name


@pytest.mark.parametrize("level", ["L1", "L2"])
def test_call_sites_production(device, level):
    v, rows, rt = _run("auto", level=level, device=device)
    assert v.shape == (2, 24, 64)
    # every capture's layout has one tag per tensor axis
    for block, stream, op, call, index, layout, shape, dtype in rows:
        assert len(layout) == len(shape), (op, layout, shape)
    head = [(b, s, op, lay) for b, s, op, _, _, lay, _, _ in rows[:3]]
    assert head == [(-1, "none", "timestep_embed_mlp", "B."), (-1, "txt", "txt_in_rmsnorm_linear", "BS."),
                    (-1, "img", "latent_proj_gemm", "BS.")]
    tail = [(b, s, op, lay) for b, s, op, _, _, lay, _, _ in rows[-2:]]
    assert tail == [(2, "img", "final_adaln_out", "BS."), (2, "img", "latent_proj_gemm", "BS.")]
    block0 = [(s, op, c, i, lay) for b, s, op, c, i, lay, _, _ in rows if b == 0]
    assert block0[:4] == [("img", "adaln_mod_projection", 0, 0, "B."), ("txt", "adaln_mod_projection", 0, 0, "B."),
                          ("img", "adaln_modulation", 0, 0, "BS."), ("txt", "adaln_modulation", 0, 0, "BS.")]
    assert [(i, lay) for s, op, c, i, lay in block0 if op == "qkv_bias_gemm" and s == "img"] == [
        (0, "BS.."), (1, "BS.."), (2, "BS..")]
    joint = [(op, lay) for s, op, c, i, lay in block0 if s == "joint"]
    assert joint == [("joint_attention_fused", "BS..")]
    ops0 = [op for s, op, c, i, lay in block0]
    assert ops0.count("adaln_gate_residual") == 4 and ops0.count("qk_rmsnorm") == 4
    assert ops0.count("multi_axis_rope") == 4 and ops0.count("mlp_up_gemm_gelu") == 2
    # joint attention output covers [text, image]
    (shape,) = [sh for b, s, op, c, i, lay, sh, _ in rows if b == 0 and op == "joint_attention_fused"]
    assert shape == (2, 5 + 24, 2, 16)
    # trace: one production entry per call site, no fallbacks
    entries = rt.trace.entries()
    assert all(e.actual == "production" and not e.fallback for e in entries)
    assert {e.device for e in entries} == {device}
    n_outputs = sum(3 if e.op == "qkv_bias_gemm" else 1 for e in entries)
    assert n_outputs == len(rows)
    # SDPA at every level; at L2 the trace says the S×S internals were not captured
    (fused,) = {e.reason for e in entries if e.op == "joint_attention_fused"}
    assert ("not captured" in fused) == (level == "L2")


def test_call_sites_strict_l2_decompose_attention():
    """At L2 the strict fused attention runs as its three declared operators, each captured."""
    v, rows, rt = _run("strict", level="L2")
    joint = [(op, lay, sh) for b, s, op, c, i, lay, sh, _ in rows if b == 1 and s == "joint"]
    S = 5 + 24
    assert joint == [("joint_attn_qk_gemm", "B.SK", (2, 2, S, S)), ("joint_attn_softmax", "B.SK", (2, 2, S, S)),
                     ("joint_attn_av_gemm", "BS..", (2, S, 2, 16)),
                     ("joint_attention_fused", "BS..", (2, S, 2, 16))]  # internals, then itself
    assert all(e.actual == "strict" and e.device == "cpu" for e in rt.trace.entries())
    fused = [e for e in rt.trace.entries() if e.op == "joint_attention_fused"]
    assert fused and all("run as its decomposition" in e.reason and not e.fallback for e in fused)
    rt.trace.check_strict()


def test_call_sites_strict_l1_fused_attention_is_byte_equal_to_l2():
    """At L1 the S×S tensors are not materialised for capture: one fused call, whose output and
    the model's v are byte-equal to the decomposed L2 run (bf16, padded prompt)."""
    rec1, rec2 = ListRecorder("L1"), ListRecorder("L2")
    v1, rows1, rt1 = _run("strict", dtype=torch.bfloat16, recorder=rec1)
    v2, rows2, _ = _run("strict", dtype=torch.bfloat16, recorder=rec2)
    joint1 = [r[2] for r in rows1 if r[1] == "joint"]
    assert joint1 == ["joint_attention_fused"] * 2  # one per block
    assert all(r[5] != "B.SK" for r in rows1)
    assert torch.equal(bits(v1), bits(v2))
    fused = [t for r, t in zip(rows1, rec1.tensors) if r[2] == "joint_attention_fused"]
    av = [t for r, t in zip(rows2, rec2.tensors) if r[2] == "joint_attn_av_gemm"]
    assert len(fused) == len(av) == 2
    for a, b in zip(fused, av):
        assert torch.equal(bits(a), bits(b))
    assert {e.kernel for e in rt1.trace.entries() if e.op == "joint_attention_fused"} == {
        "strict.fused_blocked_two_pass.v2"}  # the blocked kernel runs at L1; L2 expands it


def test_strict_model_on_cuda_fails_closed_naming_the_device(device):
    """No strict CUDA family is registered yet: the first call fails closed, naming the operator,
    family, device and the failed constraint."""
    if device == "cpu":
        pytest.skip("the strict CPU family exists")
    with pytest.raises(UnsupportedConfigError, match="'timestep_embed_mlp'.*'strict'.*'cuda'"):
        _run("strict", device=device)


def test_mode_off_captures_nothing_and_matches_auto():
    v_auto, rows_auto, _ = _run("auto", dtype=torch.bfloat16)
    v_off, rows_off, _ = _run("off", dtype=torch.bfloat16)
    assert rows_off == [] and rows_auto
    assert torch.equal(v_auto.view(torch.int16), v_off.view(torch.int16))
    assert all(row[-1] == torch.bfloat16 for row in rows_auto)  # activations stay in the model dtype


def test_forward_rejects_bad_inputs():
    model = random_init_(MMDiT(tiny()), seed=0)
    rt = Runtime(mode="auto")
    x, txt, tau = torch.randn(1, 24, 64), torch.randn(1, 5, 32), torch.tensor([0.5])
    with pytest.raises(UnsupportedConfigError, match="img_grid"):
        model(x, txt, None, tau, (5, 5), rt)
    with pytest.raises(UnsupportedConfigError, match="model dtype"):
        model(x.bfloat16(), txt, None, tau, (4, 6), rt)
    with pytest.raises(UnsupportedConfigError, match="txt_mask"):
        model(x, txt, torch.ones(1, 4, dtype=torch.bool), tau, (4, 6), rt)
    with pytest.raises(UnsupportedConfigError, match="tau"):
        model(x, txt, None, tau[0], (4, 6), rt)
    with pytest.raises(UnsupportedConfigError, match="float32 or bfloat16"):
        MMDiT(tiny(), dtype=torch.float16)
