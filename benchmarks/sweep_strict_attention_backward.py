"""The strict CUDA attention backward's launch configurations, side by side with cuDNN's.

    $ python benchmarks/sweep_strict_attention_backward.py [--shapes 1024x1024,1664x928] [--batches 1,2]

For each shape and batch (full width: 24 heads × 128, 128 text slots; batch 2 = CFG-batched with
128 and 77 valid text tokens), times ``kernels.attention_backward.attention_grads`` with the dK/dV
kernel under each configuration in ``DKV`` (query rows a tile, warps, pipeline stages, keys a
program) and the dQ kernel under each in ``DQ`` (query rows, warps, stages), the other kernel
left at its registered configuration, and checks that each configuration's dQ, dK and dV are
byte-equal to the registered configuration's (``same bytes``: a configuration that changes them
would be a change of the contract, ``grad.cuda1``). Beside them: the registered backward whole
(D, dQ, dK/dV) and PyTorch's masked SDPA backward (cuDNN) on the same tensors, both measured as
(forward + backward) − forward. Each cell is the median of ``triton.testing.do_bench``. Without
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

from sweep_strict_attention import joint_inputs  # noqa: E402

DKV = [(128, 8, 2), (128, 8, 3), (64, 4, 2), (64, 8, 2), (64, 4, 3), (32, 4, 2),
       (64, 8, 2, 128), (32, 4, 2, 128), (32, 8, 2, 128), (64, 8, 3, 128), (16, 4, 2, 128)]
"""dK/dV: (query rows a tile, warps, stages[, keys a program: one 64-key block unless given]);
the registered configuration first (the ``/registered`` column's base)."""
DQ = [(128, 8, 3), (128, 8, 2), (64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 4, 2)]
"""dQ and D: (query rows a program, warps, stages)."""


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


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
    from drifttool.ops.strict_cuda.kernels import attention_backward as kb

    print(f"{'shape':>10} {'B':>2} {'kernel':>5} {'config':>18} {'ms':>8} {'/registered':>11}  same bytes")
    for shape in args.shapes.split(","):
        for b in map(int, args.batches.split(",")):
            (q, k, v, do), key_mask = joint_inputs(shape, b, 4)
            km = key_mask if b > 1 else None
            o, ml = ka.attention(q, k, v, km, text_len=128, with_stats=True)
            ref = kb.attention_grads(do, q, k, v, o, ml, km, text_len=128)

            def grads(configs=None, needs=(True, True, True)):
                return kb.attention_grads(do, q, k, v, o, ml, km, text_len=128, needs=needs, configs=configs)

            t_whole = triton.testing.do_bench(grads)
            leaves = [t.detach().transpose(1, 2).requires_grad_(True) for t in (q, k, v)]
            am, do_h = key_mask[:, None, None, :], do.transpose(1, 2)

            def sdpa():
                return F.scaled_dot_product_attention(*leaves, attn_mask=am)

            t_cudnn = (triton.testing.do_bench(lambda: torch.autograd.grad(sdpa(), leaves, do_h))
                       - triton.testing.do_bench(sdpa))
            t_reg = {}
            for kernel, cfgs in (("dkv", DKV), ("dq", DQ)):
                needs = (kernel == "dq", kernel == "dkv", kernel == "dkv")
                for cfg in cfgs:
                    configs = (cfg, kb.DQ_CONFIG) if kernel == "dkv" else (kb.DKV_CONFIG, cfg)
                    try:
                        out = grads(configs, needs)
                        t = triton.testing.do_bench(lambda: grads(configs, needs))
                    except Exception as e:  # noqa: BLE001 - a configuration the compiler refuses
                        print(f"{shape:>10} {b:>2} {kernel:>5} {str(cfg):>18} refused: {type(e).__name__} "
                              f"{str(e)[:80]}")
                        continue
                    same = all(_same(x, y) for x, y, n in zip(out, ref, needs) if n)
                    t_reg.setdefault(kernel, t)
                    print(f"{shape:>10} {b:>2} {kernel:>5} {str(cfg):>18} {t:8.3f} {t / t_reg[kernel]:11.2f}  "
                          f"{same}", flush=True)
            print(f"{shape:>10} {b:>2} backward whole (registered) {t_whole:.3f} ms; cuDNN masked backward "
                  f"{t_cudnn:.3f} ms; strict/cuDNN {t_whole / t_cudnn:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
