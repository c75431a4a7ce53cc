"""Launch configurations of the strict CUDA GEMM's FP32 (IEEE) path, against its bf16 path.

    $ python benchmarks/sweep_strict_gemm_fp32.py [--quick] [--merge]

A strict model with a LoRA adapter merges it into an FP32 weight (``ops/lora.py``), so every
adapted projection runs ``kernels.gemm.linear`` with bf16 activations × an FP32 weight: the IEEE
FP32 FMA dot (``FP32_CONFIG``), not the tensor cores. For the full-size projections (x [4096,
3072] or [4096, 12288] bf16, w FP32) this times every configuration in ``CONFIGS`` with
``triton.testing.do_bench`` (median, ms) and prints TFLOP/s and the time against the bf16 × bf16
GEMM (``BF16_CONFIG``, the same weight rounded to bf16) and torch's ``F.linear`` (cuBLAS, bf16).
Each configuration's output is compared byte for byte with the registered ``FP32_CONFIG``'s:
the FMA dot of an element does not depend on its tile (``GemmConfig``), so a configuration that
gives other bytes is reported as such, not used. A configuration that fails (compile error,
spills past the register file) prints its error; the rest still run. To register the winner, set
``FP32_CONFIG`` in ``drifttool/ops/strict_cuda/kernels/gemm.py``. ``--merge`` adds the unfused
adapter's up-projection merged into its FP32 pre-activation (K = 16, the GELU in the epilogue),
beside the same launch without the activation and a copy of its bytes. Without CUDA it prints why
and exits 0.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = [(4096, 3072, 3072), (4096, 3072, 12288), (4096, 12288, 3072)]
"""(M tokens, K in, N out): the image stream's attention projections, MLP up and MLP down."""
CONFIGS = [(16, 64, 4, 1), (32, 64, 4, 1), (64, 64, 4, 1), (32, 128, 4, 1), (64, 128, 4, 1),
           (64, 128, 8, 1), (128, 128, 8, 1), (128, 64, 8, 1), (64, 64, 4, 2), (64, 128, 8, 2)]
"""(block_m, block_n, num_warps, num_stages) of ``kernels.gemm.GemmConfig`` (no TMA: FP32 rows)."""


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the first shape and four configurations")
    ap.add_argument("--merge", action="store_true",
                    help="also the unfused adapter's merged up-projection (K = 16, FP32 pre-activation, GELU)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("sweep_strict_gemm_fp32.py needs a CUDA device; nothing measured")
        return
    from triton.testing import do_bench

    from drifttool.ops.strict_cuda.kernels.gemm import BF16_CONFIG, FP32_CONFIG, GemmConfig, linear

    shapes = SHAPES[:1] if args.quick else SHAPES
    configs = CONFIGS[:4] if args.quick else CONFIGS
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"{'M x K -> N':>20}  {'config':>18}  {'ms':>8}  {'TFLOP/s':>8}  {'x bf16 GEMM':>11}  "
          f"{'x cuBLAS':>8}  bytes")
    for m, k, n in shapes:
        x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        w = torch.randn(n, k, device="cuda", generator=g) * 0.02  # FP32, as a merged LoRA weight
        flop = 2 * m * k * n
        ref = linear(x, w, config=FP32_CONFIG)
        wb = w.bfloat16()
        t_bf16 = do_bench(lambda: linear(x, wb, config=BF16_CONFIG))
        t_cublas = do_bench(lambda: F.linear(x, wb))
        name = f"{m}x{k}->{n}"
        print(f"{name:>20}  {'bf16 ' + BF16_CONFIG.id:>18}  {t_bf16:8.3f}  {flop / t_bf16 / 1e9:8.1f}  "
              f"{1.0:11.2f}  {t_bf16 / t_cublas:8.2f}")
        for bm, bn, warps, stages in configs:
            cfg = GemmConfig(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages, tma=False)
            tag = ("* " if cfg == FP32_CONFIG else "") + cfg.id
            try:
                y = linear(x, w, config=cfg)
                t = do_bench(lambda: linear(x, w, config=cfg))
            except Exception as e:  # noqa: BLE001 — one configuration's failure is a result
                print(f"{name:>20}  {tag:>18}  failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
                continue
            same = "same" if _same(y, ref) else "OTHER BYTES"
            print(f"{name:>20}  {tag:>18}  {t:8.3f}  {flop / t / 1e9:8.1f}  {t / t_bf16:11.2f}  "
                  f"{t / t_cublas:8.2f}  {same}")
    print("* the registered FP32_CONFIG; 'x bf16 GEMM': time against the strict bf16 x bf16 GEMM")
    if args.merge:
        merge_roles(configs, do_bench)


MERGES = [(4096, 3072, "gelu_tanh_f32"), (4096, 12288, "gelu_tanh_f32"), (4096, 3072, None)]
"""(M, N, activation) of the unfused adapter's up-projection merged into the FP32 pre-activation:
act(pre + fp32(s)·(u·Bᵀ)), u [M, 16] and B [N, 16] FP32, the bf16 output (``--merge``)."""


def merge_roles(configs, do_bench) -> None:
    """Time the merged up-projection (K = r = 16) under each configuration, beside what bounds it:
    the same launch without the activation, and a copy of its bytes (the FP32 pre-activation
    read, the bf16 output written: ``pre.bfloat16()``)."""
    from drifttool.ops.strict_cuda.kernels.gemm import FP32_CONFIG, GemmConfig, linear

    g = torch.Generator(device="cuda").manual_seed(1)
    print(f"\n{'merge M x 16 -> N':>24}  {'config':>18}  {'ms':>8}  {'no act ms':>9}  {'x copy':>7}  bytes")
    for m, n, act in MERGES:
        u = torch.randn(m, 16, device="cuda", generator=g)
        b = torch.randn(n, 16, device="cuda", generator=g) * 0.01
        pre = torch.randn(m, n, device="cuda", generator=g)
        t_copy = do_bench(lambda: pre.bfloat16())

        def run(cfg, a=act):
            return linear(u, b, None, merge_into=pre, scale=0.5, act=a, out_dtype=torch.bfloat16, config=cfg)

        ref = run(FP32_CONFIG)
        name = f"{m}x16->{n} {act or 'none'}"
        for bm, bn, warps, stages in configs:
            cfg = GemmConfig(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages, tma=False)
            tag = ("* " if cfg == FP32_CONFIG else "") + cfg.id
            try:
                y = run(cfg)
                t = do_bench(lambda: run(cfg))
                t0 = do_bench(lambda: run(cfg, None))
            except Exception as e:  # noqa: BLE001 — one configuration's failure is a result
                print(f"{name:>24}  {tag:>18}  failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
                continue
            same = "same" if _same(y, ref) else "OTHER BYTES"
            print(f"{name:>24}  {tag:>18}  {t:8.3f}  {t0:9.3f}  {t / t_copy:7.2f}  {same}")


if __name__ == "__main__":
    main()
