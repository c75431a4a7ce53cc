"""WS2 layouts side by side: one strict rollout per layout against the one-process run, with the
time inside the strict collectives separated (``distributed.canonical.COMM``).

    $ python benchmarks/bench_layouts.py                      # CPU, gloo, the tiny model
    $ python benchmarks/bench_layouts.py --height 160 --width 560 --steps 4 --layouts tp2,sp2-ring

Every layout runs in fresh processes (``launch.run_parallel``: one process
per rank, gloo on loopback, one thread each); the one-process run uses one thread too, so the
ratio compares the same per-rank CPU budget. Per layout the table gives the slowest rank's wall
time of ``execute`` (model, sampler, capture and artifact writing), that rank's time inside the
collectives (and the part of it spent combining the digest partials of sharded outputs for
capture, with the bytes that moved for it), the ratio to one process, and whether ``drifttool
diff`` finds the artifact identical to the one-process run. On two H200s the same launch runs NCCL (``--device cuda``,
once a strict CUDA family exists: strict refuses CUDA today). Results go to
docs/benchmarks.md ("WS2 layouts").
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import pickle
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from drifttool.distributed import close_distributed, init_distributed  # noqa: E402
from drifttool.distributed.canonical import COMM  # noqa: E402
from drifttool.distributed.plan import MESH_DIMS, ParallelDims  # noqa: E402

LAYOUTS = {
    "tp2": ParallelDims(tp=2), "sp2-agrs": ParallelDims(sp=2),
    "sp2-ulysses": ParallelDims(sp=2, sp_attention="ulysses"), "sp2-ring": ParallelDims(sp=2, sp_attention="ring"),
    "cfg2": ParallelDims(cfg=2), "tp2xsp2": ParallelDims(tp=2, sp=2), "sp4-agrs": ParallelDims(sp=4),
}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, dims: ParallelDims, fields: dict, out: str, res: str) -> None:
    from drifttool.runner import execute
    from drifttool.settings import RunSpec

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    ctx = init_distributed(mesh_dims=MESH_DIMS, mesh_shape=dims.mesh_shape())
    try:
        COMM.reset()
        t0 = time.perf_counter()
        execute(RunSpec(**fields), out, dist=ctx, parallel=dims)
        wall = time.perf_counter() - t0
    finally:
        close_distributed(ctx)
    Path(res, f"rank{rank}.pkl").write_bytes(pickle.dumps((wall, COMM.seconds, COMM.capture_seconds,
                                                            COMM.calls, COMM.nbytes,
                                                            COMM.capture_nbytes)))


def run_layout(dims: ParallelDims, fields: dict, out: Path) -> tuple[float, float, float, int, int, int]:
    with tempfile.TemporaryDirectory() as res:
        mp.spawn(_rank, args=(dims.world_size, _port(), dims, fields, str(out), res),
                 nprocs=dims.world_size, join=True)
        per = [pickle.loads(Path(res, f"rank{r}.pkl").read_bytes()) for r in range(dims.world_size)]
    return max(per, key=lambda p: p[0])


def run_one(fields: dict, out: Path) -> float:
    from drifttool.runner import execute
    from drifttool.settings import RunSpec

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    execute(RunSpec(**fields), out)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--height", type=int, default=160)
    ap.add_argument("--width", type=int, default=560)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--capture", default="L1")
    args = ap.parse_args()
    from rich.console import Console
    from rich.table import Table

    from drifttool.artifact import open_run
    from drifttool.diff import diff_runs

    fields = dict(batch=args.batch, steps=args.steps, capture=args.capture, height=args.height,
                  width=args.width)
    tmp = Path(tempfile.mkdtemp(prefix="bench-layouts-"))
    one = run_one(fields, tmp / "one")
    table = Table(title=f"WS2 layouts, strict, {args.height}×{args.width} px, {args.steps} steps, "
                        f"batch {args.batch}, capture {args.capture} (gloo, 1 thread per rank)")
    for col in ("layout", "ranks", "wall s (slowest rank)", "in collectives s", "of which capture s",
                "calls", "MiB moved", "of which capture KiB", "vs one process", "diff"):
        table.add_column(col, justify="right" if col not in ("layout", "diff") else "left")
    table.add_row("one process", "1", f"{one:.2f}", "–", "–", "–", "–", "–", "1.00", "–")
    for name in args.layouts.split(","):
        dims = LAYOUTS[name]
        wall, comm, cap, calls, nbytes, cap_bytes = run_layout(dims, fields, tmp / name)
        verdict = diff_runs(open_run(tmp / "one"), open_run(tmp / name)).verdict.value
        table.add_row(name, str(dims.world_size), f"{wall:.2f}", f"{comm:.2f}", f"{cap:.2f}", str(calls),
                      f"{nbytes / 2**20:.1f}", f"{cap_bytes / 2**10:.1f}", f"{wall / one:.2f}", verdict)
    Console(width=160).print(table)
    print(f"{datetime.date.today()} · {platform.processor() or platform.machine()} · "
          f"{os.cpu_count()} cores · torch {torch.__version__} · python {platform.python_version()}")


if __name__ == "__main__":
    main()
