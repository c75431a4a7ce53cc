"""Where a LoRA training step spends its GPU time: strict against production, per kernel.

    $ python benchmarks/profile_training_step.py [--layers 60] [--shape 1024x1024] [--batch 1] \
          [--lora-mode unfused-fp32] [--checkpointing on] [--top 30]

The step of ``bench_training_step.py`` (one random full-width transformer with a rank-``--rank``
LoRA on Flow-GRPO's targets, the forward with autograd, the loss ⟨v, g⟩ and its backward into the
factors), after one untimed step, under ``torch.profiler`` for each family (production: mode
``auto``; strict: the Triton family): the step's wall time, the sum of its GPU kernel times (the
rest is the GPU waiting for the host) and the kernels grouped by name (count, total ms, share of
the family's kernel time), so the backward's costly kernels show against production's. Without
CUDA it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_training_step import LORA_MODES, MODES, inputs, step  # noqa: E402
from profile_strict_forward import SHAPES, profile_gpu  # noqa: E402

from drifttool.model.lora import LORA_TARGET_MODULES, AdapterConfig, attach_lora  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=60)
    ap.add_argument("--shape", default="1024x1024", choices=list(SHAPES))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--lora-mode", default="unfused-fp32", choices=LORA_MODES)
    ap.add_argument("--checkpointing", default="on", choices=("on", "off"))
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to profile")
        return 0
    from random_model import build

    _, model = build(args.layers, "cuda")
    attach_lora(model, AdapterConfig(r=args.rank, lora_alpha=float(args.rank),
                                     target_modules=tuple(sorted(LORA_TARGET_MODULES))),
                init_b_std=0.01, mode=args.lora_mode)
    model.gradient_checkpointing = args.checkpointing == "on"
    grid = SHAPES[args.shape]
    batch_inputs = inputs(args.batch, grid, "cuda")
    for config in MODES:
        profile_gpu(lambda: step(model, config, batch_inputs, grid, grad=True),
                    f"{config}: training step, {args.layers} blocks, {args.shape}, batch {args.batch}, "
                    f"{args.lora_mode}, checkpointing {args.checkpointing}", args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
