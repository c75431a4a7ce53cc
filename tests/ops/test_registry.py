"""Dispatch, fail-closed and audit fallback (RFC qwenimage_runtime_modes, qwenimage_operator_trace)."""

import json

import pytest
import torch

import drifttool.ops  # noqa: F401
from drifttool.errors import UnsupportedConfigError
from drifttool.ops.registry import call, specs
from drifttool.runner import execute
from drifttool.runtime import Runtime
from drifttool.settings import RunSpec

RFC_WS1 = {
    "latent_pack_unpack", "latent_normalize", "latent_proj_gemm", "txt_in_rmsnorm_linear",
    "timestep_embed_mlp", "adaln_mod_projection", "adaln_modulation", "adaln_gate_residual",
    "qkv_bias_gemm", "qk_rmsnorm", "multi_axis_rope", "joint_attn_qk_gemm", "joint_attn_softmax",
    "joint_attn_av_gemm", "joint_attention_fused", "attn_out_bias_gemm", "mlp_up_gemm_gelu",
    "mlp_down_gemm", "final_adaln_out", "cfg_combine_renorm", "flow_sigma_table", "flow_sde_step_logp",
}
CONTRACT_V2 = {  # strict contract v2: segmented GEMM K reductions and per-sample row reductions
    "latent_proj_gemm", "txt_in_rmsnorm_linear", "timestep_embed_mlp", "adaln_mod_projection",
    "adaln_modulation", "adaln_gate_residual", "qkv_bias_gemm", "qk_rmsnorm", "attn_out_bias_gemm",
    "mlp_up_gemm_gelu", "mlp_down_gemm", "final_adaln_out",
    # attention: fixed 64-key blocks in global key order, fixed merge of partial states
    "joint_attn_qk_gemm", "joint_attn_softmax", "joint_attn_av_gemm", "joint_attention_fused",
}


def test_all_22_ws1_operators_declared_with_both_backends():
    from drifttool.ops.registry import implementation

    from drifttool.ops.specs import WS1_OPERATORS

    assert len(WS1_OPERATORS) == 22 and set(WS1_OPERATORS) == RFC_WS1
    assert RFC_WS1 <= set(specs())  # other operators (e.g. lora_merge) may be declared too
    for name in RFC_WS1:
        s = specs()[name]
        assert s.contract == f"qwenimage.{name}.v{2 if name in CONTRACT_V2 else 1}"
        implementation(name, "strict")
        implementation(name, "production")




def test_strict_mode_fails_closed_on_unavailable_backend():
    rt = Runtime(mode="strict", unavailable={("mlp_down_gemm", "strict")})
    x = torch.randn(1, 3, 8)
    with pytest.raises(UnsupportedConfigError, match="mlp_down_gemm.*unavailable.*strict"):
        call(rt, "mlp_down_gemm", x, torch.randn(8, 8), None)


def test_audit_mode_records_the_fallback():
    rt = Runtime(mode="audit", unavailable={("mlp_down_gemm", "strict")})
    x = torch.randn(1, 3, 8)
    call(rt, "mlp_down_gemm", x, torch.randn(8, 8), None)
    (entry,) = rt.trace.entries()
    assert entry.requested == "strict" and entry.actual == "production" and entry.fallback
    assert "unavailable" in entry.reason and entry.declared
    rt.trace.check_strict()  # declared (audit) fallbacks are allowed


def test_strict_run_with_planted_unavailable_backend_exits_clean(tmp_path):
    with pytest.raises(UnsupportedConfigError, match="qk_rmsnorm"):
        execute(RunSpec(unavailable=(("qk_rmsnorm", "strict"),)), tmp_path / "s")
    assert json.loads((tmp_path / "s" / "manifest.json").read_text())["complete"] is False
    execute(RunSpec(mode="audit", unavailable=(("qk_rmsnorm", "strict"),)), tmp_path / "a")
    from drifttool.artifact.reader import open_run

    rows = [r for r in open_run(tmp_path / "a").trace_rows() if r["op"] == "qk_rmsnorm"]
    assert rows and all(r["fallback"] and r["actual"] == "production" for r in rows)
