"""The rank-wide kernels of a strict unfused-LoRA training step: launch configurations, timed.

    $ python benchmarks/sweep_strict_lora_grad.py

An unfused adapter adds, per adapted projection of the image stream (4096 rows at 1024²), four
rank-wide FP32 (IEEE) kernels: the GEMMs u = x·Aᵀ (forward, twice with checkpointing) and
du = dt·B (backward) whose output is r = 16 columns wide (``kernels.narrow``: K in segments of
``SEG_K``), and the factor gradients dB = dtᵀ·u [N, r] and dA = duᵀ·x [r, K]
(``kernels.gemm_backward``), whose outputs have too few tiles to fill the GPU in one chain per
tile, so their rows run in segments. For the full-size shapes this times
(``triton.testing.do_bench``, median ms):

* the rank-wide GEMMs: ``kernels.narrow.linear`` under each ``GEMM_CONFIGS`` tile, each output
  compared byte for byte with the registered ``narrow.CONFIG``'s (the FMA dot of an element does
  not depend on its tile), beside the one-chain ``kernels.gemm.linear`` at the same tile (K
  walked in one chain per tile: other bytes, the order before the segments);
* the factor gradients under the registered ``wgrad_config`` (segments of ``SEG_ROWS``), the
  unsegmented 64 × 64 chain of before, and the other ``WGRAD_CONFIGS``: tiles change no byte
  (compared with the registered config of the same segment length); the segment length does.

Without CUDA it prints why and exits 0.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ROWS, R = 4096, 16
WIDTHS = (3072, 12288)
GEMM_CONFIGS = [(32, 16, 2, 3), (16, 16, 2, 3), (32, 16, 2, 1), (64, 16, 4, 3), (32, 16, 4, 3)]
"""(block_m, block_n, num_warps, num_stages) of ``GemmConfig`` (no TMA) for a rank-wide segment.
The FMA order of an element is the same in every one of them."""
TEXT_ROWS = 128
"""The text stream's rows at batch 1 (a padded prompt): the rank-wide GEMMs are timed at these
rows too."""
WGRAD_CONFIGS = [(64, 64, 4, None), (16, 64, 2, 512), (64, 16, 2, 512), (16, 64, 4, 256),
                 (64, 16, 4, 256), (16, 64, 4, 1024), (64, 16, 4, 1024), (16, 128, 4, 512),
                 (128, 16, 4, 512)]
"""(block_n, block_k, num_warps, seg_rows) of ``WgradConfig`` (one stage)."""


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def main() -> int:
    if not torch.cuda.is_available():
        print("sweep_strict_lora_grad.py: no CUDA device here (nothing run)")
        return 0
    from triton.testing import do_bench

    from drifttool.ops.strict_cuda.kernels import gemm, narrow
    from drifttool.ops.strict_cuda.kernels import gemm_backward as gb

    g = torch.Generator().manual_seed(0)

    def rn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype).cuda()

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; rows {ROWS}, rank {R}")
    print("\nrank-wide GEMMs (ms; 'same' = the registered narrow.CONFIG's bytes)")
    for k in WIDTHS:
        cases = {f"u = x·Aᵀ, K {k}": (rn(ROWS, k, dtype=torch.bfloat16), rn(R, k)),
                 f"u = x·Aᵀ, K {k}, {TEXT_ROWS} rows": (rn(TEXT_ROWS, k, dtype=torch.bfloat16), rn(R, k)),
                 f"du = dt·B, N {k}": (rn(ROWS, k), rn(k, R).t())}
        for what, (x, w) in cases.items():
            ref = narrow.linear(x, w)
            base = do_bench(lambda: narrow.linear(x, w))
            chain = do_bench(lambda: gemm.linear(x, w, out_dtype=torch.float32, config=narrow.CONFIG))
            print(f"  {what:28} one chain per tile (before) {chain:8.3f} ms  "
                  f"registered segments {base:8.3f} ms  {chain / base:5.2f}×")
            for bm, bn, nw, ns in GEMM_CONFIGS:
                cfg = gemm.GemmConfig(block_m=bm, block_n=bn, num_warps=nw, num_stages=ns, tma=False)
                try:
                    y = narrow.linear(x, w, config=cfg)
                    ms = do_bench(lambda: narrow.linear(x, w, config=cfg))
                except Exception as e:  # a configuration that does not compile: say so, go on
                    print(f"  {what:28} {cfg.id:22} failed: {type(e).__name__}: {str(e)[:80]}")
                    continue
                print(f"  {what:28} {cfg.id:22} {ms:8.3f} ms  {base / ms:5.2f}× registered  "
                      f"{'same' if _same(y, ref) else 'OTHER BYTES'}")
    print("\nfactor gradients (ms; 'same' = the registered config's bytes at the same segment length)")
    for k in WIDTHS:
        dt, u = rn(1, ROWS, k), rn(1, ROWS, R)
        du, x = rn(1, ROWS, R), rn(1, ROWS, k, dtype=torch.bfloat16)
        live = torch.tensor([ROWS], device="cuda")
        for what, (a, b) in {f"dB [{k}, {R}]": (dt, u), f"dA [{R}, {k}]": (du, x)}.items():
            reg = gb.wgrad_config(a.shape[2], b.shape[2], True)
            refs = {reg.seg_rows: gb.weight_grad_parts(a, b, live)}
            base = do_bench(lambda: gb.weight_grad_parts(a, b, live))
            print(f"  {what:16} registered {reg.id:22} {base:8.3f} ms")
            for bn, bk, nw, seg in WGRAD_CONFIGS:
                cfg = gb.WgradConfig(bn, bk, nw, 1, seg)
                try:
                    p = gb.weight_grad_parts(a, b, live, config=cfg)
                    ms = do_bench(lambda: gb.weight_grad_parts(a, b, live, config=cfg))
                except Exception as e:
                    print(f"  {what:16} {cfg.id:33} failed: {type(e).__name__}: {str(e)[:80]}")
                    continue
                same = "same" if _same(p, refs.setdefault(seg, p)) else "OTHER BYTES"
                print(f"  {what:16} {cfg.id:33} {ms:8.3f} ms  {base / ms:5.2f}× registered  {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
