"""``drifttool overlay``: per-step drift of several runs against a baseline, on one figure."""

from __future__ import annotations

from pathlib import Path
from typing import List

import typer
from rich.markup import escape

from drifttool.cli import _paths
from drifttool.cli._console import console, err
from drifttool.errors import DriftToolError
from drifttool.exit_codes import ExitCode

def overlay(
    runs: List[Path] = typer.Argument(..., parser=_paths.input_path, metavar="RUN_A RUN_B...", help="Baseline artifact, then the runs to compare."),
    out: Path = typer.Option(..., "-o", "--out", parser=_paths.path,
                           help="Figure to write (.png, .pdf or .svg; missing parent folders are created)."),
    title: str = typer.Option("", help="Figure title."),
) -> None:
    """Draw per-step drift curves (v_t, x_next, logp_t max|Δ| and the SDE KL) of each RUN_B against
    the baseline RUN_A on one figure (RFC qwenimage_ablation_overlay).

    Exit 0 when the figure is written and every run was compared (identical or drifting);
    3 when a run is incomparable or inconclusive (the figure is still written and names it, as
    `drifttool diff` exits 3 for it); 2 on an unreadable artifact.
    """
    from drifttool.probes.plots import overlay as draw  # lazy: `drifttool --help` needs no pyarrow

    if len(runs) < 2:
        raise DriftToolError("give a baseline and at least one run to compare")
    if not out.is_dir() and out.suffix.lower() not in (".png", ".pdf", ".svg"):
        raise DriftToolError(f"-o {out}: give a figure file name ending in .png, .pdf or .svg")
    _paths.output_file(out, "-o", "figure")
    path, reports = draw(runs[0], runs[1:], _paths.parent_made(out), title=title)
    for run, rep in zip(runs[1:], reports):
        # the diff's own one-line reason: the level it covers, common samples, first drift
        console.print(f"{run}: {rep.verdict.value.upper()} — {rep.reason}", highlight=False,
                      soft_wrap=True, markup=False)
    console.print(f"wrote {path}", highlight=False)
    unsure = [f"{run} ({rep.verdict.value})" for run, rep in zip(runs[1:], reports)
              if rep.verdict.value in ("incomparable", "inconclusive")]
    if unsure:
        err.print(f"[bold yellow]not compared:[/] {escape(', '.join(unsure))}: the figure names "
                  "them, with no curve", highlight=False)
        raise typer.Exit(ExitCode.UNSURE)
