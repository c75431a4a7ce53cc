"""Capturing an unmodified diffusers ``QwenImagePipeline`` call (``capture_pipeline``): the output
bytes do not change, the artifact holds drifttool's identities and the pipeline's own per-step
latents, and every hook is gone afterwards."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest
import torch

from drifttool.adapters.diffusers_pipeline import UNCAPTURED, capture_pipeline
from drifttool.adapters.pipeline_hooks import HOOK_NAME
from drifttool.artifact.reader import open_run
from drifttool.diff.compare import diff_runs
from drifttool.diff.report import Verdict
from drifttool.errors import ArtifactError, DriftToolError, UnsupportedConfigError
from tests.conftest import assert_same_bytes
from tests.diffusers_pipeline import tiny_pipeline

STEPS = 3


@dataclass(frozen=True)
class Case:
    """One pipeline call: prompt lengths (right-padded to ``L``, masked when shorter), negative
    prompt lengths (None: no negative prompt), true-CFG scale, image size in pixels, dtype."""

    name: str
    lens: tuple[int, ...]
    L: int
    neg: tuple[int, ...] | None
    cfg: float
    height: int
    width: int
    dtype: torch.dtype = torch.bfloat16

    @property
    def batch(self) -> int:
        return len(self.lens)

    @property
    def grid(self) -> tuple[int, int]:
        return (self.height // 16, self.width // 16)

    @property
    def cfg_on(self) -> bool:
        return self.neg is not None and self.cfg > 1


CASES = [
    Case("cfg_b3_masks", lens=(7, 4, 1), L=7, neg=(5, 5, 2), cfg=4.0, height=64, width=96),
    Case("cfg_b1_padded_odd_grid", lens=(5,), L=9, neg=(3,), cfg=2.5, height=80, width=48),
    Case("nocfg_b3", lens=(3, 7, 6), L=7, neg=None, cfg=4.0, height=64, width=96),
    Case("cfg_scale_1_b1", lens=(7,), L=7, neg=(7,), cfg=1.0, height=96, width=64),
    Case("cfg_b3_fp32", lens=(2, 7, 5), L=7, neg=(4, 1, 4), cfg=4.0, height=64, width=96,
         dtype=torch.float32),
]


def _mask(lens, L):
    m = torch.arange(L)[None, :] < torch.tensor(lens)[:, None]  # [B, L] right padding
    return m


def pipe_kwargs(case: Case, seed: int, **extra):
    """Fresh random embeddings (masked pads hold garbage, as a real encoder's may), latents."""
    g = torch.Generator().manual_seed(seed)
    kw = dict(prompt_embeds=torch.randn(case.batch, case.L, 32, generator=g).to(case.dtype),
              prompt_embeds_mask=_mask(case.lens, case.L), true_cfg_scale=case.cfg,
              height=case.height, width=case.width, num_inference_steps=STEPS,
              latents=torch.randn(case.batch, case.grid[0] * case.grid[1], 64,
                                  generator=g).to(case.dtype), **extra)
    if case.neg is not None:
        Ln = max(case.neg) + 1
        kw.update(negative_prompt_embeds=torch.randn(case.batch, Ln, 32, generator=g).to(case.dtype),
                  negative_prompt_embeds_mask=_mask(case.neg, Ln))
    return kw


@pytest.fixture(scope="module")
def transformers(random_transformer):
    """The fixture transformer in bf16 and a random one in fp32 (the fp32 case)."""
    from diffusers import QwenImageTransformer2DModel

    bf16 = QwenImageTransformer2DModel.from_pretrained("fixtures/tiny-t2i/transformer",
                                                        torch_dtype=torch.bfloat16).eval()
    return {torch.bfloat16: bf16, torch.float32: random_transformer(seed=5, dtype=torch.float32)}


def _no_hooks_left(pipe):
    import diffusers.models.transformers.transformer_qwenimage as T

    tr = pipe.transformer
    assert not [n for n, m in tr.named_modules() if m._forward_hooks or m._forward_pre_hooks]
    assert HOOK_NAME not in getattr(tr, "_diffusers_hook").hooks
    assert "forward" not in vars(tr) and "step" not in vars(pipe.scheduler)
    assert T.apply_rotary_emb_qwen.__module__ == T.__name__  # not drifttool's wrapper
    assert T.dispatch_attention_fn.__module__ == "diffusers.models.attention_dispatch"


def _steps(run, quantity, branch):
    """``{(step, sample): tensor}`` of one step quantity, decoded from the stored bytes."""
    out = {}
    for r in run.steps_table().to_pylist():
        if r["quantity"] == quantity and r["branch"] == branch:
            dt = {"bfloat16": torch.bfloat16, "float32": torch.float32}[r["dtype"]]
            out[(r["step"], r["sample"])] = torch.frombuffer(
                bytearray(r["data"]), dtype=dt).reshape(r["shape"])
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_capture_keeps_the_output_bytes_and_records_each_step(case, transformers, tmp_path):
    """(a) output latents byte-equal with and without capture; (b) the artifact of every
    shape; (d) step records equal the pipeline's own per-step latents (callback_on_step_end)."""
    pipe = tiny_pipeline(transformers[case.dtype])
    plain = pipe(**pipe_kwargs(case, 11), output_type="latent").images
    seen = []

    def on_step_end(p, i, t, kw):
        seen.append(kw["latents"].clone())
        return {}

    got = capture_pipeline(pipe, tmp_path / "run", level="L2",
                           callback_on_step_end=on_step_end, **pipe_kwargs(case, 11))
    after = pipe(**pipe_kwargs(case, 11), output_type="latent").images
    assert_same_bytes(got.output.images, plain, "captured output")
    assert_same_bytes(after, plain, "output after capture")
    _no_hooks_left(pipe)
    assert (got.complete, got.steps, got.samples) == (True, STEPS, list(range(case.batch)))

    run = open_run(tmp_path / "run")
    run.check()
    m = run.manifest
    assert m["complete"] and m["uncaptured"] == UNCAPTURED
    s = m["settings"]
    assert (s["steps"], s["cfg_scale"], s["img_grid"], s["samples"], s["seed"]) == (
        STEPS, case.cfg, list(case.grid), list(range(case.batch)), None)
    assert s["timestep_policy"] == ("pipeline_bf16" if case.dtype == torch.bfloat16
                                    else "t_div_1000_fp32")
    assert m["model_source"]["implementation"] == "diffusers.QwenImagePipeline"
    assert m["fingerprint"]["scheduler"]["sigma_table"] == pipe.scheduler.sigmas.tolist()

    # (b) identities: branches, samples and each sample's valid text rows (L2 row maps)
    ops = run.ops_table().to_pylist()
    branches = {r["branch"] for r in ops if r["block"] >= 0}
    assert branches == ({"cond", "uncond"} if case.cfg_on else {"cond"})
    for r in ops:
        if r["stream"] == "txt" and r["row_digests"] is not None:
            lens = case.lens if r["branch"] == "cond" else case.neg
            assert r["txt_len"] == lens[r["sample"]], r
        if r["stream"] == "joint" and r["row_digests"] is not None:
            assert (r["img_h"], r["img_w"]) == case.grid
    assert {r["sample"] for r in ops if r["sample"] >= 0} == set(range(case.batch))
    sampler_ops = {(r["op"], r["index"], r["branch"]) for r in ops if r["block"] == -2}
    step_branch = "cfg" if case.cfg_on else "cond"
    assert sampler_ops == {("flow_sigma_table", 0, "none"), ("flow_sde_step_logp", 0, step_branch),
                           *([("cfg_combine_renorm", 0, "cfg")] if case.cfg_on else [])}

    # (d) the step records are the pipeline's own latents and velocities
    x_t, v_t, x_next = (_steps(run, q, step_branch) for q in ("x_t", "v_t", "x_next"))
    sig = pipe.scheduler.sigmas  # [STEPS + 1] fp32
    init = pipe_kwargs(case, 11)["latents"]
    for i in range(STEPS):
        for b in range(case.batch):
            assert_same_bytes(x_next[(i, b)], seen[i][b], f"x_next step {i} sample {b}")
            prev = init[b] if i == 0 else seen[i - 1][b]
            assert_same_bytes(x_t[(i, b)], prev, f"x_t step {i} sample {b}")
            euler = (x_t[(i, b)].float() + (sig[i + 1] - sig[i]) * v_t[(i, b)]).to(case.dtype)
            assert_same_bytes(euler, x_next[(i, b)], f"Euler from v_t step {i} sample {b}")
    if case.cfg_on:
        c, u = _steps(run, "v_t", "cond"), _steps(run, "v_t", "uncond")
        for key, v in v_t.items():
            comb = u[key] + case.cfg * (c[key] - u[key])  # QwenImagePipeline's true CFG
            ref = comb * (torch.norm(c[key], dim=-1, keepdim=True)
                          / torch.norm(comb, dim=-1, keepdim=True))
            assert_same_bytes(ref, v, f"CFG velocity {key}")
    assert not {r["quantity"] for r in run.steps_table().to_pylist()} & set(UNCAPTURED["steps"])


def test_branch_from_call_order_equals_branch_from_cache_context(transformers, tmp_path):
    """Without the pipeline's cache_context the branch comes from the call order: same records."""
    case = CASES[0]
    pipe = tiny_pipeline(transformers[case.dtype])
    capture_pipeline(pipe, tmp_path / "ctx", level="L1", **pipe_kwargs(case, 3))
    tr = pipe.transformer
    tr.cache_context = lambda name, **kw: contextlib.nullcontext()  # the branch name is gone
    try:
        capture_pipeline(pipe, tmp_path / "order", level="L1", **pipe_kwargs(case, 3))
    finally:
        del tr.cache_context
    rep = diff_runs(open_run(tmp_path / "ctx"), open_run(tmp_path / "order"))
    assert rep.verdict is Verdict.IDENTICAL, rep.reason
    assert rep.counts["ops"].matched > 300 and rep.counts["ops"].only_a == 0


def test_two_captures_of_one_call_diff_identical_and_say_what_is_not_captured(transformers,
                                                                               tmp_path):
    case = CASES[0]
    pipe = tiny_pipeline(transformers[case.dtype])
    for name in ("a", "b"):
        capture_pipeline(pipe, tmp_path / name, level="L2", **pipe_kwargs(case, 4))
    rep = diff_runs(open_run(tmp_path / "a"), open_run(tmp_path / "b"))
    assert rep.verdict is Verdict.IDENTICAL, rep.reason
    assert any("does not capture step logp_t, mu, std_t" in n for n in rep.notes)


def test_an_error_inside_the_pipeline_leaves_an_incomplete_artifact_and_no_hooks(transformers,
                                                                               tmp_path):
    case = CASES[2]
    pipe = tiny_pipeline(transformers[case.dtype])

    def stop(p, i, t, kw):
        if i == 1:
            raise RuntimeError("stopped by the callback")
        return {}

    with pytest.raises(RuntimeError, match="stopped by the callback"):
        capture_pipeline(pipe, tmp_path / "cut", callback_on_step_end=stop, **pipe_kwargs(case, 5))
    _no_hooks_left(pipe)
    run = open_run(tmp_path / "cut")
    assert not run.manifest["complete"]
    assert sorted({r["step"] for r in run.steps_table().to_pylist()}) == [0, 1]
    with pytest.raises(ArtifactError, match="exists|overwrite"):  # the artifact is not replaced
        capture_pipeline(pipe, tmp_path / "cut", **pipe_kwargs(case, 5))
    _no_hooks_left(pipe)


def test_capture_at_l0_keeps_step_records_only(transformers, tmp_path):
    pipe = tiny_pipeline(transformers[torch.bfloat16])
    capture_pipeline(pipe, tmp_path / "l0", level="L0", **pipe_kwargs(CASES[1], 6))
    run = open_run(tmp_path / "l0")
    run.check()
    assert run.ops_table().num_rows == 0 and run.steps_table().num_rows == STEPS * 5


def test_capture_refuses_what_it_cannot_capture(transformers, tmp_path):
    from diffusers import FlowMatchHeunDiscreteScheduler

    pipe = tiny_pipeline(transformers[torch.bfloat16])
    kw = pipe_kwargs(CASES[2], 7)
    with pytest.raises(UnsupportedConfigError, match="prompt_embeds"):
        capture_pipeline(pipe, tmp_path / "x", **{**kw, "prompt_embeds": None})
    with pytest.raises(DriftToolError, match="capture level"):
        capture_pipeline(pipe, tmp_path / "x", level="L3", **kw)
    with pytest.raises(DriftToolError, match="expected a diffusers QwenImagePipeline"):
        capture_pipeline(object(), tmp_path / "x", **kw)
    pipe.scheduler = FlowMatchHeunDiscreteScheduler()
    with pytest.raises(UnsupportedConfigError, match="order 2"):
        capture_pipeline(pipe, tmp_path / "x", **kw)
    assert not (tmp_path / "x").exists()
