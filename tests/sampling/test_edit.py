"""Edit pipelines (condition images) against the real things, raw bytes.

* RoPE: drifttool's tables for several images (frame position k per image, text offset past the
  largest image) equal diffusers' ``QwenEmbedRope`` on ``img_shapes`` with several entries.
* One transformer call: drifttool's production MMDiT and the diffusers capture adapter, given
  condition latents, equal diffusers' transformer on ``cat([x, cond])`` with the edit pipelines'
  ``img_shapes``, sliced to the noisy rows.
* Whole runs: the ``diffusers-edit`` / ``diffusers-edit-plus`` presets, on the condition latents
  the real ``QwenImageEditPipeline`` / ``QwenImageEditPlusPipeline`` handed their transformer
  (tests/sampling/edit_cases.py), equal the pipelines' latents after every step.
* Strict: a sample's bytes (noisy rows) do not depend on its batch position, its neighbours'
  conditions or prompt padding; the condition does change them (controls).
* Capture names the condition rows; presets and files fail closed.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("diffusers")

from drifttool.capture.layout import canonicalize, row_id  # noqa: E402
from drifttool.errors import DriftToolError, UnsupportedConfigError  # noqa: E402
from drifttool.model.config import tiny  # noqa: E402
from drifttool.model.mmdit import MMDiT, random_init_  # noqa: E402
from drifttool.model.rope import image_positions, rope_tables, text_positions  # noqa: E402
from drifttool.runtime import Runtime  # noqa: E402
from drifttool.sampling.inputs import RolloutInputs, inputs_from_tensors, replay_tensors  # noqa: E402
from drifttool.sampling.presets import check_conditions  # noqa: E402
from tests.conftest import assert_same_bytes  # noqa: E402
from tests.sampling import edit_cases as ec  # noqa: E402
from tests.sampling.preset_cases import Case, diffusers_transformer, models, preset_rollout  # noqa: E402


def _bits(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t).contiguous().view(torch.int32) if t.is_complex() else t


# -- RoPE ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("grids, L", [(((4, 6), (52, 78)), 9), (((3, 5), (7, 4), (2, 9)), 5),
                                      (((8, 2), (1, 1)), 3)])
def test_rope_tables_equal_diffusers_for_several_images(grids, L):
    from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope

    axes = (4, 6, 6)
    ref = QwenEmbedRope(theta=10000, axes_dim=list(axes), scale_rope=True)
    img_r, txt_r = ref([[(1, h, w) for h, w in grids]], device=torch.device("cpu"), max_txt_seq_len=L)
    img, txt = rope_tables(grids[0], L, axes_dims=axes, algorithm="polar", cond_grids=grids[1:])
    assert img.shape == (sum(h * w for h, w in grids), sum(axes) // 2) and txt.shape == (L, sum(axes) // 2)
    assert torch.equal(_bits(img), _bits(img_r)) and torch.equal(_bits(txt), _bits(txt_r))
    # the contract itself: condition image k sits at frame position k, text past the largest
    pos = torch.cat([image_positions(h, w, frame=k) for k, (h, w) in enumerate(grids)])
    assert pos[:, 0].tolist() == sum(([k] * (h * w) for k, (h, w) in enumerate(grids)), [])
    offset = max(max(h // 2, w // 2) for h, w in grids)
    assert text_positions(*grids[0], L, grids[1:])[:, 0].tolist() == list(range(offset, offset + L))


# -- one transformer call -----------------------------------------------------------------------
def _call_inputs(seed, B, grid, cond_grids, L):
    g = torch.Generator().manual_seed(seed)
    h, w = grid
    nc = sum(a * b for a, b in cond_grids)
    x = torch.randn(B, h * w, 64, generator=g).to(torch.bfloat16)
    cond = torch.randn(B, nc, 64, generator=g).to(torch.bfloat16)
    txt = torch.randn(B, L, 32, generator=g).to(torch.bfloat16)
    mask = torch.stack([torch.arange(L) < L - b for b in range(B)])
    tau = torch.full((B,), 0.63, dtype=torch.bfloat16)
    return x, cond, txt, mask, tau


@pytest.mark.parametrize("B, grid, cond_grids", [(1, (4, 6), ((6, 8),)), (2, (3, 5), ((5, 7), (4, 3))),
                                                 (3, (5, 2), ((2, 9), (3, 3), (1, 4)))])
def test_forward_with_conditions_equals_diffusers_transformer(B, grid, cond_grids):
    x, cond, txt, mask, tau = _call_inputs(B * 7 + len(cond_grids), B, grid, cond_grids, 6)
    tr = diffusers_transformer()
    shapes = [[(1, *grid), *((1, a, b) for a, b in cond_grids)]] * B
    with torch.no_grad():
        ref = tr(hidden_states=torch.cat([x, cond], dim=1), encoder_hidden_states=txt,
                 encoder_hidden_states_mask=mask.long(), timestep=tau, img_shapes=shapes,
                 return_dict=False)[0][:, : x.shape[1]]
        for name, model in models().items():
            v = model(x, txt, mask, tau.float(), grid, Runtime(mode="auto"), cond=cond,
                      cond_grids=cond_grids)
            assert v.shape == x.shape[:2] + (64,)
            assert_same_bytes(v, ref, f"{name}: v with condition images {cond_grids}")
        # control: the condition rows matter, and a wrong frame layout is caught
        v0 = models()["drifttool-mmdit"](x, txt, mask, tau.float(), grid, Runtime(mode="auto"))
        assert not torch.equal(v0, ref)


def test_forward_refuses_inconsistent_conditions():
    model = models()["drifttool-mmdit"]
    x, cond, txt, mask, tau = _call_inputs(0, 1, (4, 6), ((6, 8),), 5)
    rt = Runtime(mode="auto")
    with torch.no_grad():
        with pytest.raises(UnsupportedConfigError, match="Nc=48 tokens but the condition grids"):
            model(x, txt, mask, tau.float(), (4, 6), rt, cond=cond, cond_grids=((6, 7),))
        with pytest.raises(UnsupportedConfigError, match="without condition latents"):
            model(x, txt, mask, tau.float(), (4, 6), rt, cond_grids=((6, 8),))
        with pytest.raises(UnsupportedConfigError, match="model dtype"):
            model(x, txt, mask, tau.float(), (4, 6), rt, cond=cond.float(), cond_grids=((6, 8),))


# -- whole runs against the pipelines -----------------------------------------------------------
EDIT_CASES = [
    # (plus, batch, CFG, output px (h, w), condition images (w, h) px, prompt lengths, negative lengths)
    (False, 1, True, (64, 96), [(90, 60)], (7,), (5,)),
    (False, 2, False, (48, 80), [(70, 110)], (4, 9), ()),
    (True, 1, True, (64, 96), [(90, 60), (50, 100)], (6,), (3,)),
]


def _prompts(g, lens, D=32):
    width = max(lens)
    txt = torch.randn(len(lens), width, D, generator=g).to(torch.bfloat16)
    return txt, torch.stack([torch.arange(width) < n for n in lens])


@pytest.mark.parametrize("case", EDIT_CASES, ids=lambda c: f"{'plus' if c[0] else 'edit'}-B{c[1]}-"
                         f"{'cfg' if c[2] else 'nocfg'}-{len(c[4])}img")
def test_edit_presets_equal_the_pipelines_at_every_step(case, monkeypatch):
    plus, B, cfg, (H, W), sizes, lens, neg_lens = case
    ec.small_areas(monkeypatch)
    g = torch.Generator().manual_seed(sum(lens) + 31 * B)
    images = [ec.random_image(g, w, h) for w, h in sizes]
    txt, mask = _prompts(g, lens)
    neg, neg_mask = _prompts(g, neg_lens) if cfg else (None, None)
    h, w = H // 16, W // 16
    x0 = torch.randn(B, h * w, 64, generator=g).to(torch.bfloat16)
    steps = 3
    run = ec.run_edit_pipeline(plus, images if plus else images[0], prompt_embeds=txt,
                               prompt_mask=mask.long(), neg=neg,
                               neg_mask=None if neg is None else neg_mask.long(), height=H, width=W,
                               steps=steps, latents=x0.clone())
    # the contract: [noisy | conditions] tokens, img_shapes = output grid then each image's grid
    grids = tuple(ec.condition_grid(w_, h_) for w_, h_ in sizes)
    assert run.img_shapes == [[(1, h, w), *((1, a, b) for a, b in grids)]] * B
    assert run.hidden_states.shape == (B, h * w + sum(a * b for a, b in grids), 64)
    assert torch.equal(run.hidden_states[:, : h * w], x0)
    assert run.calls == steps * (2 if cfg else 1)
    cond = run.hidden_states[:, h * w:].float()  # the packed VAE latents of the images
    inputs = RolloutInputs(sample_ids=list(range(B)), x0=x0.float(), txt=txt,
                           txt_mask=None if bool(mask.all()) else mask, img_grid=(h, w), neg_txt=neg,
                           neg_mask=None if neg is None or bool(neg_mask.all()) else neg_mask,
                           cond=cond, cond_grids=grids)
    preset = "diffusers-edit-plus" if plus else "diffusers-edit"
    for name, model in models().items():
        traj, _ = preset_rollout(model, inputs, Case(batch=B, cfg=cfg, height=H, width=W, lens=lens,
                                                     neg_lens=neg_lens, steps=steps), preset)
        assert traj.latents.dtype == torch.bfloat16 and traj.complete
        for i in range(steps):
            assert_same_bytes(traj.latents[i + 1], run.per_step[i], f"{name}: latents after step {i}")
    # control: without the conditions the latents are not the pipeline's
    bare = dataclasses.replace(inputs, cond=None, cond_grids=())
    traj, _ = preset_rollout(models()["drifttool-mmdit"], bare, Case(
        batch=B, cfg=cfg, height=H, width=W, lens=lens, neg_lens=neg_lens, steps=steps), "diffusers")
    assert not torch.equal(traj.latents[1], run.per_step[0])


# -- strict invariance --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def strict_model():
    return random_init_(MMDiT(tiny()), seed=3)


def test_strict_condition_rows_keep_noisy_rows_invariant(strict_model):
    """A sample's v bytes with its condition are the same alone, at another batch position next
    to samples with other conditions and prompts, and with its prompt padded (masked)."""
    grid, cond_grids = (3, 5), ((5, 3), (2, 7))
    nc = sum(a * b for a, b in cond_grids)
    g = torch.Generator().manual_seed(77)
    x = torch.randn(3, 15, 64, generator=g)
    cond = torch.randn(3, nc, 64, generator=g)
    txt = torch.randn(3, 11, 32, generator=g)
    lens = [6, 11, 4]
    mask = torch.stack([torch.arange(11) < n for n in lens])
    tau = torch.tensor([0.71, 0.71, 0.71])
    with torch.no_grad():
        batch = strict_model(x, txt, mask, tau, grid, Runtime(mode="strict"), cond=cond,
                             cond_grids=cond_grids)
        for b in range(3):
            alone = strict_model(x[b:b + 1], txt[b:b + 1, : lens[b]], None, tau[:1], grid,
                                 Runtime(mode="strict"), cond=cond[b:b + 1], cond_grids=cond_grids)
            assert torch.equal(alone.view(torch.int32), batch[b:b + 1].view(torch.int32)), b
        # control: another condition changes the sample's noisy rows
        other = strict_model(x[:1], txt[:1, :6], None, tau[:1], grid, Runtime(mode="strict"),
                             cond=cond[1:2], cond_grids=cond_grids)
        assert not torch.equal(other, batch[:1])


def test_strict_rollout_with_conditions_is_batch_invariant(strict_model):
    from drifttool.sampling.config import SamplerConfig
    from drifttool.sampling.rollout import rollout
    from drifttool.sampling.step import sampler_model

    g = torch.Generator().manual_seed(5)
    grid, cond_grids = (2, 3), ((3, 4),)
    B, steps = 3, 3
    inputs = RolloutInputs(
        sample_ids=[4, 9, 2], x0=torch.randn(B, 6, 64, generator=g), txt=torch.randn(B, 5, 32, generator=g),
        txt_mask=torch.stack([torch.arange(5) < n for n in (5, 3, 4)]), img_grid=grid,
        neg_txt=torch.randn(B, 2, 32, generator=g), noise=torch.randn(steps, B, 6, 64, generator=g),
        cond=torch.randn(B, 12, 64, generator=g), cond_grids=cond_grids)
    cfg = SamplerConfig(num_steps=steps, cfg_scale=3.0, eta=1.0)
    full = rollout(sampler_model(strict_model), inputs, cfg, Runtime(mode="strict"))
    for layout in ("batched", "sequential"):
        one = rollout(sampler_model(strict_model), inputs.select([2]),
                      dataclasses.replace(cfg, cfg_layout=layout), Runtime(mode="strict"))
        assert torch.equal(one.latents[:, 0].view(torch.int32), full.latents[:, 2].view(torch.int32))
        assert torch.equal(one.logp[:, 0].view(torch.int32), full.logp[:, 2].view(torch.int32))
    # the training recompute (one sample per trainer forward) re-scores the transitions exactly
    from drifttool.sampling.rollout import recompute
    from drifttool.training.trainer import micro_batched

    with torch.no_grad():
        re = recompute(micro_batched(sampler_model(strict_model), 1), inputs, full.latents, cfg,
                       Runtime(mode="strict"))
    win = [i for i in range(steps) if full.in_window[i]]
    assert win and torch.equal(re.logp[win].view(torch.int32), full.logp[win].view(torch.int32))
    # replay tensors carry the conditions
    back = inputs_from_tensors(replay_tensors(inputs))
    assert back.cond_grids == cond_grids and torch.equal(back.cond, inputs.cond)


# -- capture ------------------------------------------------------------------------------------
def test_capture_names_condition_rows():
    site = {"stream": "joint", "samples": [7], "txt_lens": [2], "img_grid": (2, 3),
            "cond_grids": ((2, 2), (1, 3))}
    out = torch.randn(1, 4 + 6 + 4 + 3, 5)  # [B, L_pad + h*w + Nc, C], L_pad = 4
    (part,) = canonicalize(site, out, "BS.")
    assert part.tensor.shape == (2 + 6 + 7, 5)
    names = [part.rows.row_id(r) for r in range(15)]
    assert names[:2] == [("txt", 0), ("txt", 1)] and names[2] == ("img", 0, 0)
    assert names[8:12] == [("cond", 1, 0, 0), ("cond", 1, 0, 1), ("cond", 1, 1, 0), ("cond", 1, 1, 1)]
    assert names[12:] == [("cond", 2, 0, 0), ("cond", 2, 0, 1), ("cond", 2, 0, 2)]
    img = canonicalize({**site, "stream": "img"}, out[:, 4:], "BS.")[0]
    assert img.rows.row_id(6) == ("cond", 1, 0, 0) and img.tensor.shape[0] == 13
    # from an op record's columns (txt_len, img_h, img_w) the diff names them by condition row
    assert row_id(2 + 6 + 3, 2, 3, 2) == ("cond", 3)
    with pytest.raises(ValueError, match=r"img axis has 13 rows, img_grid \(2, 3\) needs 6"):
        canonicalize({**site, "cond_grids": None, "stream": "img"}, out[:, 4:], "BS.")


def test_strict_capture_records_condition_rows(strict_model, tmp_path):
    """Capture L2 of a conditioned forward: image-stream records hold N + Nc rows, named."""
    from drifttool.capture.recorder import Recorder

    rec = Recorder("L2")
    rt = Runtime(mode="strict", recorder=rec)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad(), rt.scope(phase="rollout", step=0, branch="cond", samples=[3], txt_lens=[4],
                                   img_grid=(2, 3), cond_grids=((3, 2),)):
        strict_model(torch.randn(1, 6, 64, generator=g), torch.randn(1, 4, 32, generator=g), None,
                     torch.tensor([0.5]), (2, 3), rt, cond=torch.randn(1, 6, 64, generator=g),
                     cond_grids=((3, 2),))
    rec.flush()
    ops = rec.ops_table().to_pylist()
    img = [r for r in ops if r["stream"] == "img" and r["op"] == "latent_proj_gemm"]
    assert len(img) == 2 and all(len(r["row_digests"]) == 12 for r in img)  # img_in, proj_out
    joint = [r for r in ops if r["stream"] == "joint"]
    assert joint and all(len(r["row_digests"]) == 4 + 12 for r in joint)
    assert all((r["img_h"], r["img_w"]) == (2, 3) for r in img + joint)


# -- presets and files fail closed ---------------------------------------------------------------
def test_presets_check_condition_counts():
    check_conditions("diffusers-edit", ((4, 6),))
    check_conditions("diffusers-edit-plus", ((4, 6), (3, 3), (2, 2)))
    check_conditions("diffusers", ())
    one = r"1 condition image \(--condition\)"  # one image, not "image(s)"
    for name, grids, msg in (("diffusers-edit", (), f"exactly {one}; the run has 0$"),
                             ("diffusers-edit", ((1, 1),) * 2,
                              f"exactly {one}; the run has 2; several take --preset diffusers-edit-plus$"),
                             ("diffusers-edit-plus", (), f"at least {one}; the run has 0$"),
                             ("diffusers", ((2, 2),), "no condition"),
                             ("flow-grpo", ((2, 2),), "no condition")):
        with pytest.raises(DriftToolError, match=msg):
            check_conditions(name, grids)
    with pytest.raises(DriftToolError, match=r"exactly 1 condition image \(--image\); the run has 2;"):
        check_conditions("diffusers-edit", ((1, 1),) * 2, source="--image")


# -- the pipeline itself, captured -----------------------------------------------------------------
@pytest.mark.parametrize("plus", [False, True], ids=["edit", "edit-plus"])
def test_captured_edit_pipeline_diffs_identical_against_the_edit_preset(plus, monkeypatch, tmp_path):
    """``capture_pipeline`` of an unmodified edit pipeline (its transformer's condition rows in
    the capture) against ``drifttool run --preset diffusers-edit[-plus]`` fed the inputs the
    capture stored, as files (``--prompt-embeds``, ``--latents``, ``--condition``): IDENTICAL,
    every record of every step at L2, condition rows included."""
    from safetensors.torch import load_file, save_file

    from drifttool.adapters.diffusers_pipeline import capture_pipeline
    from drifttool.adapters.diffusers_qwenimage import run_diffusers
    from drifttool.artifact.reader import open_run
    from drifttool.diff.compare import diff_runs
    from drifttool.diff.report import Verdict
    from drifttool.settings import RunSpec

    ec.small_areas(monkeypatch)
    g = torch.Generator().manual_seed(40 + plus)
    sizes = [(90, 60), (50, 100)] if plus else [(70, 110)]
    images = [ec.random_image(g, w_, h_) for w_, h_ in sizes]
    txt, mask = _prompts(g, (6,))
    neg, _ = _prompts(g, (4,))
    H, W = 48, 80
    x0 = torch.randn(1, (H // 16) * (W // 16), 64, generator=g).to(torch.bfloat16)
    pipe = ec.edit_pipeline(plus)
    capture_pipeline(pipe, tmp_path / "pipeline", level="L2", stages=("transformer",),  # the loop alone
                     image=images if plus else images[0],
                     prompt_embeds=txt, prompt_embeds_mask=mask.long(), negative_prompt_embeds=neg,
                     negative_prompt_embeds_mask=torch.ones(neg.shape[:2], dtype=torch.long),
                     latents=x0, height=H, width=W, num_inference_steps=3, true_cfg_scale=4.0)
    got = load_file(str(tmp_path / "pipeline" / "inputs.safetensors"))
    grids = [list(ec.condition_grid(w_, h_)) for w_, h_ in sizes]
    assert got["cond_grids"].tolist() == grids and torch.equal(got["x0"], x0.float())
    files = {"pe": {"prompt_embeds": txt}, "ne": {"prompt_embeds": neg},
             "x0": {"latents": x0},
             "cond": {"image_latents": got["cond"].to(torch.bfloat16), "condition_grids": got["cond_grids"]}}
    for name, t in files.items():
        save_file(t, str(tmp_path / f"{name}.safetensors"))
    preset = "diffusers-edit-plus" if plus else "diffusers-edit"
    run_diffusers(RunSpec(mode="auto", preset=preset, capture="L2", steps=3, height=H, width=W,
                          prompt_embeds=tmp_path / "pe.safetensors",
                          negative_prompt_embeds=tmp_path / "ne.safetensors",
                          latents=tmp_path / "x0.safetensors", condition=tmp_path / "cond.safetensors"),
                  tmp_path / "preset", transformer=diffusers_transformer())
    rep = diff_runs(open_run(tmp_path / "preset"), open_run(tmp_path / "pipeline"))
    assert rep.verdict is Verdict.IDENTICAL, rep.reason
    assert rep.counts["ops"].differ == 0 and rep.counts["ops"].matched > 300
    nc = sum(a * b for a, b in grids)
    rows = [r for r in open_run(tmp_path / "pipeline").ops_table().to_pylist()
            if r["step"] == 0 and r["stream"] == "img" and r["op"] == "latent_proj_gemm"]
    assert rows and all(len(r["row_digests"]) == 15 + nc for r in rows)
