"""Where a strict CUDA forward spends its time: GPU kernels against host gaps, per kernel.

    $ python benchmarks/profile_strict_forward.py [--layers 60] [--shape 1024x1024] [--batch 1]

One random full-width transformer (``random_model.build``), one strict forward (mode strict, no
capture) after a warm-up, under ``torch.profiler``: the forward's wall time, the sum of its GPU
kernel times (the rest is the GPU waiting for the host), the kernels grouped by name (count,
total ms, share), and the host's Python functions by own time (cProfile of a second forward).
The same for a production (``mode off``) forward beside it, so the two host costs compare.
Without CUDA it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import cProfile
import collections
import pstats
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from drifttool.runtime import Runtime  # noqa: E402

SHAPES = {"1024x1024": (64, 64), "1328x1328": (83, 83), "1664x928": (58, 104)}


def _inputs(batch: int, grid: tuple[int, int]):
    g = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, grid[0] * grid[1], 64, generator=g).bfloat16().cuda()
    txt = torch.randn(batch, 128, 3584, generator=g).bfloat16().cuda()
    lens = [128, 77][:batch]
    mask = None if batch == 1 else (torch.arange(128)[None, :] < torch.tensor(lens)[:, None]).cuda()
    tau = torch.full((batch,), 0.75).cuda()
    scope = dict(phase="rollout", step=0, sigma=0.75, branch=("cond", "uncond")[:batch] if batch > 1 else "cond",
                 samples=[0] * batch, txt_lens=lens, img_grid=grid)
    return x, txt, mask, tau, scope


def _forward(ours, mode: str, inputs, grid) -> None:
    x, txt, mask, tau, scope = inputs
    rt = Runtime(mode=mode)
    with torch.no_grad(), rt.scope(**scope):
        ours(x, txt, mask, tau, grid, rt)


def _kernels(prof) -> tuple[float, list[tuple[str, int, float]]]:
    groups: dict[str, list[float]] = collections.defaultdict(list)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            groups[ev.name[:90]].append(ev.device_time_total / 1e3)
    rows = sorted(((n, len(v), sum(v)) for n, v in groups.items()), key=lambda r: -r[2])
    return sum(r[2] for r in rows), rows


def profile_gpu(fn, title: str, top: int) -> None:
    """Run ``fn`` once untimed (compile, allocator), once timed, once under ``torch.profiler``;
    print its wall time, its GPU kernel time (the rest: the GPU waiting for the host) and its
    ``top`` kernels grouped by name (total ms, count, share)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    busy, rows = _kernels(prof)
    print(f"\n=== {title}: wall {wall:.1f} ms, GPU kernels {busy:.1f} ms ({busy / wall:.0%} busy), "
          f"host gaps ≈ {wall - busy:.1f} ms, {sum(r[1] for r in rows)} kernel launches")
    for name, n, ms in rows[:top]:
        print(f"{ms:9.2f} ms {n:6d}× {ms / busy:6.1%}  {name}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=60)
    ap.add_argument("--shape", default="1024x1024", choices=list(SHAPES))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to profile")
        return 0
    from random_model import build

    _, ours = build(args.layers, "cuda")
    grid = SHAPES[args.shape]
    inputs = _inputs(args.batch, grid)
    for mode in ("off", "strict"):
        profile_gpu(lambda: _forward(ours, mode, inputs, grid), f"mode {mode}: {args.layers} blocks, "
                    f"{args.shape}, batch {args.batch}", args.top)
        pr = cProfile.Profile()
        pr.enable()
        _forward(ours, mode, inputs, grid)
        torch.cuda.synchronize()
        pr.disable()
        print(f"--- host, mode {mode} (cProfile, own time)")
        pstats.Stats(pr).sort_stats("tottime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
