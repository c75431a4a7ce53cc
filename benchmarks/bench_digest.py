"""Digest v2 throughput on the CPU against xxh3_64 on the same buffers, in one run.

    $ python benchmarks/bench_digest.py [--repeat 5] [--max-mib 256] [--threads N]
    dtype  size  v2 record+rows GB/s  v2 + stats GB/s  v2 numpy GB/s  xxh3 GB/s  xxh3 record+rows GB/s  ratio …

Buffers are ``[rows, 4096]`` fp32 and ``[rows, 3072]`` bf16 (the MMDiT's hidden width), from
64 KiB to ``--max-mib`` MiB, random values. Columns:

* v2 record+rows: ``drifttool.capture.digest.partial`` (row digests T, T' and V of all rows,
  the work of an L2 record without the summary), result read back;
* v2 + stats: ``digest_pending`` + ``materialize`` (what the recorder does per record: digest,
  row digests, non-finite count, fp64 L2, max-abs);
* v2 numpy: ``drifttool.digestcore.digest_array`` (what ``drifttool.artifact.raw`` runs);
* xxh3: ``xxhash.xxh3_64`` of the whole buffer; xxh3 record+rows: the digest v1 did (one hash of
  the buffer and one per row).

Each cell is the best of ``--repeat`` timings after one warm-up (the key tables are built in the
warm-up, once per process). Ratios are xxh3 time / v2 time (< 1: v2 is slower).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
import xxhash
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from drifttool.capture.digest import digest_pending, materialize, partial  # noqa: E402
from drifttool.digestcore import digest_array  # noqa: E402
from drifttool.environment import environment  # noqa: E402


def best(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def v2_record_rows(t: torch.Tensor) -> tuple[int, np.ndarray]:
    p = partial(t, row_axis=0)
    return int(p.v), p.rows.cpu().numpy()


def xxh3_rows(a: np.ndarray) -> None:
    buf = memoryview(a.reshape(-1).view(np.uint8))
    xxhash.xxh3_64_intdigest(buf)
    rb = len(buf) // a.shape[0]
    for i in range(a.shape[0]):
        xxhash.xxh3_64_intdigest(buf[i * rb:(i + 1) * rb])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--max-mib", type=int, default=256)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    env = environment()
    table = Table(title=f"digest v2 vs xxh3_64, CPU — {datetime.date.today()} — {env['cpu']} "
                        f"({env['cpu_count']} cores, {torch.get_num_threads()} torch threads, "
                        f"torch {torch.__version__}, numpy {np.__version__}, "
                        f"xxhash {xxhash.VERSION}, Python {platform.python_version()})")
    for col in ("dtype", "size", "v2 record+rows GB/s", "v2 + stats GB/s", "v2 numpy GB/s",
                "xxh3 GB/s", "xxh3 record+rows GB/s", "ratio v2/xxh3", "ratio v2/xxh3 rows"):
        table.add_column(col, justify="right")
    sizes = [64 << 10 << (2 * i) for i in range(8) if (64 << 10 << (2 * i)) <= args.max_mib << 20]
    for dtype, width in ((torch.float32, 4096), (torch.bfloat16, 3072)):
        for size in sizes:
            rows = max(1, size // (width * torch.empty((), dtype=dtype).element_size()))
            t = torch.randn(rows, width, generator=torch.Generator().manual_seed(0)).to(dtype)
            nbytes = t.numel() * t.element_size()
            a = t.view(torch.uint16).numpy() if dtype == torch.bfloat16 else t.numpy()
            name = str(dtype).removeprefix("torch.")
            t_v2 = best(lambda: v2_record_rows(t), args.repeat)
            t_full = best(lambda: materialize([digest_pending(t, row_axis=0, keep_rows=True)]), args.repeat)
            t_np = best(lambda: digest_array(a, name, 0), args.repeat)
            t_x = best(lambda: xxhash.xxh3_64_intdigest(memoryview(a.reshape(-1).view(np.uint8))), args.repeat)
            t_xr = best(lambda: xxh3_rows(a), args.repeat)
            gb = lambda s: f"{nbytes / s / 1e9:.2f}"
            table.add_row(name, f"{nbytes / 1024:.0f} KiB" if nbytes < 1 << 20 else f"{nbytes >> 20} MiB",
                          gb(t_v2), gb(t_full), gb(t_np), gb(t_x), gb(t_xr),
                          f"{t_x / t_v2:.3f}", f"{t_xr / t_v2:.3f}")
            del t, a
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
