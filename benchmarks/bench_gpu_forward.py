"""Full-size forward on one GPU: diffusers, drifttool production and strict (the Triton family), and
each with capture at L1 / L2, side by side in one process.

    $ python benchmarks/bench_gpu_forward.py [--layers 60] [--repeat 3]
    shape  batch  config          median ms  ratio vs diffusers  records/forward

One random full-width Qwen-Image transformer (``--layers`` blocks of d = 3072, 24 heads,
bf16 weights built directly on the device, std 0.02) is shared by diffusers'
``QwenImageTransformer2DModel`` and drifttool's ``MMDiT`` (same storage). Each configuration runs
one transformer forward (a denoising step's model call; batch 2 = CFG-batched cond + uncond with
prompts of 128 and 77 valid tokens of 128 slots) at each RFC reference shape; capture
configurations flush their recorder after the forward, as the sampler does once per step (so the
time includes the digests' read-back). Configurations are interleaved across repeats; the
median is reported. A second table gives the digest kernel's throughput against a device copy.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from drifttool.adapters.diffusers_qwenimage import DiffusersQwenImage, instrument  # noqa: E402
from drifttool.capture import gpu_rows  # noqa: E402
from drifttool.capture.recorder import Recorder  # noqa: E402
from drifttool.model.graphs import GraphedForward  # noqa: E402
from drifttool.runtime import Runtime  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from random_model import build  # noqa: E402

SHAPES = {"1024x1024": (64, 64), "1328x1328": (83, 83), "1664x928": (58, 104)}
CONFIGS = ("diffusers", "diffusers+L1", "diffusers+L2", "production", "production+L1",
           "production+L2", "strict", "strict+L1", "production+graph", "strict+graph",
           "production+L1+graph", "strict+L1+graph", "strict+serial+graph", "strict+L1+rows+graph",
           "diffusers+graph", "diffusers+L1+graph", "diffusers+L1+each+graph", "strict+L1+each+graph")
"""``+graph``: the forward (and its capture) replayed from a CUDA graph (``GraphedForward``; its
first two calls, the warm-up and the capture, fall in the untimed warm-up round; diffusers' through
the capture adapter's model call, ``DiffusersQwenImage``, hooks and all); ``+serial``:
the graph on one CUDA stream (``GraphedForward(lanes=False)``; without it each block's text
stream runs on a second stream, ``drifttool.model.lanes``); ``+alt``: the strict bf16 GEMMs
launched with ``--gemm``'s configuration instead of the registered one (the same bytes: the
tile is not part of the contract), to weigh a candidate in the whole forward; ``+rows``: every
captured output digested by the row kernel, the strict GEMMs writing no row tables in their
epilogues (``capture.produced.ENABLED`` off; the same digests); ``+unfused``: at L2 the attention's
scores and probabilities computed by its decomposition, stored and read again, rather than
digested in the fused kernel (``ops.registry.internals_from_tables`` off; the same records);
``+nointernals``: L2 without the attention's internals (``drifttool run --no-internals``);
``+each``: with ``+graph``, a row-kernel launch per captured output recorded in the graph
(``GraphedForward(batch_digests=False)``) instead of a launch per batch of about a block's
outputs (``capture.gpu_row_batch``; the same digests); ``+lane``: with ``+graph``, those batched
launches on a stream of their own, overlapping the next block (``gpu_row_batch.LANE``)."""
ALT_GEMM: dict[str, int] = {}
"""``--gemm``: the ``kernels.gemm.GemmConfig`` fields of the ``+alt`` configs."""
GRAPHED: dict[str, GraphedForward] = {}


def inputs(batch: int, grid: tuple[int, int], device: str):
    g = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, grid[0] * grid[1], 64, generator=g).bfloat16().to(device)
    txt = torch.randn(batch, 128, 3584, generator=g).bfloat16().to(device)
    lens = [128, 77][:batch]
    mask = None if batch == 1 else (torch.arange(128)[None, :] < torch.tensor(lens)[:, None]).to(device)
    tau = torch.full((batch,), 0.75).to(device)
    scope = dict(phase="rollout", step=0, sigma=0.75, branch=("cond", "uncond")[:batch] if batch > 1 else "cond",
                 samples=[0] * batch if batch > 1 else [0], txt_lens=lens, img_grid=grid)
    return x, txt, mask, tau, scope


def forward(config: str, tr, ours, x, txt, mask, tau, grid, scope) -> int:
    """One forward of ``config``; returns the number of op records captured."""
    impl, *extra = config.split("+")
    graph = "graph" in extra
    level = next((e for e in extra if e.startswith("L")), "")
    rec = Recorder(level) if level else None
    mode = "strict" if impl == "strict" else ("auto" if rec else "off")
    rt = Runtime(mode=mode, recorder=rec, internals=False if "nointernals" in extra else None)
    with (torch.no_grad(), rt.scope(**scope), alt_gemm("alt" in extra), row_kernel_only("rows" in extra),
          unfused_internals("unfused" in extra), digest_lane("lane" in extra)):
        if impl == "diffusers" and graph:  # the adapter's call: its hooks run at capture, a replay runs none
            fast = GRAPHED.setdefault(config, GraphedForward(DiffusersQwenImage(tr),
                                                             batch_digests="each" not in extra))
            fast(x, txt, mask, tau, grid, rt)
        elif impl == "diffusers":
            ctx = instrument(tr, rt) if rec else contextlib.nullcontext()
            with ctx:
                tr(hidden_states=x, encoder_hidden_states=txt, encoder_hidden_states_mask=mask,
                   timestep=tau, img_shapes=[(1, *grid)] * x.shape[0], return_dict=False)
        elif graph:
            fast = GRAPHED.setdefault(config, GraphedForward(ours, lanes="serial" not in extra,
                                                             batch_digests="each" not in extra))
            fast(x, txt, mask, tau, grid, rt)
        else:
            ours(x, txt, mask, tau, grid, rt)
    if rec is None:
        return 0
    rec.flush()
    return rec.ops_table().num_rows


def _patched(on: bool, module, name: str, value):
    """Within (``on``): ``module.name`` is ``value``."""
    return mock.patch.object(module, name, value) if on else contextlib.nullcontext()


def alt_gemm(on: bool):
    """Within (``on``): the strict bf16 GEMMs launch with ``ALT_GEMM``, else as registered."""
    if not on:  # no Triton import
        return contextlib.nullcontext()
    from drifttool.ops.strict_cuda.kernels import gemm

    return _patched(on, gemm, "BF16_CONFIG", gemm.GemmConfig(**ALT_GEMM))


def row_kernel_only(on: bool):
    """Within (``on``): no producing kernel writes a row table (``capture.produced.ENABLED``)."""
    from drifttool.capture import produced

    return _patched(on, produced, "ENABLED", False)


def digest_lane(on: bool):
    """Within (``on``): a graph's batched row-kernel launches run on a stream of their own
    (``capture.gpu_row_batch.LANE``)."""
    from drifttool.capture import gpu_row_batch

    return _patched(on, gpu_row_batch, "LANE", True)


def unfused_internals(on: bool):
    """Within (``on``): the fused attention's L2 internals run as its decomposition."""
    from drifttool.ops import registry

    return _patched(on, registry, "internals_from_tables", lambda rt: False)


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def digest_throughput(device: str) -> list[tuple[str, float, float]]:
    rows = []
    for shape in ((4096, 3072), (4096, 12288), (6889 * 2, 12288)):
        x = torch.randn(shape, device=device).bfloat16()
        gpu_rows.row_table(x)
        n = 20
        t_d = timed(lambda: [gpu_rows.row_table(x) for _ in range(n)]) / n
        t_c = timed(lambda: [x.clone() for _ in range(n)]) / n
        gb = x.numel() * x.element_size() / 1e9
        rows.append((f"{shape[0]}x{shape[1]} bf16", gb / t_d, 2 * gb / t_c))
    return rows


