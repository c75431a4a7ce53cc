"""Writing a full-size run's records: what the run's own thread waits for per step and at close.

    $ python benchmarks/bench_writer.py [--steps 10] [--records 3730] [--rows 4100] [--dir /dev/shm]

Op records of the size a 60-block 1024² forward captures at L2 with CFG batched (about 1,865
outputs × 2 branches, a row digest per token row: ``--records`` × ``--rows``), one batch per step,
through ``ArtifactWriter`` into a temporary directory. Side by side in one process:

* **per step**: the time ``write_ops`` holds the caller (the stream's write; the Parquet copy goes
  to the writer's thread), and the time the Parquet copy of the same batch takes on that thread;
* **at close**: ``close(complete=True)`` as the writer does it now (the Parquet files were
  written during the run: footer, fsync, rename, then the files' digests), and that time plus
  converting the finished stream in one go with every column zstd-compressed (what close did
  before instead of completing the file: ``write_parquet`` of the stream's batches with the
  former codec), timed on the same stream.

The digest values are random, as digest v2's are. ``--dir`` is where the run is written (default:
a temporary directory): a directory in memory (``/dev/shm``) measures the software alone; on a
disk, once the kernel's dirty-page limit is reached every write waits for the disk. Results:
docs/benchmarks.md, "Writing the records".
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
from unittest import mock

import numpy as np
import pyarrow as pa
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from drifttool.artifact import parquet, schema as S  # noqa: E402
from drifttool.artifact.writer import ArtifactWriter  # noqa: E402


def ops_batch(step: int, records: int, rows: int, rng: np.random.Generator) -> pa.RecordBatch:
    """``records`` L2 op records of ``rows`` row digests each (random digests)."""
    n = records
    ints = lambda v: pa.array(np.full(n, v, np.int32))  # noqa: E731
    offsets = pa.array(np.arange(0, n * rows + 1, rows, dtype=np.int32))
    cols = {
        "seq": pa.array(np.arange(n, dtype=np.int64) + step * n), "rank": ints(0),
        "component": pa.array(["mmdit"] * n), "phase": pa.array(["rollout"] * n), "step": ints(step),
        "sigma": pa.array(np.full(n, 1.0 - step / 10)), "branch": pa.array(["cond", "uncond"] * (n // 2) + ["cond"] * (n % 2)),
        "block": pa.array((np.arange(n) // 62).astype(np.int32)), "op_pos": pa.array((np.arange(n) % 31).astype(np.int32)),
        "stream": pa.array(["img"] * n), "op": pa.array(["mlp_up_gemm_gelu"] * n), "call": ints(0), "index": ints(0),
        "role": pa.array(["output"] * n), "sample": ints(0), "dtype": pa.array(["bfloat16"] * n),
        "shape": pa.array([[rows, 3072]] * n, pa.list_(pa.int64())),
        "digest": pa.array(rng.integers(0, 2**63, n, dtype=np.uint64)), "nonfinite": pa.array(np.zeros(n, np.int64)),
        "l2": pa.array(rng.random(n) * 100), "maxabs": pa.array(rng.random(n) * 10),
        "row_digests": pa.ListArray.from_arrays(offsets, pa.array(rng.integers(0, 2**63, n * rows, dtype=np.uint64))),
        "txt_len": ints(4), "img_h": ints(64), "img_w": ints(64),
        "rank_digests": pa.nulls(n, pa.list_(pa.uint64())), "rank_disagree": pa.nulls(n, pa.list_(pa.int32())),
    }
    return pa.RecordBatch.from_pydict(cols, schema=S.OPS_SCHEMA)


def run(steps: int, records: int, rows: int, root: Path) -> dict[str, list[float]]:
    rng = np.random.default_rng(0)
    batches = [ops_batch(i, records, rows, rng) for i in range(steps)]
    out: dict[str, list[float]] = {"write_ops": [], "parquet": [], "close": [], "convert": []}
    w = ArtifactWriter(root / "a", manifest={"fingerprint": {"arch": {"depth": 1}}})
    timed_write = parquet.ParquetFile.write

    def write(self, batch):  # the Parquet copy's own time, on the writer's thread
        t0 = time.perf_counter()
        timed_write(self, batch)
        out["parquet"].append(time.perf_counter() - t0)

    with mock.patch.object(parquet.ParquetFile, "write", write):
        for b in batches:
            t0 = time.perf_counter()
            w.write_ops(b)
            out["write_ops"].append(time.perf_counter() - t0)
            time.sleep(out["write_ops"][-1] + 0.3)  # the next step's forward, meanwhile
        with pa.memory_map(str(root / "a" / "ops.rank0.arrows")) as src:  # the stream as close finds it
            with mock.patch.object(parquet, "compression", lambda schema: "zstd"):
                t0 = time.perf_counter()
                parquet.write_parquet(root / "before.parquet", pa.ipc.open_stream(src), S.OPS_SCHEMA)
                out["convert"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        w.close(complete=True)
        out["close"].append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--records", type=int, default=3730)
    ap.add_argument("--rows", type=int, default=4100)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        r = run(a.steps, a.records, a.rows, Path(d))
    mb = a.records * a.rows * 8 / 1e6
    t = Table(title=f"{a.steps} steps of {a.records} L2 op records × {a.rows} row digests ({mb:.0f} MB of row digests a step)")
    t.add_column("what")
    t.add_column("seconds", justify="right")
    t.add_row("write_ops, per step (caller's thread), median", f"{statistics.median(r['write_ops']):.3f}")
    t.add_row("Parquet copy, per step (writer's thread), median", f"{statistics.median(r['parquet']):.3f}")
    t.add_row("close(complete=True) now", f"{r['close'][0]:.3f}")
    t.add_row("  + converting the stream, zstd everywhere (close before)",
              f"{r['close'][0] + r['convert'][0]:.3f}")
    Console().print(t)
    print(f"{platform.processor() or platform.machine()}, Python {platform.python_version()}, "
          f"pyarrow {pa.__version__}; {datetime.date.today()}")


if __name__ == "__main__":
    main()
