"""CLI start-up benchmark: the commands people run most, against ``python -c "import pyarrow, numpy"``.

    $ python benchmarks/bench_cli.py [--repeat 11] [--runs A B] [--other OTHER/bin/drifttool]
    command                              median s  min s   ratio  CPU s  CPU ratio  bar ≤ 2.5×
    python -c "import pyarrow, numpy"     0.30     0.27    1.00   0.28   1.00       -
    drifttool diff A B   (drift, exit 1)  0.80     0.71    2.6    0.70   2.5        pass
    ...

Every command runs as a fresh process (what a user's shell does), the cases interleaved round by
round so that a busy machine slows them alike; medians, minima and each median's ratio to the
baseline's median are printed, and the same for the CPU time (user + system) each process used,
which a machine shared with other jobs inflates less than the wall time. ``drifttool`` is the
console script next to this Python (the installed entry point). ``--other`` adds the ``diff``
cases of another install's console script (an earlier wheel in its own venv), interleaved in the
same rounds: a side-by-side before/after. A and B are two tiny runs of the embedded default, strict and auto
(built first with ``drifttool run`` unless ``--runs`` names existing ones). Bar:
``drifttool diff`` of two tiny runs within 2.5× the baseline, which requires that it never
imports torch (``tests/cli/test_import_cost.py``).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

BAR = 2.5
BASELINE = "python -c \"import pyarrow, numpy\""


def _drifttool() -> list[str]:
    script = Path(sys.executable).parent / "drifttool"
    return [str(script)] if script.exists() else [sys.executable, "-m", "drifttool.cli.app"]


def cases(a: Path, b: Path, other: Path | None = None) -> list[tuple[str, list[str], int, bool]]:
    """``(label, argv, expected exit code, held to the bar)`` for each timed command."""
    dt = _drifttool()
    out = [
        (BASELINE, [sys.executable, "-c", "import pyarrow, numpy"], 0, False),
        ("drifttool diff A B   (drift)", [*dt, "diff", str(a), str(b)], 1, True),
        ("drifttool diff A A   (identical)", [*dt, "diff", str(a), str(a)], 0, True),
        ("drifttool trace A", [*dt, "trace", str(a)], 0, False),
        ("drifttool --help", [*dt, "--help"], 0, False),
    ]
    if other is not None:
        out += [("other: drifttool diff A B", [str(other), "diff", str(a), str(b)], 1, False),
                ("other: drifttool diff A A", [str(other), "diff", str(a), str(a)], 0, False)]
    return out


def timed(argv: list[str], code: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds: user + system) of one fresh process running ``argv``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    dt = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if r.returncode != code:
        raise SystemExit(f"{' '.join(argv)}: exit {r.returncode}, expected {code}\n"
                         f"{r.stderr.decode()[-2000:]}")
    return dt, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=11, help="rounds (each case once per round)")
    ap.add_argument("--runs", nargs=2, type=Path, metavar=("A", "B"),
                    help="existing runs: A strict, B drifting from A (default: build both)")
    ap.add_argument("--other", type=Path, metavar="DRIFTTOOL",
                    help="another install's drifttool console script: its diff side by side")
    args = ap.parse_args()

    if args.runs:
        a, b = args.runs
    else:
        tmp = Path(tempfile.mkdtemp(prefix="drifttool-bench-cli-"))
        a, b = tmp / "a", tmp / "b"
        for out, mode in ((a, "strict"), (b, "auto")):
            subprocess.run([*_drifttool(), "run", "--mode", mode, "-o", str(out)], check=True,
                           stdout=subprocess.DEVNULL)
    todo = cases(a, b, args.other)
    times: dict[str, list[float]] = {label: [] for label, *_ in todo}
    cpu: dict[str, list[float]] = {label: [] for label, *_ in todo}
    for _ in range(args.repeat):
        for label, argv, code, _bar in todo:
            wall, used = timed(argv, code)
            times[label].append(wall)
            cpu[label].append(used)

    from rich.console import Console
    from rich.table import Table

    base = statistics.median(times[BASELINE])
    cpu_base = statistics.median(cpu[BASELINE])
    table = Table(title=f"CLI wall time, fresh process each, {args.repeat} interleaved rounds")
    for col in ("command", "median s", "min s", f"ratio vs {BASELINE}", "CPU s (median)",
                "CPU ratio", f"bar ≤ {BAR:g}×"):
        table.add_column(col)
    failed = False
    for label, _argv, _code, bar in todo:
        med = statistics.median(times[label])
        ok = med <= BAR * base
        failed |= bar and not ok
        used = statistics.median(cpu[label])
        table.add_row(label, f"{med:.3f}", f"{min(times[label]):.3f}", f"{med / base:.2f}",
                      f"{used:.3f}", f"{used / cpu_base:.2f}",
                      ("pass" if ok else "FAIL") if bar else "-")
    console = Console(width=140)
    console.print(table)
    try:
        load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        load = "n/a"
    console.print(f"{platform.processor() or platform.machine()}, Python {platform.python_version()}, "
                  + ", ".join(f"{p} {metadata.version(p)}" for p in ("pyarrow", "numpy", "typer", "rich"))
                  + f"; load average {load}; {datetime.date.today()}", highlight=False)
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
