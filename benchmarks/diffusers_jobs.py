r"""diffusers' and peft's own run of a user's full-size job, timed as ``measure_cli.py`` times
drifttool's: the rows ``full_size_table.py`` puts beside drifttool's (part ``diffusers``).

    $ python benchmarks/diffusers_jobs.py trajectory --checkpoint DIR [--lora ADAPTER] \
          [--height 1024] [--width 1024] [--steps 10] [--batch 1] [--device cuda]
    $ python benchmarks/diffusers_jobs.py recompute --checkpoint DIR --lora ADAPTER ... \
          [--gradient-checkpointing]
    ... (a summary)
    MEASURED {"rc": 0, "wall_s": 61.2, "peak_gpu_gib": 44.1}

Both take the inputs ``drifttool run`` builds for the same settings (``RunSettings.inputs``: the
default fixture's prompt lengths, embeddings drawn at the checkpoint's width, the pinned initial
latents of samples 0..B-1, the fixture's seed), so the transformer sees the shapes drifttool's
does:

* ``trajectory``: an unmodified ``QwenImagePipeline`` around the folder's transformer
  (``QwenImageTransformer2DModel.from_pretrained``, bf16, ``device_map`` ``--device``; no text
  encoder or VAE: the embeddings are passed, ``output_type="latent"``), the adapter loaded as
  diffusers loads one (``load_lora_weights``: unfused, factors in bf16), called with CFG
  ``--cfg-scale`` (diffusers runs the two branches one after the other) for ``--steps`` steps of
  Qwen-Image's scheduler. diffusers' sampler is the ODE; drifttool's rollout adds the SDE window
  (a few elementwise kernels a step).
* ``recompute``: a LoRA training recompute as a peft trainer (Flow-GRPO's) runs it: the adapter
  attached with ``PeftModel.from_pretrained(..., is_trainable=True)`` (FP32 factors, peft's
  default, the base frozen), then per step one forward of both CFG branches batched with grad,
  the CFG combination with Qwen-Image's norm rescale, a scalar loss (the combined velocity
  against a fixed random tensor, standing in for the log-probability's gradient) and its
  backward; the factors' gradients add over the steps (the summary counts the factors with a
  gradient: a layer whose output nothing uses, as the last block's text stream's, gets none). The
  step's latents are the initial ones at every step (the cost does not depend on their values);
  ``--gradient-checkpointing``: diffusers' ``enable_gradient_checkpointing``.

``wall_s``: from after the imports (torch, diffusers and, for ``recompute``, peft) to the end,
the load and the inputs included; ``peak_gpu_gib``: ``torch.cuda.max_memory_allocated`` (null without
CUDA). The exit status is 0, or 2 with one line: argparse's for bad arguments (before anything
runs), or ``error:`` for a folder or adapter diffusers or peft cannot read or an out-of-memory,
the MEASURED line printed then. Runs on the CPU too (``--device cpu``, a small folder). Needs
diffusers (both jobs) and peft (``recompute``): the ``[test]`` extra.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from measure_cli import measured_line  # noqa: E402

JOBS = ("trajectory", "recompute")
SEED = 386
"""The loss's random target's seed."""


def parse(argv: list[str]) -> argparse.Namespace:
    """The job's arguments; ``SystemExit`` 2 with one line (argparse's) for a bad one: a size not a
    multiple of 16, a job without what it needs, a folder or adapter that is not there, a device
    this machine lacks, a library the job needs missing."""
    ap = argparse.ArgumentParser(prog="diffusers_jobs.py", description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("job", choices=JOBS)
    ap.add_argument("--checkpoint", type=Path, required=True, help="a pipeline or transformer folder")
    ap.add_argument("--lora", type=Path, default=None, help="a peft adapter folder (recompute: required)")
    ap.add_argument("--height", type=int, default=1024)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=1, help="logical samples (each with both CFG branches)")
    ap.add_argument("--cfg-scale", type=float, default=4.0)
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default: %(default)s)")
    ap.add_argument("--gradient-checkpointing", action="store_true", help="recompute only")
    args = ap.parse_args(argv)
    if args.height % 16 or args.width % 16 or min(args.height, args.width, args.batch) < 1:
        ap.error("--height and --width must be positive multiples of 16, --batch at least 1")
    if not 2 <= args.steps <= 1000:
        ap.error("--steps: a trajectory takes 2 to 1000 steps (as drifttool run)")
    if args.job == "recompute" and args.lora is None:
        ap.error("recompute trains an adapter: give --lora")
    if args.cfg_scale <= 1:
        ap.error("--cfg-scale must be above 1 (the jobs run both CFG branches)")
    if not args.checkpoint.is_dir():
        ap.error(f"--checkpoint {args.checkpoint}: not a folder (a pipeline or transformer folder)")
    if args.lora is not None and not args.lora.exists():
        ap.error(f"--lora {args.lora}: no such adapter")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: this machine has no CUDA device (--device cpu runs on the CPU)")
    for lib in ("diffusers", *(("peft",) if args.job == "recompute" else ())):
        if importlib.util.find_spec(lib) is None:
            ap.error(f"the {args.job} job needs {lib} (pip install -e '.[test]')")
    return args


def inputs(args: argparse.Namespace, folder: Path):
    """``drifttool run``'s inputs for these settings (``RolloutInputs``, CPU fp32): the spec
    ``run`` resolves, the fixture's seed."""
    from drifttool.model.checkpoint import read_config
    from drifttool.settings import RunSpec, resolve

    fx, settings = resolve(RunSpec(checkpoint=args.checkpoint, steps=args.steps, cfg_scale=args.cfg_scale,
                                   batch=args.batch, height=args.height, width=args.width, mode="auto"))
    built, _ = settings.inputs(fx, read_config(folder))
    return built


