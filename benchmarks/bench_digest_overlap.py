"""Can the capture's digests hide behind the forward's GEMMs? A chain of diffusers-like blocks
replayed from a CUDA graph, its outputs digested on the forward's stream or on a second one.

    $ python benchmarks/bench_digest_overlap.py [--tokens 4096] [--blocks 8] [--reps 5]

A block here is the GEMM part of a Qwen-Image block as diffusers runs it (``F.linear``, cuBLAS;
hidden 3072, MLP 12288, bf16, random weights scaled by 1/sqrt(in)): q, k and v, a projection
standing in for the attention's, the MLP's up projection with GELU and its down projection. Its
six outputs are 9 of the 18 [tokens, 3072] bf16 outputs a block's L1 records read (the rest are
the norms, rotations, modulations and residuals, elementwise kernels). Five graphs, each
``--blocks`` blocks long:

* ``forward``: the blocks alone;
* ``+ digests, same stream``: each output's row table (``gpu_rows.row_table``, the capture's
  kernel) launched right after the output, on the forward's stream, as a captured forward does;
* ``+ digests, side stream``: each row table launched on a second stream that first waits for the
  forward's stream at that point (an event: a graph edge), the two streams joined once at the
  end; every output is held until then;
* ``forward, one buffer``: the blocks writing their six outputs into the rows of one [9 × tokens,
  3072] buffer a block (``out=``; the MLP's hidden state as 4 × tokens rows of 3072), the same
  GEMMs;
* ``+ one digest a block``: that buffer's row table, one launch at the block's end: the same bytes
  read as six launches read, in one (does a launch per output cost, beyond its bytes?).

Prints ms per block (median of ``--reps`` replays, CUDA events), each graph's ratio to its
forward (the one-buffer forward for the one-digest graph), the bytes the digests read per block and the share of the same-stream overhead the
side stream hides, and whether the two digest graphs' row tables are equal (``combine_splits``:
they read the same outputs), and whether the one-launch tables' rows of q, k, v, the projection and
the down projection equal theirs. What it does not show: the attention (a long compute-bound kernel,
more room to overlap) and the elementwise outputs (memory-bound themselves, less). Without CUDA
it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HIDDEN, MLP = 3072, 12288
MODES = ("forward", "same", "side", "buffer", "block")
LABELS = {"forward": "forward", "same": "+ digests, same stream", "side": "+ digests, side stream",
          "buffer": "forward, one buffer", "block": "+ one digest a block"}
BASE = {"same": "forward", "side": "forward", "block": "buffer"}
"""Each digest graph's forward: the ratio's denominator."""


def weights(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One block's weights, bf16 on the GPU, scaled so activations keep their size."""
    shapes = {"q": (HIDDEN, HIDDEN), "k": (HIDDEN, HIDDEN), "v": (HIDDEN, HIDDEN), "o": (HIDDEN, HIDDEN),
              "up": (MLP, HIDDEN), "down": (HIDDEN, MLP)}
    return {n: (torch.randn(s, device="cuda", generator=gen) / s[1] ** 0.5).to(torch.bfloat16)
            for n, s in shapes.items()}


