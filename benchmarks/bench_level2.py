"""Level 2 of a replayed forward's digests on a GPU: torch's products and segment sums against
the one-launch Triton kernel (``gpu_rows.level2_products``), side by side in one run.

    $ python benchmarks/bench_level2.py [--records 3730] [--rows 6032] [--repeat 20]
    records  rows/record  torch ms  kernel ms  ratio

After each replay of a captured forward, ``digest_rows.RowTables`` finishes every record's
digest from its row digests ``T``, ``T'``: per record, the limbs of ``T`` times the row keys'
limbs, summed over its rows (``u``, ``int64 [9, records]``). The torch form builds the
``[3, 3, rows]`` product of every row of the forward and sums it per record through two prefix
sums; the kernel runs one program per record. Their ``u`` are checked equal here (and in
``tests/capture/test_gpu_rows_interp.py``). The default is 1664×928 at batch 2: 3,730 records
per forward, most of 6,032 image rows (some of text rows; the mix does not change the work per
row). Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path

import torch
import triton
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from drifttool import digestcore as core  # noqa: E402
from drifttool.capture import gpu_rows  # noqa: E402
from drifttool.capture.digest_rows import key_consts, key_table, level2_products  # noqa: E402
from drifttool.environment import environment  # noqa: E402


def _ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=3730)
    ap.add_argument("--rows", type=int, default=6032, help="rows per record")
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: needs a CUDA device")
    dev = torch.device("cuda")
    lens = torch.full((args.records,), args.rows, dtype=torch.int64, device=dev)
    starts = torch.arange(args.records, device=dev, dtype=torch.int64) * args.rows
    total = args.records * args.rows
    t = torch.randint(0, core.P, (total, 2), dtype=torch.int64, device=dev)
    keys = key_table("row", args.rows, dev).contiguous()
    consts = key_consts(dev)
    # the torch form computes ``local`` itself (a gather index per row): included in its time
    torch_form = lambda: level2_products(  # noqa: E731
        t, keys, torch.arange(total, device=dev) - torch.repeat_interleave(starts, lens, output_size=total),
        starts, lens, consts)
    kernel_form = lambda: gpu_rows.level2_products(t, keys, starts, lens)  # noqa: E731
    assert torch.equal(torch_form(), kernel_form()), "the kernel's u differs from torch's"
    a, b = [], []
    for _ in range(3):  # interleaved
        a.append(_ms(torch_form, args.repeat))
        b.append(_ms(kernel_form, args.repeat))
    ta, tb = statistics.median(a), statistics.median(b)
    table = Table(title="level 2 of a forward's records (median ms)")
    for col in ("records", "rows/record", "torch ms", "kernel ms", "ratio"):
        table.add_column(col, justify="right")
    table.add_row(f"{args.records:,}", f"{args.rows:,}", f"{ta:.2f}", f"{tb:.2f}", f"{tb / ta:.2f}")
    Console().print(table)
    env = environment(dev)
    print(f"{datetime.date.today()}, {env.get('gpu')}, torch {env.get('torch')}, triton {triton.__version__}")


if __name__ == "__main__":
    main()
