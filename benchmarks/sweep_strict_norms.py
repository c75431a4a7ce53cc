"""The strict CUDA norms' long-row launch configurations, side by side with PyTorch's native norms.

    $ python benchmarks/sweep_strict_norms.py [--quick]

For the AdaLN LayerNorm with modulation (``kernels.norms.ln_modulation``) on the image stream's
[1, 4096, 3072], [1, 6889, 3072] and [2, 6032, 3072] bf16, and the RMSNorm (``rms_norm``) on the
text input [1, 128, 3584] and a [1, 6889, 3072] row block (FP32 out, as ``txt_in_rmsnorm_linear``
calls it), times every configuration in ``CONFIGS`` (tile, warps, rows per program; see
``kernels.norms.LongRows``) with ``triton.testing.do_bench`` (median, ms), and prints the bytes
moved per second (x read once, the output written once) and their share of the H200's 4.8 TB/s.
Each configuration's output is compared byte for byte with the registered configuration's
(``LONG_ROWS``), and the registered output with the strict CPU family's (``drifttool.ops.strict``)
once per shape. The native row is ``F.layer_norm`` then ·(1 + scale) + shift (diffusers'
arithmetic), or ``F.rms_norm``. A configuration that fails prints its error; the rest still run.
To register the winner, set ``LONG_ROWS`` in ``drifttool/ops/strict_cuda/kernels/norms.py``.
Without CUDA it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ROOFLINE = 4.8e12
"""Bytes per second of the H200's HBM3e."""
LN_SHAPES = [(1, 4096, 3072), (1, 6889, 3072), (2, 6032, 3072)]
RMS_SHAPES = [(1, 128, 3584), (1, 6889, 3072)]
CONFIGS = [(10, 2, 1), (10, 1, 1), (10, 4, 1), (11, 2, 1), (11, 4, 1), (12, 4, 1), (9, 2, 1), (10, 2, 2), (10, 1, 4)]
"""(tile_log2, num_warps, rows per program) of ``kernels.norms.LongRows``."""


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                      b.contiguous().view(torch.uint8))


def _cases(quick: bool):
    """(label, run(cfg | None), native(), strict CPU(), bytes moved) per shape."""
    import torch.nn.functional as F

    from drifttool.ops.strict import adaln, embed
    from drifttool.ops.strict_cuda.kernels import norms

    g = torch.Generator(device="cuda").manual_seed(0)
    for b, s, d in LN_SHAPES[:1] if quick else LN_SHAPES:
        x = (torch.randn(b, s, d, device="cuda", generator=g) * 3 + 0.5).bfloat16()
        mod = torch.randn(b, 2 * d, device="cuda", generator=g).bfloat16()
        shift, scale = mod[:, :d], mod[:, d:]  # views into one [B, 2d] tensor, as the model passes them

        def run(cfg, x=x, shift=shift, scale=scale):
            return norms.ln_modulation(x, shift, scale, 1e-6, torch.bfloat16,
                                       long_rows=None if cfg is None else norms.LongRows(*cfg))

        def native(x=x, shift=shift, scale=scale, d=d):
            return F.layer_norm(x, (d,), eps=1e-6) * (1 + scale[:, None]) + shift[:, None]

        def cpu(x=x, shift=shift, scale=scale):
            return adaln.adaln_modulation(x.cpu(), shift.cpu(), scale.cpu(), 1e-6)

        yield f"ln  {b}x{s}x{d}", run, native, cpu, 2 * x.numel() * x.element_size()
    for b, s, d in RMS_SHAPES[:1] if quick else RMS_SHAPES:
        x = (torch.randn(b, s, d, device="cuda", generator=g) * 3).bfloat16()
        gain = torch.randn(d, device="cuda", generator=g).bfloat16()

        def run(cfg, x=x, gain=gain):
            return norms.rms_norm(x, gain, 1e-6, torch.float32,
                                  long_rows=None if cfg is None else norms.LongRows(*cfg))

        def native(x=x, gain=gain, d=d):
            return F.rms_norm(x, (d,), gain, 1e-6)

        def cpu(x=x, gain=gain):
            return embed.rms_parts(x.cpu().float(), 1e-6)[0] * gain.cpu().float()

        yield f"rms {b}x{s}x{d}", run, native, cpu, x.numel() * (x.element_size() + 4)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the first shape of each norm only")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to sweep")
        return 0
    import triton.testing

    from drifttool.ops.strict_cuda.kernels import norms

    print(f"registered LONG_ROWS = {tuple(norms.LONG_ROWS)}  (tile_log2, num_warps, rows)")
    print(f"{'shape':>18} {'config':>12} {'ms':>8} {'GB/s':>7} {'%4.8TB/s':>8} {'/native':>8}  same bytes")
    for label, run, native, cpu, moved in _cases(args.quick):
        base = run(None)
        cpu_same = _same(base.cpu(), cpu())
        t_native = triton.testing.do_bench(native)
        print(f"{label:>18} {'native':>12} {t_native:8.4f} {moved / t_native / 1e6:7.0f} "
              f"{100 * moved / t_native / 1e-3 / ROOFLINE:8.1f} {1.0:8.2f}  registered == strict CPU: {cpu_same}",
              flush=True)
        for cfg in CONFIGS:
            try:
                same = _same(run(cfg), base)
                t = triton.testing.do_bench(lambda cfg=cfg: run(cfg))
                print(f"{label:>18} {str(cfg):>12} {t:8.4f} {moved / t / 1e6:7.0f} "
                      f"{100 * moved / t / 1e-3 / ROOFLINE:8.1f} {t / t_native:8.2f}  {same}", flush=True)
            except Exception as e:  # noqa: BLE001 - a configuration the compiler or the device refuses
                print(f"{label:>18} {str(cfg):>12} failed: {type(e).__name__}: {str(e).splitlines()[0][:90]}",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
