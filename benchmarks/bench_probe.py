"""Probe matrix benchmark: the whole tiny-preset matrix, timed end to end, as ``drifttool probe`` runs it.

    $ python benchmarks/bench_probe.py                 # one matrix under a temp dir
    $ python benchmarks/bench_probe.py --repeat 3 --dir /tmp/bench

Each repeat runs in a fresh child process ``drifttool probe --preset tiny -o DIR`` (imports,
baseline, every probe, diffs, matrix files, heatmaps) and reports its wall time, its CPU time
(user + sys of the child: what the machine's other jobs cannot inflate), the exit code and the
per-kind probe times read back from ``matrix.json``. Bar (issue 5): < 10 minutes on this 2-core
CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one(out: Path) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "drifttool.cli.app", "probe", "--preset", "tiny",
                           "-o", str(out)], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    data = json.loads((out / "matrix.json").read_text())
    by_kind: dict[str, float] = {}
    for r in data["results"]:
        by_kind[r["kind"]] = by_kind.get(r["kind"], 0.0) + r["seconds"]
    return {"wall_s": wall, "cpu_s": cpu, "exit": proc.returncode, "matrix_s": data["seconds"],
            "baseline_s": data["baseline_seconds"], "counts": data["counts"], "by_kind": by_kind,
            "probes": len(data["results"]), "heatmaps": len(list((out / "heatmaps").glob("*.png")))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--dir", type=Path, default=None)
    args = ap.parse_args()
    base = args.dir or Path(tempfile.mkdtemp(prefix="bench-probe-"))
    rows = []
    for i in range(args.repeat):
        r = one(base / f"run{i}")
        rows.append(r)
        print(json.dumps(r))
    load = os.getloadavg()
    print(f"# {len(rows)} repeat(s); best wall {min(r['wall_s'] for r in rows):.1f} s, best cpu "
          f"{min(r['cpu_s'] for r in rows):.1f} s; bar 600 s; load average {load[0]:.1f}; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"Python {platform.python_version()}")


if __name__ == "__main__":
    main()
