"""Run one ``drifttool`` command in this process, then print what it cost as one JSON line.

    $ python benchmarks/measure_cli.py run -o runs/a --device cuda ...
    ... (the command's own output)
    MEASURED {"rc": 0, "wall_s": 12.31, "peak_gpu_gib": 41.22}

``rc`` is the command's exit status (the CLI's codes: 0 success or identical, 1 drift, ...),
``wall_s`` its wall time from the command line's parse to its exit (imports before it not
counted), ``peak_gpu_gib`` the most memory torch's allocator held on the current CUDA device
(``torch.cuda.max_memory_allocated``; null without CUDA). The host's peak resident memory is the
parent's to read (``os.wait4``'s ``ru_maxrss``): ``full_size_table.py`` runs every command
through this wrapper. The wrapper exits with the command's status.
"""

from __future__ import annotations

import json
import sys
import time

import torch


def main(argv: list[str]) -> int:
    from drifttool.cli.app import main  # noqa: F401  (imported before the clock starts)

    t0 = time.perf_counter()
    rc = cli_exit(argv)
    print(measured_line(rc, t0), flush=True)
    return rc


def cli_exit(argv: list[str]) -> int:
    """``drifttool argv`` in this process; its exit status (``sys.argv`` restored after)."""
    from drifttool.cli.app import main as cli

    argv0, sys.argv = sys.argv, ["drifttool", *argv]
    try:
        cli()
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = argv0


def measured_line(rc: int, t0: float) -> str:
    """The ``MEASURED`` line of a job that began at ``t0`` (``time.perf_counter``) and ends now with
    exit status ``rc`` (``diffusers_jobs.py`` prints the same)."""
    wall = time.perf_counter() - t0
    gpu = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    return "MEASURED " + json.dumps({"rc": rc, "wall_s": round(wall, 2),
                                     "peak_gpu_gib": None if gpu is None else round(gpu, 2)})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