def block(h: torch.Tensor, w: dict[str, torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The block's six outputs and its output (the next block's input)."""
    q, k, v = F.linear(h, w["q"]), F.linear(h, w["k"]), F.linear(h, w["v"])
    o = F.linear(v, w["o"])
    up = F.gelu(F.linear(o, w["up"]), approximate="tanh")
    down = F.linear(up, w["down"])
    return [q, k, v, o, up, down], down


def block_into(h: torch.Tensor, w: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``block``'s GEMMs writing into one ``[9 * tokens, HIDDEN]`` buffer: rows of q, k, v, the
    projection, the down projection, then the MLP's hidden state (``[tokens, MLP]`` as
    ``4 * tokens`` rows); the buffer and the block's output."""
    t = h.shape[0]
    buf = torch.empty(9 * t, HIDDEN, dtype=h.dtype, device=h.device)
    q, k, v, o, down = (buf[i * t:(i + 1) * t] for i in range(5))
    up = buf[5 * t:].view(t, MLP)
    for name, src, dst in (("q", h, q), ("k", h, k), ("v", h, v), ("o", v, o)):
        torch.mm(src, w[name].t(), out=dst)
    torch.ops.aten.gelu.out(F.linear(o, w["up"]), approximate="tanh", out=up)
    torch.mm(up, w["down"].t(), out=down)
    return buf, down


def chain(mode: str, x: torch.Tensor, w: dict, blocks: int, side: torch.cuda.Stream, tables: list,
          held: list) -> None:
    """``blocks`` blocks from ``x``; the outputs' row tables appended to ``tables`` (``mode``
    ``same`` or ``side``), the outputs a side stream reads appended to ``held``."""
    from drifttool.capture import gpu_rows

    main = torch.cuda.current_stream()
    h = x
    for _ in range(blocks):
        if mode in ("buffer", "block"):
            buf, h = block_into(h, w)
            if mode == "block":
                tables.append(gpu_rows.row_table(buf))
            continue
        outs, h = block(h, w)
        for t in outs:
            if mode == "same":
                tables.append(gpu_rows.row_table(t))
            elif mode == "side":
                side.wait_stream(main)  # after the output's producer
                with torch.cuda.stream(side):
                    tables.append(gpu_rows.row_table(t))
                held.append(t)
    if mode == "side":
        main.wait_stream(side)  # the join: the graph ends after every digest


def graphed(mode: str, x: torch.Tensor, w: dict, blocks: int) -> tuple[torch.cuda.CUDAGraph, list, list]:
    """The chain captured in a CUDA graph (after one warm-up run on a side stream, as torch asks),
    with the row tables it fills at each replay and the tensors it must keep alive."""
    side = torch.cuda.Stream()
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        chain(mode, x, w, blocks, side, [], [])
    torch.cuda.current_stream().wait_stream(warm)
    torch.cuda.synchronize()
    graph, tables, held = torch.cuda.CUDAGraph(), [], []
    with torch.cuda.graph(graph):
        chain(mode, x, w, blocks, side, tables, held)
    return graph, tables, held


def timed(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    """Median seconds of one replay."""
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--tokens", type=int, default=4096, help="rows of every output (default: %(default)s, 1024²)")
    ap.add_argument("--blocks", type=int, default=8, help="blocks per graph (default: %(default)s)")
    ap.add_argument("--reps", type=int, default=5, help="replays timed per graph (default: %(default)s)")
    args = ap.parse_args()
    if min(args.tokens, args.blocks, args.reps) < 1:
        sys.exit("bench_digest_overlap.py: --tokens, --blocks and --reps must be at least 1")
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to time (this benchmark measures streams on a GPU)")
        return 0
    from drifttool.capture import gpu_rows

    gen = torch.Generator(device="cuda").manual_seed(0)
    w = weights(gen)
    x = torch.randn(args.tokens, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
    ms, tables = {}, {}
    for mode in MODES:
        graph, tabs, _held = graphed(mode, x, w, args.blocks)
        ms[mode] = timed(graph, args.reps) * 1e3 / args.blocks
        tables[mode] = [gpu_rows.combine_splits(*t)[0] for t in tabs]
    same = len(tables["same"]) == len(tables["side"]) and all(
        torch.equal(a, b) for a, b in zip(tables["same"], tables["side"]))
    t = args.tokens  # the same-stream tables of q, k, v, o and down against the buffer's rows
    parts = [torch.cat([tables["same"][6 * b + i] for i in (0, 1, 2, 3, 5)]) for b in range(args.blocks)]
    one = all(torch.equal(p, b[:5 * t]) for p, b in zip(parts, tables["block"]))
    read_gb = 9 * args.tokens * HIDDEN * 2 / 1e9
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.tokens} tokens, "
          f"{args.blocks} blocks a graph, median of {args.reps} replays")
    print("| graph | ms per block | × its forward |")
    print("|---|---:|---:|")
    for mode in MODES:
        print(f"| {LABELS[mode]} | {ms[mode]:.3f} | {ms[mode] / ms[BASE.get(mode, mode)]:.3f} |")
    extra_same, extra_side = ms["same"] - ms["forward"], ms["side"] - ms["forward"]
    print(f"\ndigests read {read_gb:.3f} GB a block: {read_gb / extra_same:.2f} TB/s of added time on "
          f"the same stream" if extra_same > 0 else "\nthe same-stream digests added no time")
    if extra_same > 0:
        print(f"the side stream hides {100 * (1 - extra_side / extra_same):.0f} % of the same-stream "
              f"digests' added time")
    extra_block = ms["block"] - ms["buffer"]
    print(f"one launch a block: {read_gb / extra_block:.2f} TB/s of added time" if extra_block > 0
          else "one launch a block added no time")
    print(f"row tables equal on both streams: {'yes' if same else 'NO'}; "
          f"one launch's rows equal the six launches': {'yes' if one else 'NO'}")
    return 0 if same and one else 1


if __name__ == "__main__":
    sys.exit(main())
