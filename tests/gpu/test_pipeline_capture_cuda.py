"""Capturing a diffusers ``QwenImagePipeline`` call on a CUDA device: the output bytes do not
change, the records equal those of drifttool's sampler driving the same transformer on the
device, and the hooks add no host synchronisation per call (only per step and per pipeline call).
Skipped without a GPU; run on the GPU machine with ``python -m pytest tests/gpu``.
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("diffusers")

from drifttool.adapters.diffusers_pipeline import capture_pipeline  # noqa: E402
from drifttool.adapters.diffusers_qwenimage import DiffusersQwenImage, load_transformer  # noqa: E402
from drifttool.artifact.reader import open_run  # noqa: E402
from drifttool.capture.recorder import Recorder  # noqa: E402
from drifttool.runtime import Runtime  # noqa: E402
from drifttool.sampling.inputs import RolloutInputs  # noqa: E402
from drifttool.sampling.rollout import rollout  # noqa: E402
from drifttool.sampling.step import sampler_model  # noqa: E402
from drifttool.settings import RunSpec, resolve  # noqa: E402
from tests.conftest import assert_same_bytes  # noqa: E402
from tests.diffusers_pipeline import tiny_pipeline  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA device")]

KEY = ("step", "block", "stream", "op", "call", "index", "sample", "branch", "role")
DEV = "cuda"


def _inputs(dtype: str, policy: str):
    """The fixture's inputs for 3 samples (odd prompt lengths, masked) on the device, the
    transformer there and the sampler settings that match the pipeline's loop."""
    tr = load_transformer("fixtures/tiny-t2i/transformer", getattr(torch, dtype)).to(DEV)
    fx, s = resolve(RunSpec(mode="auto", cfg_layout="sequential", timestep_policy=policy,
                            eta=0.0, dtype=dtype, batch=3))
    inp, _ = s.inputs(fx, DiffusersQwenImage(tr).config)
    on = lambda t: None if t is None else t.to(DEV)  # noqa: E731
    inp = RolloutInputs(sample_ids=inp.sample_ids, x0=on(inp.x0), txt=on(inp.txt),
                        img_grid=inp.img_grid, txt_mask=on(inp.txt_mask), noise=None,
                        neg_txt=on(inp.neg_txt), neg_mask=on(inp.neg_mask))
    return tr, inp, s.sampler()


def _pipe_kwargs(tr, inp, steps):
    w = tr.dtype
    return dict(prompt_embeds=inp.txt.to(w), prompt_embeds_mask=inp.txt_mask,
                negative_prompt_embeds=inp.neg_txt.to(w), negative_prompt_embeds_mask=inp.neg_mask,
                latents=inp.x0.to(w), height=16 * inp.img_grid[0], width=16 * inp.img_grid[1],
                num_inference_steps=steps, true_cfg_scale=4.0)


def _records(rows, steps):
    return {tuple(r[k] for k in KEY): (r["digest"], r["row_digests"])
            for r in rows if r["step"] in steps}


def test_capture_on_cuda_keeps_the_output_bytes(tmp_path):
    tr, inp, cfg = _inputs("bfloat16", "pipeline_bf16")
    pipe = tiny_pipeline(tr)
    kw = _pipe_kwargs(tr, inp, cfg.num_steps)
    plain = pipe(**kw, output_type="latent").images
    got = capture_pipeline(pipe, tmp_path / "run", level="L2", **kw)
    assert got.output.images.device.type == "cuda"
    assert_same_bytes(got.output.images.cpu(), plain.cpu(), "captured output on cuda")
    assert_same_bytes(pipe(**kw, output_type="latent").images.cpu(), plain.cpu(), "after capture")
    run = open_run(tmp_path / "run")
    run.check()
    assert run.manifest["complete"] and {r["device"] for r in run.trace_rows()} == {"cuda:0"}


@pytest.mark.parametrize("dtype,policy,steps", [("bfloat16", "pipeline_bf16", (-1, 0)),
                                                ("float32", "t_div_1000_fp32", (-1, 0, 1, 2, 3))])
def test_cuda_records_equal_the_sampler_driven_run(dtype, policy, steps, tmp_path):
    """bf16: the first step (the pipeline keeps bf16 latents after it, drifttool fp32);
    fp32: every step (drifttool's sampler is then the pipeline's loop)."""
    tr, inp, cfg = _inputs(dtype, policy)
    rt = Runtime(mode="auto", recorder=Recorder("L2"))
    rollout(sampler_model(DiffusersQwenImage(tr)), inp, cfg, rt)
    rt.recorder.flush()
    capture_pipeline(tiny_pipeline(tr), tmp_path / "pipe", level="L2",
                     **_pipe_kwargs(tr, inp, cfg.num_steps))
    ra = _records(rt.recorder.ops_table().to_pylist(), steps)
    rb = _records(open_run(tmp_path / "pipe").ops_table().to_pylist(), steps)
    uncaptured = {("flow_sde_step_logp", i) for i in (1, 2, 3)}
    assert {k for k in ra if (k[3], k[5]) not in uncaptured} == set(rb)
    differ = sorted({(k[0], k[3], k[5]) for k in rb if ra[k] != rb[k]})
    # bf16: x_next is bf16 in the pipeline, fp32 in drifttool's sampler
    assert differ == ([(0, "flow_sde_step_logp", 0)] if dtype == "bfloat16" else [])


def _syncs(fn) -> int:
    """Host synchronisations of ``fn()`` (torch's sync debug mode, one warning each)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in seen)


def test_capture_adds_host_reads_per_step_not_per_hook(tmp_path):
    """The hooks (hundreds per step) read nothing back: the syncs capture adds grow with the
    steps (one flush each) and not with the operator calls."""
    tr, inp, _ = _inputs("bfloat16", "pipeline_bf16")
    pipe = tiny_pipeline(tr)
    extra = {}
    for steps in (2, 6):
        kw = _pipe_kwargs(tr, inp, steps)
        plain = _syncs(lambda: pipe(**kw, output_type="latent"))
        cap = _syncs(lambda: capture_pipeline(pipe, tmp_path / f"s{steps}", level="L2", **kw))
        extra[steps] = cap - plain
    per_step = (extra[6] - extra[2]) / 4
    print(f"host syncs added by capture: {extra} -> {per_step} per step")
    assert per_step <= 3, extra