def transformer(args: argparse.Namespace):
    from diffusers import QwenImageTransformer2DModel

    folder = args.checkpoint / "transformer" if (args.checkpoint / "model_index.json").exists() else args.checkpoint
    return QwenImageTransformer2DModel.from_pretrained(folder, torch_dtype=torch.bfloat16,
                                                       device_map=args.device), folder


def trajectory(args: argparse.Namespace) -> dict:
    from tests.diffusers_pipeline import tiny_pipeline  # an unmodified QwenImagePipeline, any transformer

    model, folder = transformer(args)
    x = inputs(args, folder)
    pipe = tiny_pipeline(model)
    if args.lora is not None:
        pipe.load_lora_weights(args.lora)
        if not any(hasattr(m, "lora_A") for m in model.modules()):  # diffusers found no weights it reads
            raise ValueError(f"{args.lora}: diffusers' load_lora_weights loaded no LoRA layer from it "
                             f"(it reads pytorch_lora_weights.safetensors, as drifttool's save_lora writes)")
    dev, bf16 = args.device, torch.bfloat16
    neg = x.neg_txt.expand(args.batch, -1, -1)
    neg_mask = None if x.neg_mask is None else x.neg_mask.expand(args.batch, -1).to(dev)
    out = pipe(latents=x.x0.to(dev, bf16), prompt_embeds=x.txt.to(dev, bf16),
               prompt_embeds_mask=None if x.txt_mask is None else x.txt_mask.to(dev),
               negative_prompt_embeds=neg.to(dev, bf16), negative_prompt_embeds_mask=neg_mask,
               true_cfg_scale=args.cfg_scale, height=args.height, width=args.width,
               num_inference_steps=args.steps, max_sequence_length=max(x.txt.shape[1], neg.shape[1]),
               output_type="latent").images
    return {"latents": tuple(out.shape), "finite": bool(torch.isfinite(out).all()),
            "LoRA layers": sum(hasattr(m, "lora_A") for m in model.modules())}


def recompute(args: argparse.Namespace) -> dict:
    from peft import PeftModel

    from drifttool.sampling.inputs import _pad_to  # the right-padding with a key mask run's prompts get

    base, folder = transformer(args)
    x = inputs(args, folder)
    if args.gradient_checkpointing:
        base.enable_gradient_checkpointing()
    model = PeftModel.from_pretrained(base, str(args.lora), is_trainable=True)
    model.train()
    dev, bf16, b = args.device, torch.bfloat16, args.batch
    width = max(x.txt.shape[1], x.neg_txt.shape[1])
    neg, neg_mask = _pad_to(x.neg_txt.expand(b, -1, -1), None if x.neg_mask is None
                            else x.neg_mask.expand(b, -1), width)
    txt, txt_mask = _pad_to(x.txt, x.txt_mask, width)
    emb = torch.cat([neg, txt]).to(dev, bf16)  # [uncond; cond], as a batched-CFG trainer
    mask = torch.cat([neg_mask, txt_mask]).to(dev)
    lat = torch.cat([x.x0, x.x0]).to(dev, bf16)
    target = torch.randn(x.x0.shape, generator=torch.Generator().manual_seed(SEED)).to(dev)
    grid = [(1, args.height // 16, args.width // 16)] * (2 * b)
    for sigma in torch.linspace(1.0, 0.02, args.steps).tolist():
        tau = torch.full((2 * b,), sigma, device=dev, dtype=bf16)
        v = model(hidden_states=lat, encoder_hidden_states=emb, encoder_hidden_states_mask=mask,
                  timestep=tau, img_shapes=grid, return_dict=False)[0].float()
        uncond, cond = v[:b], v[b:]
        comb = uncond + args.cfg_scale * (cond - uncond)  # Qwen-Image's true CFG, norm-rescaled
        comb = comb * (cond.norm(dim=-1, keepdim=True) / comb.norm(dim=-1, keepdim=True))
        (comb * target).sum().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    return {"gradient checkpointing": base.is_gradient_checkpointing, "trainable tensors": len(grads),
            "with gradients": sum(g is not None for g in grads),
            "gradients finite": all(g is None or bool(torch.isfinite(g).all()) for g in grads)}


def main(argv: list[str]) -> int:
    args = parse(argv)
    import diffusers  # noqa: F401  (imported before the clock starts, as measure_cli's CLI import)
    from diffusers.utils import logging as dlogging

    if args.job == "recompute":
        import peft  # noqa: F401

    dlogging.set_verbosity_error()
    t0 = time.perf_counter()
    rc = 0
    try:
        summary = (trajectory if args.job == "trajectory" else recompute)(args)
        print(f"diffusers {args.job}: " + ", ".join(f"{k} {v}" for k, v in summary.items()))
    except torch.OutOfMemoryError:
        print(f"error: out of device memory ({args.job} at {args.height}x{args.width}, batch {args.batch})")
        rc = 2
    except Exception as e:  # noqa: BLE001 - a folder or adapter diffusers or peft cannot read: one line
        print(f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        rc = 2
    print(measured_line(rc, t0), flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
