"""The production presets on a CUDA device (issue 10 item 4), raw bytes; skipped without a GPU.
Run on the GPU machine with ``python -m pytest tests/gpu``.

* ``diffusers``: drifttool's rollout under the preset equals an unmodified ``QwenImagePipeline``
  run on the GPU at every step (CFG on/off, batch 1 and 3, odd padded prompts, non-square
  grid), driven by the diffusers transformer (capture adapter) and by drifttool's production
  MMDiT. The sampler side (bf16 timestep, CFG renorm in bf16, the scheduler step with its 0-dim
  device sigma) is the preset's; the MMDiT's forward equality on CUDA is item 3's.
* ``flow-grpo``: equals Flow-GRPO's rollout (references/flowgrpo_qwenimage.py) on the GPU, whose
  noise comes from the device's global generator: the test draws the same stream
  (``torch.cuda.manual_seed``) and pins it as the preset's noise.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from drifttool.references import flowgrpo_qwenimage as fg  # noqa: E402
from tests.conftest import assert_same_bytes  # noqa: E402
from tests.diffusers_pipeline import qwen_image_scheduler  # noqa: E402
from tests.sampling.preset_cases import Case, full_mask, make_inputs, models, preset_rollout, run_pipeline  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CASES = [
    Case(batch=1, cfg=True, height=64, width=96, lens=(7,), neg_lens=(5,)),
    Case(batch=3, cfg=True, height=80, width=112, lens=(5, 9, 7), neg_lens=(3, 6, 3)),
    Case(batch=3, cfg=False, height=64, width=96, lens=(5, 9, 7)),
    Case(batch=1, cfg=False, height=1024, width=1024, lens=(13,), steps=3),
]


@pytest.mark.parametrize("model_name", ["diffusers-adapter", "drifttool-mmdit"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_diffusers_preset_equals_the_pipeline_on_cuda(case, model_name):
    inputs = make_inputs(case, seed=7 + case.batch, device="cuda")
    per_step, final, sigmas = run_pipeline(case, inputs, device="cuda")
    assert per_step.device.type == "cuda"
    traj, _ = preset_rollout(models("cuda")[model_name], inputs, case, "diffusers")
    assert traj.latents.device.type == "cuda"
    assert_same_bytes(traj.sigmas.cpu(), sigmas.cpu(), "sigma table")
    for i in range(case.steps):
        assert_same_bytes(traj.latents[i + 1].cpu(), per_step[i].cpu(), f"latents after step {i}")
    assert_same_bytes(traj.latents[-1].cpu(), final.cpu(), "final latents")


@pytest.mark.parametrize("window_size", [0, 2])
def test_flow_grpo_preset_equals_flow_grpo_on_cuda(window_size):
    case = Case(batch=3, cfg=True, height=80, width=112, lens=(5, 9, 7), neg_lens=(3, 3, 3), steps=6)
    seed, (h, w) = 31, case.grid
    inputs = make_inputs(case, seed=seed, device="cuda", common_length=True)
    with torch.random.fork_rng(devices=[torch.cuda.current_device()]):
        torch.cuda.manual_seed(seed)  # Flow-GRPO's draws on the device: x0 in bf16, then per step
        z = torch.randn((case.batch, 1, 16, 2 * h, 2 * w), dtype=torch.bfloat16, device="cuda")
        noise = torch.stack([torch.randn((case.batch, h * w, 64), device="cuda") for _ in range(case.steps)])
    inputs.x0 = z.view(case.batch, 16, h, 2, w, 2).permute(0, 2, 4, 1, 3, 5) \
        .reshape(case.batch, h * w, 64).float()
    inputs.noise = noise
    window = fg.sde_window(case.steps, window_size, (0, 5))
    cond = (inputs.txt, full_mask(inputs.txt, inputs.txt_mask))
    uncond = (inputs.neg_txt, full_mask(inputs.neg_txt, inputs.neg_mask))
    with torch.random.fork_rng(devices=[torch.cuda.current_device()]):
        torch.cuda.manual_seed(seed)
        ref = fg.pipeline_with_logprob(models("cuda")["diffusers-adapter"].transformer,
                                       qwen_image_scheduler(), cond, uncond, height=case.height,
                                       width=case.width, num_inference_steps=case.steps,
                                       true_cfg_scale=4.0, noise_level=1.2, window=window)
    traj, _ = preset_rollout(models("cuda")["diffusers-adapter"], inputs, case, "flow-grpo", window=window)
    for i in range(case.steps + 1):
        assert_same_bytes(traj.latents[i].cpu(), ref["trajectory"][i].cpu(), f"latents {i}")
    for i in range(*window):
        assert_same_bytes(traj.logp[i].cpu(), ref["log_probs"][i].cpu(), f"logp {i}")
