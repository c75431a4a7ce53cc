"""The digest row kernel's settings (``capture.gpu_rows``), timed side by side with a copy.

    $ python benchmarks/sweep_digest_rows.py [--reps 5]

For each candidate in ``CANDIDATES`` (kernel, rows × columns per program step, warps, pipeline
stages, column splits, Σx² accumulator width ``v``, ``regs``: the product's operand through
registers) and each output in ``SHAPES`` (a block's activations, its MLP hidden state and a
CFG-batched 1328² hidden state, bf16, and an fp32 activation), prints the bytes read per second
(median of ``--reps`` replays of a CUDA graph of launches that read about 0.25 GB, timed with
CUDA events: the device's time, not the host's), its ratio to ``x.clone()``'s bandwidth on the
same tensor (bytes read + written per second), and whether the candidate's ``T``, ``T'`` equal
those of the registered setting (``gpu_rows.TILE``, every row) and the CPU's level 1 (the first
and last 64 rows). A candidate that fails to compile or launch prints its error and the sweep
goes on. The last lines name the fastest candidate whose digests agree everywhere, as the
one-line ``TILE`` to register. Without CUDA it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = [((4096, 3072), torch.bfloat16), ((4096, 12288), torch.bfloat16),
          ((13778, 12288), torch.bfloat16), ((4096, 3072), torch.float32)]
_K1 = dict(kernel=1, bm=16, bc=128, warps=4, stages=3, split=4)
CANDIDATES = [_K1] + [dict(kernel=2, bm=bm, bc=bc, warps=w, stages=st, split=sp, v=8, regs=rg)
                      for bm, bc, w, st, sp, rg in [
                          (64, 128, 4, 3, 4, 1), (64, 128, 4, 3, 4, 0), (64, 128, 4, 3, 8, 1),
                          (64, 128, 4, 4, 4, 1), (64, 64, 4, 3, 4, 1), (64, 64, 4, 3, 8, 1),
                          (64, 64, 4, 3, 4, 0), (128, 64, 8, 3, 4, 1), (128, 128, 8, 3, 4, 1),
                          (64, 128, 8, 3, 4, 1)]]
"""Kernel 1 as registered before kernel 2, then kernel 2's settings that compile for sm_90a
without register spills (Triton 3.6; 64 × 256 and 128 × 128 at 4 warps spill)."""


def _time(fn, reps: int, inner: int) -> float:
    """Median seconds of one ``fn`` over ``reps`` replays of a CUDA graph of ``inner`` calls (the
    device's time, not the host's launch overhead; eager launches if capture fails)."""
    fn()
    torch.cuda.synchronize()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(inner):
                fn()
        run = graph.replay
    except Exception:  # noqa: BLE001 - time eager launches instead
        torch.cuda.synchronize()

        def run():
            for _ in range(inner):
                fn()
    run()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / inner)
    return statistics.median(times)


def _name(tile: dict) -> str:
    v = f" v{tile['v']} regs{tile['regs']}" if tile["kernel"] == 2 else ""
    return (f"k{tile['kernel']} {tile['bm']}x{tile['bc']} w{tile['warps']} s{tile['stages']} "
            f"split{tile['split']}{v}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to sweep")
        return 0
    from drifttool.capture import gpu_rows
    from drifttool.capture.digest import _halves, _row_sums

    t_start = time.perf_counter()
    registered = dict(gpu_rows.TILE)
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = []
    for shape, dtype in SHAPES:
        x = torch.randn(shape, device="cuda", generator=g).to(dtype)
        gb = x.numel() * x.element_size() / 1e9
        inner = max(1, min(20, round(0.25 / gb)))  # about 0.25 GB read per graph replay
        clone_gbs = 2 * gb / _time(lambda: x.clone(), args.reps, inner)
        ref_rows, _ = gpu_rows.combine_splits(*gpu_rows.launch(x, registered))
        sample = torch.cat([torch.arange(0, 64), torch.arange(shape[0] - 64, shape[0])]).unique()
        cpu = _row_sums(_halves(x[sample.cuda()].cpu(), 0), 0).t()
        cpu_ok = torch.equal(ref_rows[sample.cuda()].cpu(), cpu)
        cases.append((f"{shape[0]}x{shape[1]} {str(dtype).split('.')[1]}", x, gb, clone_gbs,
                      ref_rows, sample, cpu, inner))
        print(f"{cases[-1][0]}: clone {clone_gbs:,.0f} GB/s (read + written); registered "
              f"{_name(registered)} equals the CPU on {len(sample)} rows: {cpu_ok}", flush=True)
    print(f"\n| candidate | " + " | ".join(c[0] for c in cases) + " | same T, T' |")
    print("|---|" + "---:|" * len(cases) + "---|")
    best = None
    for tile in CANDIDATES:
        cells, same, total = [], True, 0.0
        for name, x, gb, clone_gbs, ref_rows, sample, cpu, inner in cases:
            try:
                rows, _ = gpu_rows.combine_splits(*gpu_rows.launch(x, tile))
                ok = torch.equal(rows, ref_rows) and torch.equal(rows[sample.cuda()].cpu(), cpu)
                t = _time(lambda: gpu_rows.launch(x, tile), args.reps, inner)
                cells.append(f"{gb / t:,.0f} ({gb / t / clone_gbs:.2f})"
                             + ("" if ok else " DIFFERS"))
                same &= ok
                total += t
            except Exception as e:  # noqa: BLE001 - a setting the compiler or the device refuses
                cells.append(f"{type(e).__name__}: {str(e).splitlines()[0][:60]}")
                same, total = False, float("inf")
        print(f"| {_name(tile)} | " + " | ".join(cells) + f" | {'yes' if same else 'NO'} |",
              flush=True)
        if same and (best is None or total < best[0]):
            best = (total, tile)
    print(f"\nGB/s: bytes read per second; (ratio) to x.clone()'s bytes read + written per second. "
          f"{time.perf_counter() - t_start:.0f} s in all.")
    if best is not None:
        print(f"fastest with equal digests (total time over the outputs): {_name(best[1])}")
        print(f"register it in drifttool/capture/gpu_rows.py:  TILE = {best[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
