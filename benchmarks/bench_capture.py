"""Capture overhead on the tiny preset: L1 and L2 against L0, and strict against auto, side by
side in one run (ratios against the L0 run of the same mode, measured in the same process).

    $ python benchmarks/bench_capture.py [--repeat 5]
    mode    capture  median s  ratio vs L0  op records  artifact KiB

Each configuration runs the embedded default fixture (tiny-t2i: 2 blocks, 4 steps, CFG, 2
samples) ``--repeat`` times through ``drifttool.runner.execute`` into a temp directory; the
median wall time is reported. The order of configurations is interleaved across repeats so that
machine noise hits them alike.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from drifttool.artifact.reader import open_run  # noqa: E402
from drifttool.environment import environment  # noqa: E402
from drifttool.runner import execute  # noqa: E402
from drifttool.settings import RunSpec  # noqa: E402

CONFIGS = [(mode, level) for mode in ("strict", "auto") for level in ("L0", "L1", "L2")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    times: dict[tuple[str, str], list[float]] = {c: [] for c in CONFIGS}
    sizes: dict[tuple[str, str], tuple[int, int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        execute(RunSpec(), Path(tmp) / "warmup")
        for r in range(args.repeat):
            for mode, level in CONFIGS:
                out = Path(tmp) / f"{mode}-{level}-{r}"
                t0 = time.perf_counter()
                execute(RunSpec(mode=mode, capture=level), out)
                times[(mode, level)].append(time.perf_counter() - t0)
                if r == 0:
                    n_ops = open_run(out).ops_table().num_rows if level != "L0" else 0
                    kib = sum(f.stat().st_size for f in out.iterdir()) // 1024
                    sizes[(mode, level)] = (n_ops, kib)
    env = environment()
    table = Table(title=f"capture overhead, tiny-t2i — {datetime.date.today()} — {env['cpu']} "
                        f"({env['cpu_count']} cores, torch {torch.__version__}, {platform.python_version()})")
    for col in ("mode", "capture", "median s", "ratio vs L0", "op records", "artifact KiB"):
        table.add_column(col, justify="right")
    for mode, level in CONFIGS:
        med = statistics.median(times[(mode, level)])
        base = statistics.median(times[(mode, "L0")])
        n_ops, kib = sizes[(mode, level)]
        table.add_row(mode, level, f"{med:.3f}", f"{med / base:.2f}", f"{n_ops:,}", f"{kib:,}")
    Console().print(table)


if __name__ == "__main__":
    main()
