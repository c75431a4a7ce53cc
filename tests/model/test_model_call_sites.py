"""The MMDiT forward as operator calls: order, identity (block, stream), layouts, backends."""

from __future__ import annotations

import pytest
import torch

import drifttool.ops  # noqa: F401
import drifttool.ops.production  # noqa: F401
from drifttool.errors import UnsupportedConfigError
from drifttool.model.config import tiny
from drifttool.model.mmdit import MMDiT, random_init_
from drifttool.ops.registry import implementation, specs
from drifttool.runtime import Runtime

SCHEDULER_OPS = {"cfg_combine_renorm", "flow_sigma_table", "flow_sde_step_logp"}


class ListRecorder:
    """Minimal capture sink: keeps (block, stream, op, call, index, layout, shape, dtype)."""

    def __init__(self):
        self.rows = []

    def capture(self, site, tensor, layout, index=0):
        self.rows.append((site["block"], site["stream"], site["op"], site["call"], index, layout,
                          tuple(tensor.shape), tensor.dtype))


def _run(mode, dtype=torch.float32, mask=True):
    model = random_init_(MMDiT(tiny(), dtype=dtype), seed=0)
    g = torch.Generator().manual_seed(0)
    B, h, w, L = 2, 4, 6, 5
    x = torch.randn(B, h * w, 64, generator=g).to(dtype)
    txt = torch.randn(B, L, 32, generator=g).to(dtype)
    m = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool) if mask else None
    rec = ListRecorder()
    rt = Runtime(mode=mode, recorder=rec)
    with rt.scope(phase="rollout", step=0, branch="cond", samples=[0, 1], txt_lens=[5, 3], img_grid=(h, w)):
        v = model(x, txt, m, torch.tensor([0.9, 0.3]), (h, w), rt)
    return v, rec.rows, rt


def test_every_model_operator_has_a_production_backend():
    for name in specs():
        if name not in SCHEDULER_OPS:
            assert callable(implementation(name, "production")), name


def test_call_sites_production():
    v, rows, rt = _run("auto")
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
    n_outputs = sum(3 if e.op == "qkv_bias_gemm" else 1 for e in entries)
    assert n_outputs == len(rows)


def test_call_sites_strict_use_unfused_attention():
    pytest.importorskip("drifttool.ops.strict")
    v, rows, rt = _run("strict")
    joint = [(op, lay, sh) for b, s, op, c, i, lay, sh, _ in rows if b == 1 and s == "joint"]
    S = 5 + 24
    assert joint == [("joint_attn_qk_gemm", "B.SK", (2, 2, S, S)), ("joint_attn_softmax", "B.SK", (2, 2, S, S)),
                     ("joint_attn_av_gemm", "BS..", (2, S, 2, 16))]
    assert all(e.actual == "strict" for e in rt.trace.entries())
    rt.trace.check_strict()


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
