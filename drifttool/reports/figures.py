"""The figures of a diff as PNG bytes, for the HTML report: the step × block drift heatmap
(``probes.plots.heatmap``) and the per-step drift overlay (``probes.plots.overlay``).

    >>> figs = diff_figures("runs/a", "runs/b", report)
    >>> sorted(figs)             # a drifting pair captured at L1 or L2
    ['heatmap', 'overlay']

matplotlib draws them (Agg backend, no display); nothing is left on disk.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any


def diff_figures(run_a: str | Path, run_b: str | Path, report: Any) -> dict[str, bytes]:
    """``{"heatmap": png, "overlay": png}`` of two runs and their ``DiffReport``: the heatmap
    only for a drift with differing operator records (L1/L2), the overlay unless the runs are
    incomparable (nothing aligns).

    Raises:
        ArtifactError: an artifact cannot be read.
    """
    from drifttool.artifact.reader import open_run  # lazy: figures need pyarrow and matplotlib
    from drifttool.probes.plots import drift_grid, heatmap, overlay  # lazy: likewise

    out: dict[str, bytes] = {}
    verdict = report.verdict.value
    ops = report.counts.get("ops")
    with tempfile.TemporaryDirectory(prefix="drifttool-report-") as tmp:
        if verdict == "drift" and ops is not None and ops.differ:
            fd = report.first_drift
            title = f"first drift: {fd.op} (step {fd.step})" if fd is not None else ""
            grid = drift_grid(open_run(run_a), open_run(run_b), report)
            out["heatmap"] = heatmap(grid, Path(tmp) / "heatmap.png", title=title).read_bytes()
        if verdict != "incomparable":
            path, _ = overlay(run_a, [run_b], Path(tmp) / "overlay.png", labels=["B"])
            out["overlay"] = path.read_bytes()
    return out
