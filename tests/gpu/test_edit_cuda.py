"""Edit runs (condition images) on a CUDA device, raw bytes; skipped without a GPU. Run on the
GPU machine with ``python -m pytest tests/gpu``.

* One transformer call with condition latents: drifttool's production MMDiT and the diffusers
  capture adapter on CUDA equal diffusers' transformer on ``cat([x, cond])`` with the edit
  pipelines' ``img_shapes`` (sliced to the noisy rows), up to a 1024² output with a 1024²
  condition image (8192 image rows).
* ``diffusers-edit`` / ``diffusers-edit-plus``: the rollout equals an unmodified edit pipeline
  run on the GPU at every step, fed the condition latents the pipeline handed its transformer.
* Strict CUDA family: ``drifttool run --device cuda --mode strict --condition FILE``: a sample
  of ``--samples 1`` equals row 1 of ``--batch 3`` (IDENTICAL records for that sample).
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("diffusers")

from drifttool.runtime import Runtime  # noqa: E402
from drifttool.sampling.inputs import RolloutInputs  # noqa: E402
from tests.conftest import assert_same_bytes  # noqa: E402
from tests.sampling import edit_cases as ec  # noqa: E402
from tests.sampling.preset_cases import Case, diffusers_transformer, models, preset_rollout  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("B, grid, cond_grids", [(1, (4, 6), ((6, 8),)), (2, (3, 5), ((5, 7), (4, 3))),
                                                 (1, (64, 64), ((64, 64),))])
def test_forward_with_conditions_equals_diffusers_on_cuda(B, grid, cond_grids):
    g = torch.Generator().manual_seed(B + len(cond_grids))
    h, w = grid
    nc = sum(a * b for a, b in cond_grids)
    x = torch.randn(B, h * w, 64, generator=g).to(torch.bfloat16).cuda()
    cond = torch.randn(B, nc, 64, generator=g).to(torch.bfloat16).cuda()
    L = 9
    txt = torch.randn(B, L, 32, generator=g).to(torch.bfloat16).cuda()
    mask = torch.stack([torch.arange(L) < L - b for b in range(B)]).cuda()
    tau = torch.full((B,), 0.63, dtype=torch.bfloat16, device="cuda")
    shapes = [[(1, h, w), *((1, a, b) for a, b in cond_grids)]] * B
    with torch.no_grad():
        ref = diffusers_transformer("cuda")(
            hidden_states=torch.cat([x, cond], dim=1), encoder_hidden_states=txt,
            encoder_hidden_states_mask=mask.long(), timestep=tau, img_shapes=shapes,
            return_dict=False)[0][:, : h * w]
        for name, model in models("cuda").items():
            v = model(x, txt, mask, tau.float(), grid, Runtime(mode="auto"), cond=cond,
                      cond_grids=cond_grids)
            assert_same_bytes(v.cpu(), ref.cpu(), f"{name} on cuda: v with conditions {cond_grids}")


def _cuda_pipeline(plus: bool, cpu_pipeline):
    pipe = cpu_pipeline(plus)
    pipe.transformer = diffusers_transformer("cuda")
    pipe.vae = copy.deepcopy(ec.tiny_vae()).cuda()  # the cached CPU VAE stays where it is
    return pipe


@pytest.mark.parametrize("plus", [False, True], ids=["edit", "edit-plus"])
def test_edit_presets_equal_the_pipelines_on_cuda(plus, monkeypatch):
    ec.small_areas(monkeypatch)
    monkeypatch.setattr(ec, "edit_pipeline", lambda p, _orig=ec.edit_pipeline: _cuda_pipeline(p, _orig)
                        if p == plus else _orig(p))
    g = torch.Generator().manual_seed(3 + plus)
    sizes = [(90, 60), (50, 100)] if plus else [(70, 110)]
    images = [ec.random_image(g, w_, h_) for w_, h_ in sizes]
    txt = torch.randn(1, 7, 32, generator=g).to(torch.bfloat16).cuda()
    neg = torch.randn(1, 4, 32, generator=g).to(torch.bfloat16).cuda()
    H, W, steps = 64, 96, 3
    x0 = torch.randn(1, (H // 16) * (W // 16), 64, generator=g).to(torch.bfloat16).cuda()
    ones = lambda t: torch.ones(t.shape[:2], dtype=torch.long, device="cuda")  # noqa: E731
    run = ec.run_edit_pipeline(plus, images if plus else images[0], prompt_embeds=txt,
                               prompt_mask=ones(txt), neg=neg, neg_mask=ones(neg), height=H, width=W,
                               steps=steps, latents=x0.clone())
    grids = tuple(ec.condition_grid(w_, h_) for w_, h_ in sizes)
    n = x0.shape[1]
    inputs = RolloutInputs(sample_ids=[0], x0=x0.float(), txt=txt, img_grid=(H // 16, W // 16),
                           neg_txt=neg, cond=run.hidden_states[:, n:].float(), cond_grids=grids)
    case = Case(batch=1, cfg=True, height=H, width=W, lens=(7,), neg_lens=(4,), steps=steps)
    for name, model in models("cuda").items():
        traj, _ = preset_rollout(model, inputs, case, "diffusers-edit-plus" if plus else "diffusers-edit")
        for i in range(steps):
            assert_same_bytes(traj.latents[i + 1].cpu(), run.per_step[i].cpu(),
                              f"{name} on cuda: latents after step {i}")


def test_strict_cuda_condition_run_is_batch_invariant(tmp_path):
    from safetensors.torch import save_file
    from typer.testing import CliRunner

    from drifttool.artifact.reader import open_run
    from drifttool.cli.app import app

    g = torch.Generator().manual_seed(9)
    save_file({"image_latents": torch.randn(3, 35, 64, generator=g),
               "condition_grids": torch.tensor([[5, 7]])}, str(tmp_path / "c.safetensors"))
    save_file({"image_latents": torch.randn(3, 35, 64, generator=torch.Generator().manual_seed(9))[1:2]
               .contiguous(), "condition_grids": torch.tensor([[5, 7]])}, str(tmp_path / "c1.safetensors"))
    run = ("--device", "cuda", "--mode", "strict", "--steps", "2", "--capture", "L2")
    for out, extra in (("b3", ["--batch", "3", "--condition", tmp_path / "c.safetensors"]),
                       ("s1", ["--samples", "1", "--condition", tmp_path / "c1.safetensors"])):
        res = CliRunner().invoke(app, ["run", "-o", str(tmp_path / out), *run, *map(str, extra)],
                                 catch_exceptions=False)
        assert res.exit_code == 0, res.output
    key = ("phase", "step", "branch", "block", "stream", "op", "call", "index")

    def sample(path):
        r = open_run(path)
        return ({tuple(x[k] for k in key): (x["digest"], x["row_digests"]) for x in r.ops_table().to_pylist()
                 if x["sample"] == 1},
                {(x["step"], x["branch"], x["quantity"]): x["digest"] for x in r.steps_table().to_pylist()
                 if x["sample"] == 1})

    ops3, steps3 = sample(tmp_path / "b3")
    ops1, steps1 = sample(tmp_path / "s1")
    assert ops1 and ops1 == ops3 and steps1 == steps3
