"""Host synchronisations per denoising step of a CUDA run, counted and bounded.

torch's sync debug mode (``torch.cuda.set_sync_debug_mode("warn")``) warns at every operation
that makes the host wait for the GPU (``.item()``, ``.cpu()``, a copy to pageable memory,
``nonzero``, …). The count between two steps' callbacks is one step's: its model calls, the SDE
step and the capture flush to the artifact. Each is a stall in the host's queue of launches, so
the bound is part of the speed contract (``docs/benchmarks.md``). Skipped without CUDA.

    $ python -m tests.gpu.test_host_syncs_cuda      # prints the counts per mode and level
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import pytest
import torch

from drifttool.runner import execute
from drifttool.settings import RunSpec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MOST_PER_STEP = 3
"""The bound, as measured on an H200 (2026-12-03, batch 2, CFG, 6 steps, ``python -m
tests.gpu.test_host_syncs_cuda``): strict 2 per step at L0 and 3 at L1/L2 (the step's one
read-back of the digests); production (``auto``) 2 at L0 and 3 at L1 (1 and 2 at its last step).
Before the step's sigmas, SDE schedule and prompt rows were read on the host and the strict step's
constants went over in one non-blocking copy, the counts were 27–28 (strict) and 21–22
(production). The forward itself adds none (its CUDA graph replays without the host). A change
that adds one fails here."""


def syncs_per_step(mode: str, level: str, out: Path, steps: int = 6) -> list[int]:
    """Host synchronisations torch counted between consecutive steps of a ``steps``-step CFG run
    (batch 2, the embedded default on ``cuda``): one number per step after the first."""
    marks: list[int] = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            execute(RunSpec(device="cuda", mode=mode, capture=level, steps=steps, batch=2), out,
                    on_step=lambda _: marks.append(len(seen)))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [i for i, w in enumerate(seen) if "synchroniz" in str(w.message)]
    return [sum(a <= i < b for i in syncs) for a, b in zip(marks, marks[1:])]


@pytest.mark.parametrize("mode,level", [("strict", "L0"), ("strict", "L1"), ("auto", "L1")])
def test_host_synchronisations_per_step_are_bounded(tmp_path, mode, level):
    counts = syncs_per_step(mode, level, tmp_path / "run")
    print(f"\nhost synchronisations per step, {mode} {level}: {counts}")
    assert len(counts) == 5 and max(counts) <= MOST_PER_STEP, (mode, level, counts)


def sync_sites(mode: str, level: str, out: Path, steps: int = 4, top: int = 12) -> list[tuple[int, str]]:
    """Where a run's host synchronisations come from: (count, innermost drifttool frames) for the
    ``top`` most frequent call sites of a ``steps``-step CFG run (batch 2) on ``cuda``."""
    import collections
    import traceback

    sites: collections.Counter[str] = collections.Counter()

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            frames = [f for f in traceback.extract_stack()[:-1] if "drifttool" in f.filename]
            sites[" < ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames[-3:]))] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            execute(RunSpec(device="cuda", mode=mode, capture=level, steps=steps, batch=2), out)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sites.most_common(top)


if __name__ == "__main__":
    import sys

    if "--where" in sys.argv:
        for mode, level in (("strict", "L1"), ("auto", "L1")):
            with tempfile.TemporaryDirectory() as d:
                print(f"{mode} {level}: host synchronisations by call site (4 steps)")
                for n, site in sync_sites(mode, level, Path(d) / "run"):
                    print(f"  {n:5d}  {site}")
        sys.exit(0)
    for mode, level in (("strict", "L0"), ("strict", "L1"), ("strict", "L2"), ("auto", "L0"), ("auto", "L1")):
        with tempfile.TemporaryDirectory() as d:
            print(mode, level, "host syncs per step:", syncs_per_step(mode, level, Path(d) / "run"))
