"""``drifttool trace``: the operator trace of a run (``qwenimage_operator_trace``)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from drifttool.cli._console import console


def trace(
    run_dir: Path = typer.Argument(..., help="Artifact directory."),
    fallbacks_only: bool = typer.Option(False, "--fallbacks", help="Show only call sites that fell back."),
) -> None:
    """Show every call site: requested and actual backend, kernel, contract, fallback."""
    from drifttool.artifact.reader import open_run  # lazy: `drifttool --help` needs no pyarrow

    run = open_run(run_dir)
    rows = sorted(run.trace_rows(), key=lambda r: (r["block"], r["stream"], r["op"], r["call"]))
    if fallbacks_only:
        rows = [r for r in rows if r["fallback"]]
    table = Table(title=f"operator trace — {run_dir} (mode {run.manifest.get('settings', {}).get('mode')})")
    for col in ("block", "stream", "op", "call", "requested", "actual", "kernel", "contract", "fallback", "reason", "calls"):
        table.add_column(col)
    for r in rows:
        table.add_row(*(str(r[c]) for c in ("block", "stream", "op", "call", "requested", "actual",
                                              "kernel", "contract", "fallback", "reason", "calls")))
    console.print(table)
    n_fb = sum(1 for r in run.trace_rows() if r["fallback"])
    console.print(f"{len(run.trace_rows())} call sites, {n_fb} with fallback")
