"""``drifttool diff``: first drift between two runs."""

from __future__ import annotations

from pathlib import Path

import typer

from drifttool.cli._console import console, tolerate_closed_stdout


def diff(
    run_a: Path = typer.Argument(..., help="Baseline artifact directory."),
    run_b: Path = typer.Argument(..., help="Artifact directory to compare."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Align two runs by identity and report the first drift.

    Exit 0 identical, 1 drift, 2 incomparable, inconclusive or error.
    """
    from drifttool.artifact.reader import open_run  # lazy: `drifttool --help` needs no pyarrow
    from drifttool.diff.compare import diff_runs  # lazy: likewise
    from drifttool.diff.render import render  # lazy: likewise
    from drifttool.diff.report import exit_code  # lazy: likewise

    report = diff_runs(open_run(run_a), open_run(run_b))
    with tolerate_closed_stdout():
        if as_json:
            typer.echo(report.to_json())
        else:
            render(report, console)
    raise typer.Exit(exit_code(report.verdict))