SWEEP = [dict(bm=16, bc=128, warps=4, split=k) for k in (1, 2, 4, 8)] + [
    dict(bm=32, bc=128, warps=4, split=4), dict(bm=16, bc=64, warps=4, split=4),
    dict(bm=16, bc=256, warps=8, split=4), dict(bm=64, bc=128, warps=8, split=8)]


def sweep(device: str) -> dict:
    """Time the row kernel's settings (``SWEEP``) on 4096 × 3072 and 4096 × 12288 bf16 outputs
    (a block's activations and its MLP hidden state at 1024²); prints GB/s and returns the
    settings with the best total time."""
    xs = [torch.randn(4096, n, device=device).bfloat16() for n in (3072, 12288)]
    saved, best = dict(gpu_rows.TILE), (float("inf"), None)
    for tile in SWEEP:
        gpu_rows.TILE.update(tile, stages=3)
        try:
            rates, total = [], 0.0
            for x in xs:
                gpu_rows.row_table(x)
                t = timed(lambda: [gpu_rows.row_table(x) for _ in range(10)]) / 10
                rates.append(x.numel() * 2 / 1e9 / t)
                total += t
            print(f"sweep {tile}: " + ", ".join(f"{r:.0f}" for r in rates) + " GB/s", flush=True)
            best = min(best, (total, tuple(tile.items())))
        except Exception as e:  # noqa: BLE001 - a setting the compiler refuses
            print(f"sweep {tile}: {type(e).__name__} {str(e)[:100]}", flush=True)
    gpu_rows.TILE.update(saved)
    return dict(best[1]) if best[1] else {}


def host_profile(fn, title: str, top: int) -> None:
    """cProfile of one call of ``fn`` (the device synchronised before the profile stops): the
    ``top`` Python functions by own time, under ``title``."""
    import cProfile
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    fn()
    torch.cuda.synchronize()
    pr.disable()
    print(title)
    pstats.Stats(pr).sort_stats("tottime").print_stats(top)


