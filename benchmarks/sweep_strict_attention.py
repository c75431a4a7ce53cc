"""The strict CUDA attention's launch configurations, side by side with cuDNN's masked attention.

    $ python benchmarks/sweep_strict_attention.py [--shapes 1024x1024,1664x928] [--batches 1,2]

For each shape and batch (full width: 24 heads × 128, 128 text slots; batch 2 = CFG-batched with
128 and 77 valid text tokens), times ``kernels.attention.attention`` under each configuration
in ``CONFIGS`` (query rows, warps, pipeline stages, TMA loads) and with FMA contraction on (``fma``: a
contract change, measured to price contract cuda1's choice), checks that every configuration's
output is byte-equal to the registered one (``same bytes``), and times PyTorch's SDPA with the
key mask (cuDNN) and without (flash) on the same tensors. Each cell is the median of
``triton.testing.do_bench``. Without CUDA it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {"1024x1024": 4096, "1328x1328": 6889, "1664x928": 6032}
CONFIGS = [(64, 4, 3), (128, 8, 3), (128, 8, 2), (64, 4, 3, True), (64, 4, 2, True), (64, 4, 4, True),
           (128, 8, 2, True), (128, 8, 3, True), (128, 8, 4, True), (128, 4, 2, True)]
"""(query rows, warps, stages[, TMA]): a fourth entry True loads the whole image blocks' K and V
through TMA descriptors (``kernels.attention._kv_descriptors``); without it, pointers."""


class _FusedLauncher:
    """``_attn_kernel`` with FMA contraction on (the registered kernel compiles it off)."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            kwargs["enable_fp_fusion"] = True
            return launch(*args, **kwargs)

        return run


def joint_inputs(shape: str, b: int, count: int, device: str = "cuda") -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """``count`` random bf16 tensors [b, S, 24, 128] of the shape's joint sequence (S = 128 text
    slots + ``SHAPES[shape]`` image tokens; a generator seeded with ``b``) and the key mask [b, S]
    bool: the text slots valid up to 128 (batch 1) or 128 and 77 (batch 2, CFG-batched)."""
    s = 128 + SHAPES[shape]
    g = torch.Generator(device=device).manual_seed(b)
    tensors = tuple(torch.randn(b, s, 24, 128, device=device, generator=g).bfloat16() for _ in range(count))
    lens = torch.tensor([128, 77][:b], device=device)
    key_mask = torch.ones(b, s, dtype=torch.bool, device=device)
    key_mask[:, :128] = torch.arange(128, device=device)[None, :] < lens[:, None]
    return tensors, key_mask


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1024x1024,1664x928")
    ap.add_argument("--batches", default="1,2")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to sweep")
        return 0
    import torch.nn.functional as F
    import triton.testing

    from drifttool.ops.strict_cuda.kernels import attention as ka

    print(f"{'shape':>10} {'B':>2} {'config':>14} {'ms':>8} {'/cuDNN':>7} {'/flash':>7} {'TFLOP/s':>8}  same bytes")
    for shape in args.shapes.split(","):
        for b in map(int, args.batches.split(",")):
            (q, k, v), key_mask = joint_inputs(shape, b, 3)
            s = q.shape[1]
            masked = b > 1
            km = key_mask if masked else None
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            am = key_mask[:, None, None, :]
            t_cudnn = triton.testing.do_bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=am))
            t_flash = triton.testing.do_bench(lambda: F.scaled_dot_product_attention(qt, kt, vt))
            flop = 4 * b * 24 * s * s * 128
            ref = ka.attention(q, k, v, km, text_len=128)
            rows = []
            for cfg in CONFIGS:
                try:
                    out = ka.attention(q, k, v, km, text_len=128, config=cfg)
                    t = triton.testing.do_bench(lambda: ka.attention(q, k, v, km, text_len=128, config=cfg))
                    rows.append((str(cfg), t, torch.equal(out.view(torch.int16), ref.view(torch.int16))))
                except Exception as e:  # noqa: BLE001 - a configuration the compiler refuses
                    print(f"{shape:>10} {b:>2} {str(cfg):>14} refused: {type(e).__name__} {str(e)[:80]}")
            saved = ka._attn_kernel
            ka._attn_kernel = _FusedLauncher(saved)
            try:
                out = ka.attention(q, k, v, km, text_len=128)
                t = triton.testing.do_bench(lambda: ka.attention(q, k, v, km, text_len=128))
                rows.append(("fma", t, torch.equal(out.view(torch.int16), ref.view(torch.int16))))
            finally:
                ka._attn_kernel = saved
            for name, t, same in rows:
                print(f"{shape:>10} {b:>2} {name:>14} {t:8.3f} {t / t_cudnn:7.2f} {t / t_flash:7.2f} "
                      f"{flop / t / 1e9:8.0f}  {same}")
            print(f"{shape:>10} {b:>2} {'cuDNN masked':>14} {t_cudnn:8.3f}   flash {t_flash:.3f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
