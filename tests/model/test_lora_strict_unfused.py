"""LoRA mode ``unfused-fp32`` under the strict family on the MMDiT (``model.lora_calls.gemm_lora``): the
block GEMMs receive the FP32 factors (``lora=``) and add the branch themselves.

- B = 0 (peft's init): v is byte-equal to the model without an adapter;
- no ``lora_merge`` / ``lora_delta`` call in the strict trace (production keeps its ``lora_delta``);
- the adapter gradients of a batch are the pairwise tree of its micro-batches' (one forward
  each), byte for byte, with gradient checkpointing on or off;
- against the FP64 reference model (``references/mmdit.py`` on the FP64-merged weights, the same
  math) within the model's tolerance profile, as strict ``merged`` is;
- refused with a message naming the module and ``--lora-mode merged`` on a Linear outside the
  block GEMMs, and for the bf16-factor mode ``unfused``.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from drifttool.errors import UnsupportedConfigError
from drifttool.fixture import load_fixture
from drifttool.model.checkpoint import load_checkpoint
from drifttool.model.lora import add_lora, lora_modules, lora_parameters
from drifttool.ops.strict_trees import tree_sum_stack
from drifttool.references import mmdit as ref_mmdit
from drifttool.references import ops as ref_ops
from drifttool.runtime import Runtime
from tests.conftest import assert_same_bytes
from tests.model.test_lora import DEAD_IN_LAST_BLOCK, _inputs, _model
from tests.ops import test_reference_accuracy as accuracy

MODE = "unfused-fp32"


def _adapted(mode=MODE, dtype=torch.bfloat16, **kw):
    m = _model(dtype)
    add_lora(m, rank=kw.pop("rank", 4), alpha=8, mode=mode, **kw)
    return m


def test_zero_b_is_the_model_without_an_adapter():
    base, adapted = _model(), _adapted()
    for batch in (1, 3):
        x, txt, mask, tau, grid = _inputs(torch.bfloat16, B=batch)
        with torch.no_grad():
            assert_same_bytes(adapted(x, txt, mask, tau, grid, Runtime(mode="strict")),
                              base(x, txt, mask, tau, grid, Runtime(mode="strict")), f"v, batch {batch}")


def test_the_factors_go_to_the_block_gemms_not_through_lora_operators():
    m = _adapted(init_b_std=0.05)
    x, txt, mask, tau, grid = _inputs(torch.bfloat16)
    strict, production = Runtime(mode="strict"), Runtime(mode="auto")
    with torch.no_grad():
        m(x, txt, mask, tau, grid, strict)
        m(x, txt, mask, tau, grid, production)
    ops = {r["op"] for r in strict.trace.rows()}
    assert not ops & {"lora_merge", "lora_delta", "lora_fuse"}, ops
    assert {"qkv_bias_gemm", "mlp_up_gemm_gelu"} <= ops
    assert "lora_delta" in {r["op"] for r in production.trace.rows()}


OUTSIDE = ("img_in", "txt_in", "proj_out", "norm_out.linear", "img_mod.1",
           "time_text_embed.timestep_embedder.linear_1")


@pytest.mark.parametrize("target", OUTSIDE)
def test_strict_refuses_unfused_outside_the_block_gemms(target):
    m = _adapted(targets=("attn.to_q", target), init_b_std=0.05)
    x, txt, mask, tau, grid = _inputs(torch.bfloat16)
    with pytest.raises(UnsupportedConfigError, match="--lora-mode merged") as e:
        with torch.no_grad():
            m(x, txt, mask, tau, grid, Runtime(mode="strict"))
    named = [n for n in lora_modules(m) if n.endswith(target)]
    assert named and named[0] in str(e.value), str(e.value)
    with torch.no_grad():  # production runs it (lora_delta / the operator's factors)
        m(x, txt, mask, tau, grid, Runtime(mode="auto"))


def test_strict_refuses_the_model_dtype_mode():
    m = _adapted(mode="unfused", init_b_std=0.05)
    x, txt, mask, tau, grid = _inputs(torch.bfloat16)
    with pytest.raises(UnsupportedConfigError, match="runs LoRA modes 'merged' and 'unfused-fp32'"):
        with torch.no_grad():
            m(x, txt, mask, tau, grid, Runtime(mode="strict"))


def test_tp_sp_layouts_refuse_unfused_before_the_run():
    """The branch is not sharded: a TP/SP layout refuses an unfused adapter before the artifact
    opens (``runner.execute``, ``recompute_run``); a CFG-parallel one runs whole branches."""
    from drifttool.distributed.plan import ParallelDims
    from drifttool.model.lora_calls import check_unfused_layout

    m = _adapted()
    for dims in (ParallelDims(tp=2), ParallelDims(sp=4)):
        with pytest.raises(UnsupportedConfigError, match="'unfused-fp32' under TP/SP.*--lora-mode merged"):
            check_unfused_layout(m, dims)
    check_unfused_layout(m, ParallelDims(cfg=2))
    check_unfused_layout(m, None)
    check_unfused_layout(_adapted(mode="merged"), ParallelDims(tp=2))


def test_the_settings_alone_refuse_unfused_under_tp_sp():
    """``check_mode_layout`` (the CLI's check before any rank starts) refuses from the LoRA mode
    and the degrees alone, as the model's call would: every unfused mode under TP or SP > 1."""
    from drifttool.distributed.plan import ParallelDims
    from drifttool.model.lora import LORA_MODES, UNFUSED_MODES
    from drifttool.model.lora_calls import check_mode_layout

    for mode in LORA_MODES:
        for dims in (ParallelDims(tp=2), ParallelDims(sp=2), ParallelDims(tp=2, sp=4)):
            if mode in UNFUSED_MODES:
                with pytest.raises(UnsupportedConfigError, match=f"'{mode}' under TP/SP \\(--tp {dims.tp} "
                                                                 f"--sp {dims.sp}\\).*--lora-mode merged"):
                    check_mode_layout(mode, dims)
            else:
                check_mode_layout(mode, dims)
        check_mode_layout(mode, ParallelDims(cfg=2))
        check_mode_layout(mode, None)
    check_mode_layout(None, ParallelDims(tp=2))


def _grads(m, inputs, rows, checkpointing=False):
    """Adapter gradients of Σ v² over the batch rows ``rows`` (one strict forward)."""
    x, txt, mask, tau, grid = inputs
    for p in lora_parameters(m).values():
        p.grad = None
    m.gradient_checkpointing = checkpointing
    try:
        v = m(x[rows], txt[rows], mask[rows], tau[rows], grid, Runtime(mode="strict"))
        (v.float() ** 2).sum().backward()
    finally:
        m.gradient_checkpointing = False
    return {n: p.grad.clone() for n, p in lora_parameters(m).items() if p.grad is not None}


def test_gradients_are_micro_batch_and_checkpointing_invariant():
    """dA, dB of a batch of 4 (odd prompt lengths, a masked one) = the tree over the per-sample
    gradients = the sum of two aligned micro-batches of 2; checkpointing changes no byte."""
    m = _adapted(rank=3, init_b_std=0.05)
    inputs = _inputs(torch.bfloat16, B=4, L=7, seed=5)
    inputs = (*inputs[:3], torch.tensor([0.9, 0.4, 0.7, 0.2]), inputs[4])
    whole = _grads(m, inputs, slice(0, 4))
    assert len(whole) > 30
    halves = [_grads(m, inputs, slice(a, a + 2)) for a in (0, 2)]
    solo = [_grads(m, inputs, slice(i, i + 1)) for i in range(4)]
    dead = tuple(f"transformer_blocks.1.{t}." for t in DEAD_IN_LAST_BLOCK)
    for name, g in whole.items():
        assert g.dtype == torch.float32 and (name.startswith(dead) or bool(g.any())), name
        assert_same_bytes(g, halves[0][name] + halves[1][name], f"{name}: batch of 4 vs micro-batches of 2")
        assert_same_bytes(g, tree_sum_stack([s[name] for s in solo]), f"{name}: batch of 4 vs tree of samples")
    for name, g in _grads(m, inputs, slice(0, 4), checkpointing=True).items():
        assert_same_bytes(g, whole[name], f"{name}: gradient checkpointing")


# -- accuracy: the FP64 reference model ------------------------------------------------------------

FIXTURE = load_fixture("tiny-t2i")
TOLERANCE = accuracy.TOLERANCES["models"]["mmdit_tiny_t2i"]["strict"]["float32"]


def _merged_fp64(model) -> dict[str, torch.Tensor]:
    """The checkpoint's weights with every adapted W replaced by W + s·(B·A) in FP64
    (``references/ops.lora_merge``): the ideal arithmetic of both merged and unfused LoRA."""
    weights = {k: v.to(torch.float64) for k, v in
               load_file(str(FIXTURE.model_dir / "diffusion_pytorch_model.safetensors")).items()}
    for name, m in lora_modules(model).items():
        weights[f"{name}.weight"] = ref_ops.lora_merge(weights[f"{name}.weight"], m.lora_A.weight.detach(),
                                                       m.lora_B.weight.detach(), float(m.lora_scale))
    return weights


def test_unfused_and_merged_match_the_fp64_reference():
    from tests.model.test_model_reference import CONFIG, _inputs as ref_inputs

    grid = (5, 3)
    inputs = ref_inputs(1, grid)
    out = {}
    for mode in ("merged", MODE):
        model = load_checkpoint(FIXTURE.model_dir, dtype=torch.float32)
        add_lora(model, rank=4, alpha=8, seed=2, init_b_std=0.05, mode=mode)
        with torch.no_grad():
            out[mode] = model(*inputs, grid, Runtime(mode="strict"))
    want = ref_mmdit.forward(_merged_fp64(model), CONFIG, *inputs, grid)
    base = ref_mmdit.forward(_merged_fp64(load_checkpoint(FIXTURE.model_dir, dtype=torch.float32)), CONFIG,
                             *inputs, grid)
    assert (want - base).abs().max() > 100 * TOLERANCE["atol"]  # the adapter moves v well past the tolerance
    for mode, got in out.items():
        accuracy.assert_within(got, want, TOLERANCE["atol"], TOLERANCE["rtol"], f"strict {mode} vs FP64")
    accuracy.assert_within(out[MODE], out["merged"].to(torch.float64), TOLERANCE["atol"], TOLERANCE["rtol"],
                           "strict unfused-fp32 vs strict merged")
