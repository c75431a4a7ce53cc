"""Diff benchmark: two synthetic artifacts of >= 1,000,000 op records each, timed end to end.

    $ python benchmarks/bench_diff.py            # builds under a temp dir, prints a rich table
    case                         records A  records B  path  verdict  open+diff s  peak RSS MiB
    identical                    1,004,400  1,004,400  fast  ...

Each case runs ``open_run(a)``, ``open_run(b)`` and ``diff_runs`` in a fresh child process, so
the peak RSS (``resource.getrusage(RUSAGE_SELF).ru_maxrss``) is the diff's own, imports included
(torch and pyarrow alone are a few hundred MiB). Artifacts are written through
``ArtifactWriter`` (one batch per step); op records carry random digests, step records carry
``[256, 64]`` fp32 tensors. Bar (brief): < 5 s and < 2 GiB per diff.

Cases:
  identical   B is a copy of A (fast path: identity columns equal row for row)
  drift       B's digests differ from step 5 on (half the records differ; fast path)
  reordered   B holds the same records with each step's batch in another row order and one
              step's step records lost: identity join (slow path), verdict inconclusive
  drift L2    both runs L2 with 64 row digests per record (~0.5 GiB of row digests per run); B
              differs from step 5 in one row per record: the first drift names its row
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from drifttool.artifact import ArtifactWriter, open_run  # noqa: E402
from drifttool.artifact import schema as S  # noqa: E402
from drifttool.capture.digest import digest_tensor  # noqa: E402
from drifttool.diff import diff_runs  # noqa: E402

STEPS, BRANCHES, BLOCKS, SAMPLES = 10, ("cond", "uncond"), list(range(-1, 61)), 30
SITES = [(f"op{k:02d}", ("img", "txt", "joint")[k % 3]) for k in range(27)]  # (op, stream)
STEP_SHAPE = (256, 64)
L2_ROWS = 64  # row digests per record in the L2 case (a 4 x 16 image grid)


def _strings(values: list[str], idx: np.ndarray) -> pa.Array:
    return pa.DictionaryArray.from_arrays(pa.array(idx.astype(np.int32)), pa.array(values)).cast(
        pa.utf8())


def ops_batch(step: int, seq0: int, digests: np.ndarray, order: np.ndarray | None,
              rows: np.ndarray | None = None) -> pa.RecordBatch:
    """All op records of one step (execution order: branch, block, site, sample); ``rows``
    ``uint64 [n, R]`` adds L2 row digests (rows map to a 4 x R/4 image grid)."""
    nb, nk, ns, nsm = len(BRANCHES), len(BLOCKS), len(SITES), SAMPLES
    n = nb * nk * ns * nsm
    i = np.arange(n)
    sample = i % nsm
    site = (i // nsm) % ns
    block = np.array(BLOCKS)[(i // (nsm * ns)) % nk]
    branch = i // (nsm * ns * nk)
    shape_vals = np.tile(np.array([4096, 3072], np.int64), n)
    cols = {
        "seq": pa.array(seq0 + i, pa.int64()),
        "rank": pa.array(np.zeros(n, np.int32)),
        "phase": _strings(["rollout"], np.zeros(n)),
        "step": pa.array(np.full(n, step, np.int32)),
        "sigma": pa.array(np.full(n, 1.0 - step / STEPS)),
        "branch": _strings(list(BRANCHES), branch),
        "block": pa.array(block.astype(np.int32)),
        "stream": _strings([s for _, s in SITES], site),
        "op": _strings([o for o, _ in SITES], site),
        "call": pa.array(np.zeros(n, np.int32)),
        "index": pa.array(np.zeros(n, np.int32)),
        "role": _strings(["output"], np.zeros(n)),
        "sample": pa.array(sample.astype(np.int32)),
        "dtype": _strings(["bfloat16"], np.zeros(n)),
        "shape": pa.ListArray.from_arrays(pa.array(np.arange(0, 2 * n + 1, 2, dtype=np.int32)),
                                          pa.array(shape_vals)),
        "digest": pa.array(digests, pa.uint64()),
        "nonfinite": pa.array(np.zeros(n, np.int64)),
        "l2": pa.array(np.ones(n)),
        "maxabs": pa.array(np.ones(n)),
        "row_digests": pa.nulls(n, pa.list_(pa.uint64())),
        "txt_len": pa.nulls(n, pa.int32()),
        "img_h": pa.nulls(n, pa.int32()),
        "img_w": pa.nulls(n, pa.int32()),
    }
    if rows is not None:
        r = rows.shape[1]
        cols["row_digests"] = pa.ListArray.from_arrays(
            pa.array(np.arange(0, r * n + 1, r, dtype=np.int32)), pa.array(rows.reshape(-1)))
        cols["txt_len"] = pa.array(np.zeros(n, np.int32))
        cols["img_h"] = pa.array(np.full(n, 4, np.int32))
        cols["img_w"] = pa.array(np.full(n, r // 4, np.int32))
    batch = pa.RecordBatch.from_pydict(cols, schema=S.OPS_SCHEMA)
    return batch if order is None else batch.take(pa.array(order))


def steps_batch(step: int, seq0: int, values: dict[str, np.ndarray]) -> pa.RecordBatch:
    rows = []
    seq = seq0
    for sample in range(SAMPLES):
        for (branch, q), v in values.items():
            d = digest_tensor(torch.from_numpy(np.asarray(v[sample])))
            rows.append({"seq": seq, "rank": 0, "phase": "rollout", "step": step,
                         "sigma": 1.0 - step / STEPS, "sigma_next": 1.0 - (step + 1) / STEPS,
                         "sample": sample, "branch": branch, "quantity": q, "dtype": d.dtype,
                         "shape": list(d.shape), "digest": d.digest, "nonfinite": d.nonfinite,
                         "l2": d.l2, "maxabs": d.maxabs, "data": v[sample].tobytes()})
            seq += 1
    return pa.RecordBatch.from_pylist(rows, schema=S.STEPS_SCHEMA)


def build(path: Path, *, drift_from: int | None = None, reorder: bool = False,
          drop_steps_of: int | None = None, rows: int = 0) -> int:
    """Write one synthetic artifact (L1, or L2 with ``rows`` row digests per record); returns
    its op record count."""
    rng = np.random.default_rng(0)
    drift_rng = np.random.default_rng(1)
    w = ArtifactWriter(path, manifest={"fingerprint": {"arch": {"depth": 60}}},
                       overwrite=True)
    w.update_manifest(capture_level="L2" if rows else "L1")
    total, seq = 0, 0
    per_step = len(BRANCHES) * len(BLOCKS) * len(SITES) * SAMPLES
    quantities = [("cfg", q) for q in ("x_t", "v_t", "x_next", "mu", "logp_t", "std_t")] + [
        ("cond", "v_t"), ("uncond", "v_t")]
    for step in range(STEPS):
        digests = rng.integers(0, 2**63, per_step, dtype=np.int64).astype(np.uint64)
        values = {k: rng.standard_normal((SAMPLES, *STEP_SHAPE), dtype=np.float32)
                  for k in quantities if k[1] not in ("logp_t", "std_t")}
        values[("cfg", "logp_t")] = rng.standard_normal((SAMPLES,), dtype=np.float32)
        values[("cfg", "std_t")] = np.full((SAMPLES,), 0.7, np.float32)
        row_digests = (rng.integers(0, 2**63, (per_step, rows), dtype=np.int64).astype(np.uint64)
                       if rows else None)
        if drift_from is not None and step >= drift_from:
            digests = drift_rng.integers(0, 2**63, per_step, dtype=np.int64).astype(np.uint64)
            if rows:
                row_digests[:, rows // 2] += np.uint64(1)  # one differing row per record
            for k in (("cfg", "v_t"), ("cfg", "x_next"), ("cfg", "mu")):
                values[k] = values[k] + np.float32(1e-3)
        order = np.random.default_rng(step).permutation(per_step) if reorder else None
        w.write_ops(ops_batch(step, seq, digests, order, row_digests), rank=0)
        seq += per_step
        total += per_step
        if step != drop_steps_of:
            w.write_steps(steps_batch(step, seq, values))
        seq += SAMPLES * len(quantities)
    w.close(complete=True)
    return total


def measure(a: str, b: str) -> dict:
    """In this (fresh) process: open both runs and diff them; time and peak RSS."""
    t0 = time.perf_counter()
    report = diff_runs(open_run(a), open_run(b))
    wall = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB on Linux
    ops = report.counts.get("ops")
    return {"wall_s": wall, "rss_mib": rss, "verdict": report.verdict.value,
            "records_a": ops.a if ops else 0, "records_b": ops.b if ops else 0,
            "differ": ops.differ if ops else 0, "reason": report.reason[:90]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measure", nargs=2, metavar=("A", "B"), help=argparse.SUPPRESS)
    ap.add_argument("--dir", type=Path, default=None, help="where to build (default: temp dir)")
    ap.add_argument("--repeat", type=int, default=3, help="diff runs per case (best is kept)")
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(*args.measure)))
        return

    from rich.console import Console
    from rich.table import Table

    console = Console()
    base = args.dir or Path(tempfile.mkdtemp(prefix="bench_diff_"))
    t0 = time.perf_counter()
    runs = {"a": {}, "b_same": {}, "b_drift": {"drift_from": 5},
            "b_reordered": {"reorder": True, "drop_steps_of": 9},
            "a_l2": {"rows": L2_ROWS}, "b_l2_drift": {"rows": L2_ROWS, "drift_from": 5}}
    for name, kw in runs.items():
        n = build(base / name, **kw)
    build_s = time.perf_counter() - t0
    size = sum(f.stat().st_size for f in (base / "a").iterdir()) / 2**20
    size_l2 = sum(f.stat().st_size for f in (base / "a_l2").iterdir()) / 2**20
    console.print(f"built {len(runs)} artifacts of {n:,} op records each in {build_s:.1f} s "
                  f"({size:.0f} MiB each, L2 ones {size_l2:.0f} MiB) under {base}")

    table = Table(title="drifttool diff benchmark (open_run x2 + diff_runs, fresh process)",
                  title_justify="left")
    for col in ("case", "path", "records A", "records B", "differ", "verdict", "best s",
                "all s", "peak RSS MiB", "bar (<5 s, <2 GiB)"):
        table.add_column(col, justify="left" if col in ("case", "path", "verdict") else "right")
    results = {}
    for case, a, b, path in (("identical", "a", "b_same", "fast"),
                             ("drift", "a", "b_drift", "fast"),
                             ("reordered", "a", "b_reordered", "join"),
                             (f"drift L2 ({L2_ROWS} rows)", "a_l2", "b_l2_drift", "fast")):
        outs = []
        for _ in range(args.repeat):
            p = subprocess.run([sys.executable, __file__, "--measure", str(base / a),
                                str(base / b)], capture_output=True, text=True, check=True)
            outs.append(json.loads(p.stdout))
        best = min(outs, key=lambda o: o["wall_s"])
        rss = max(o["rss_mib"] for o in outs)
        ok = best["wall_s"] < 5 and rss < 2048
        results[case] = {**best, "rss_mib": rss, "all_s": [o["wall_s"] for o in outs]}
        table.add_row(case, path, f"{best['records_a']:,}", f"{best['records_b']:,}",
                      f"{best['differ']:,}", best["verdict"], f"{best['wall_s']:.2f}",
                      " ".join(f"{o['wall_s']:.2f}" for o in outs), f"{rss:.0f}",
                      "[green]pass[/]" if ok else "[red]FAIL[/]")
    console.print(table)
    env = Table(title="environment", show_header=False, title_justify="left")
    for k, v in (("date", datetime.datetime.now().isoformat(timespec="seconds")),
                 ("cpu", _cpu()), ("cores", os.cpu_count()),
                 ("memory", f"{_memory_gib():.0f} GiB"),
                 ("python", platform.python_version()), ("pyarrow", pa.__version__),
                 ("numpy", np.__version__), ("torch", torch.__version__),
                 ("platform", platform.platform())):
        env.add_row(k, str(v))
    console.print(env)
    for case, r in results.items():
        console.print(f"{case}: {r['reason']}", highlight=False)


def _memory_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def _cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


if __name__ == "__main__":
    main()
