"""Launch configurations of the strict CUDA GEMM's bf16 path at the forward's shapes.

    $ python benchmarks/sweep_strict_gemm.py [--tokens 6032,6889,128] [--configs 0,1,2] [--out fp32]

One block's four projections of a stream — packed QKV (3072 → 9216, bias), attention out (3072 →
3072, bias), MLP up (3072 → 12288, bias, the FP32 GELU epilogue) and MLP down (12288 → 3072,
bias) — at each row count (image stream: 6032 at 1664×928, 6889 at 1328², batch 1; 12064 at
1664×928 CFG-batched 2; text stream: 128 at batch 1, 256 at batch 2). For each configuration in
``CONFIGS`` it times every projection (median of ``triton.testing.do_bench``, ms), prints
TFLOP/s, the ratio to torch's ``F.linear`` (cuBLAS, bf16) and whether the output equals the
registered configuration's byte for byte (the order over K is the contract; the tile, warps,
stages and persistence are not: ``kernels.gemm.GemmConfig``); then per configuration the four
projections' sum, the time one block spends in that stream's GEMMs. To register a winner, set
``BF16_CONFIG`` in ``drifttool/ops/strict_cuda/kernels/gemm.py``.

``--out fp32`` sweeps the wide path instead (``BF16_WIDE_CONFIG``, the reference of the byte
check): bf16 × bf16 GEMMs with an FP32 output, as a LoRA training step runs most of its GEMMs (an
unfused adapter's FP32 base pre-activation in the forward and its recompute, dX = dY·W of every
adapted projection in the backward), at the three (K, N) of a block (3072 → 3072, 3072 → 12288,
12288 → 3072), without bias or activation. Without CUDA it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from sweep_strict_gemm_fp32 import _same  # noqa: E402  (the byte comparison of every GEMM sweep)

PROJECTIONS = [("qkv", 3072, 9216, None), ("attn_out", 3072, 3072, None), ("mlp_up", 3072, 12288, "gelu_tanh_f32"),
               ("mlp_down", 12288, 3072, None)]
"""(name, K in, N out, activation) of one block's projections of a stream."""
WIDE = [("d→d", 3072, 3072, None), ("d→4d", 3072, 12288, None), ("4d→d", 12288, 3072, None)]
"""``--out fp32``: the (K, N) of a block's GEMMs with an FP32 output (forward and dX alike)."""
CONFIGS = [
    dict(block_m=128, block_n=128, num_warps=8, num_stages=3),
    dict(block_m=128, block_n=256, num_warps=8, num_stages=3),
    dict(block_m=256, block_n=128, num_warps=8, num_stages=3),
    dict(block_m=128, block_n=256, num_warps=8, num_stages=4),
    dict(block_m=128, block_n=128, num_warps=8, num_stages=4),
    dict(block_m=128, block_n=128, num_warps=4, num_stages=4),
    dict(block_m=128, block_n=128, num_warps=8, num_stages=3, persistent=1),
    dict(block_m=128, block_n=128, num_warps=8, num_stages=3, persistent=2),
    dict(block_m=256, block_n=128, num_warps=8, num_stages=3, persistent=1),
    dict(block_m=128, block_n=256, num_warps=8, num_stages=3, persistent=1),
    dict(block_m=128, block_n=128, num_warps=8, num_stages=4, persistent=1),
    dict(block_m=128, block_n=256, num_warps=8, num_stages=2, persistent=1),
]
"""``kernels.gemm.GemmConfig`` fields (TMA loads on; ``persistent``: programs per SM walking
the tiles in turn); the registered ``BF16_CONFIG`` (``--out fp32``: ``BF16_WIDE_CONFIG``) is the
reference of the byte check."""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="6032,6889,12064")
    ap.add_argument("--configs", default="all", help="indices into CONFIGS, e.g. 0,1,3 (default: all)")
    ap.add_argument("--out", default="bf16", choices=("bf16", "fp32"),
                    help="the output's dtype: fp32 sweeps the wide path (BF16_WIDE_CONFIG)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("sweep_strict_gemm.py needs a CUDA device; nothing measured")
        return 0
    from triton.testing import do_bench

    from drifttool.ops.strict_cuda.kernels.gemm import BF16_CONFIG, BF16_WIDE_CONFIG, GemmConfig, linear

    wide = args.out == "fp32"
    out_dtype, registered = (torch.float32, BF16_WIDE_CONFIG) if wide else (torch.bfloat16, BF16_CONFIG)

    picked = CONFIGS if args.configs == "all" else [CONFIGS[int(i)] for i in args.configs.split(",")]
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"{'M':>6} {'projection':>9} {'config':>26} {'ms':>7} {'TFLOP/s':>8} {'/cuBLAS':>7}  same bytes")
    for m in map(int, args.tokens.split(",")):
        sums = {}
        for name, k, n, act in WIDE if wide else PROJECTIONS:
            x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
            w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
            b = None if wide else torch.randn(n, device="cuda", generator=g).bfloat16()
            flop = 2 * m * k * n
            t_ref = do_bench(lambda: F.linear(x, w, b))
            ref = linear(x, w, b, act=act, out_dtype=out_dtype, config=registered)
            for fields in picked:
                cfg = GemmConfig(**fields)
                try:
                    out = linear(x, w, b, act=act, out_dtype=out_dtype, config=cfg)
                    t = do_bench(lambda: linear(x, w, b, act=act, out_dtype=out_dtype, config=cfg))
                except Exception as e:  # noqa: BLE001 - a configuration the compiler refuses
                    print(f"{m:>6} {name:>9} {cfg.id:>26} refused: {type(e).__name__} {str(e)[:80]}")
                    continue
                sums[cfg.id] = sums.get(cfg.id, 0.0) + t
                print(f"{m:>6} {name:>9} {cfg.id:>26} {t:7.3f} {flop / t / 1e9:8.0f} {t / t_ref:7.2f}  "
                      f"{_same(out, ref)}", flush=True)
            print(f"{m:>6} {name:>9} {'cuBLAS (F.linear)':>26} {t_ref:7.3f} {flop / t_ref / 1e9:8.0f}", flush=True)
        for cid, t in sums.items():
            print(f"{m:>6} {'sum of 4':>9} {cid:>26} {t:7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
