"""Write a random full-width Qwen-Image pipeline folder (sharded bf16 safetensors with an index),
and optionally a random LoRA adapter, for full-size runs without the real weights.

    $ python benchmarks/make_random_checkpoint.py --layers 60 --out /dev/shm/qwen \
          --lora /dev/shm/qwen-lora.safetensors

The folder holds ``model_index.json`` and ``transformer/`` (``config.json``,
``diffusion_pytorch_model-0000k-of-0000n.safetensors`` and the index), as
``QwenImagePipeline.save_pretrained`` writes the transformer; ``drifttool run --checkpoint`` and
diffusers' ``from_pretrained`` both read it. The adapter targets the attention projections of both
streams (rank 64, alpha 128, as Flow-GRPO's ``pickscore_qwenimage`` config) with ``lora_B`` drawn
N(0, 1e-3²), so it changes the output.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from random_model import build  # noqa: E402

from drifttool.model.checkpoint import save_checkpoint  # noqa: E402
from drifttool.model.lora import attach_lora  # noqa: E402
from drifttool.model.lora_io import save_lora  # noqa: E402
from drifttool.model.lora_formats import AdapterConfig  # noqa: E402

TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=60)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--lora", type=Path, default=None)
    ap.add_argument("--shard-gb", type=float, default=5.0)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    t0 = time.perf_counter()
    _, ours = build(args.layers, args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "model_index.json").write_text(json.dumps(
        {"_class_name": "QwenImagePipeline", "transformer": ["diffusers", "QwenImageTransformer2DModel"]},
        indent=2) + "\n")
    save_checkpoint(ours, args.out / "transformer", max_shard_bytes=int(args.shard_gb * 2**30))
    size = sum(f.stat().st_size for f in (args.out / "transformer").iterdir())
    print(f"wrote {args.out} ({size / 2**30:.1f} GiB, {args.layers} blocks) in {time.perf_counter() - t0:.0f} s")
    if args.lora is not None:
        attach_lora(ours, AdapterConfig(r=64, lora_alpha=128, target_modules=TARGETS), seed=0,
                    init_b_std=1e-3)
        save_lora(ours, args.lora)
        print(f"wrote {args.lora}")


if __name__ == "__main__":
    main()