def profile(tr, ours, device: str) -> None:
    """cProfile of one L1 forward of each implementation at 1024², batch 1 (host time)."""
    x, txt, mask, tau, scope = inputs(1, SHAPES["1024x1024"], device)
    for c in ("diffusers+L1", "production+L1"):
        forward(c, tr, ours, x, txt, mask, tau, SHAPES["1024x1024"], scope)
        host_profile(lambda: forward(c, tr, ours, x, txt, mask, tau, SHAPES["1024x1024"], scope),
                     f"--- profile {c}", 22)


def kernels(configs: list[str], tr, ours, shape: str, batch: int, device: str) -> None:
    """Per config: wall time against GPU kernel time, the kernels grouped by name
    (``profile_strict_forward.profile_gpu``), then the host's Python functions by own time."""
    from profile_strict_forward import profile_gpu

    grid = SHAPES[shape]
    x, txt, mask, tau, scope = inputs(batch, grid, device)
    for c in configs:
        def fn(c=c):
            forward(c, tr, ours, x, txt, mask, tau, grid, scope)
        fn()
        profile_gpu(fn, f"{c}, {shape}, batch {batch}", 18)
        host_profile(fn, f"--- host, {c} (cProfile, own time)", 14)
    for fast in GRAPHED.values():
        fast.reset()
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=60)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--batches", default="1,2")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--sweep", action="store_true", help="time the row kernel's tile choices first")
    ap.add_argument("--gemm", default="",
                    help="GemmConfig fields of the +alt configs, e.g. block_n=128,persistent=0 (the tile "
                         "registered before 128×256 persistent)")
    ap.add_argument("--tile", default="", help="row kernel settings, e.g. bm=32,bc=256,warps=8")
    ap.add_argument("--profile", action="store_true", help="profile one L1 forward per implementation")
    ap.add_argument("--kernels", default="", help="configs whose GPU kernels and host time to profile "
                    "at the first shape and batch, e.g. strict+graph,strict+L1+graph")
    args = ap.parse_args()
    ALT_GEMM.update({k: int(v) for k, _, v in (f.partition("=") for f in args.gemm.split(",") if f)})
    if not ALT_GEMM and any("+alt" in c for c in args.configs.split(",")):
        sys.exit("bench_gpu_forward.py: the +alt configs need --gemm FIELDS (e.g. --gemm block_n=128,persistent=0)")
    device = "cuda"
    if args.sweep:
        gpu_rows.TILE.update(sweep(device))  # the forward runs with the fastest setting
    for item in filter(None, args.tile.split(",")):
        key, _, value = item.partition("=")
        gpu_rows.TILE[key] = int(value)
    print("row kernel:", gpu_rows.TILE)
    tr, ours = build(args.layers, device)
    if args.profile:
        profile(tr, ours, device)
    if args.kernels:
        kernels(args.kernels.split(","), tr, ours, args.shapes.split(",")[0],
                int(args.batches.split(",")[0]), device)
    configs = args.configs.split(",")
    results = []
    for shape in args.shapes.split(","):
        grid = SHAPES[shape]
        for batch in map(int, args.batches.split(",")):
            x, txt, mask, tau, scope = inputs(batch, grid, device)
            times = {c: [] for c in configs}
            records = {}
            for c in configs:  # warm-up (Triton and cuBLAS autotuning, allocator; graph capture)
                records[c] = forward(c, tr, ours, x, txt, mask, tau, grid, scope)
                if c.endswith("+graph"):
                    forward(c, tr, ours, x, txt, mask, tau, grid, scope)
            for _ in range(args.repeat):
                for c in configs:
                    times[c].append(timed(lambda: forward(c, tr, ours, x, txt, mask, tau, grid, scope)))
            base = statistics.median(times[configs[0]])
            for c in configs:
                med = statistics.median(times[c])
                results.append((shape, batch, c, med * 1e3, med / base, records[c]))
                print(f"{shape} b{batch} {c}: {med * 1e3:.1f} ms ({med / base:.3f})", flush=True)
            for fast in GRAPHED.values():
                fast.reset()  # free this shape's graph pool before the next shape
            torch.cuda.empty_cache()
    props = torch.cuda.get_device_properties(0)
    title = (f"one transformer forward, {args.layers} blocks, bf16 — {datetime.date.today()} — "
             f"{props.name}, torch {torch.__version__}")
    table = Table(title=title)
    for col in ("shape", "batch", "config", "median ms", f"ratio vs {configs[0]}", "records/forward"):
        table.add_column(col, justify="right")
    for shape, batch, c, ms, ratio, n in results:
        table.add_row(shape, str(batch), c, f"{ms:.1f}", f"{ratio:.3f}", f"{n:,}")
    console = Console(width=140)
    console.print(table)
    dt = Table(title="digest v2 row kernel (Triton) vs device copy")
    for col in ("tensor", "digest GB/s (read)", "copy GB/s (read+write)"):
        dt.add_column(col, justify="right")
    for name, d, c in digest_throughput(device):
        dt.add_row(name, f"{d:.0f}", f"{c:.0f}")
    console.print(dt)


if __name__ == "__main__":
    main()
