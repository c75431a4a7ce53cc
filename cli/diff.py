"""``drifttool diff``: first drift between two runs; ``--localize`` escalates to L2 where it drifts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from drifttool.cli._console import console, tolerate_closed_stdout


def diff(
    run_a: Path = typer.Argument(..., help="Baseline artifact directory."),
    run_b: Path = typer.Argument(..., help="Artifact directory to compare."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    localize: bool = typer.Option(
        False, "--localize",
        help="Re-execute the first drifting step of both runs at L2 (attention unfused) from their "
             "replay inputs and name the operator, block, branch and rows there."),
    localize_dir: Optional[Path] = typer.Option(
        None, "--localize-dir",
        help="Keep the re-executed artifacts in DIR/a and DIR/b (implies --localize; default: a "
             "temporary directory, removed)."),
    fixture: Optional[str] = typer.Option(
        None, help="With --localize: fixture holding the model, if a manifest's name does not resolve."),
) -> None:
    """Align two runs by identity and report the first drift.

    With --localize (for runs captured at L0 or L1) the first step whose input x_t matches and
    whose records differ is re-executed for both runs at L2, and the first drifting operator there
    is reported, with the time it took beside an estimate of an L2 pair of whole runs.

    Exit 0 identical, 1 drift, 2 incomparable, inconclusive or error.
    """
    from drifttool.artifact.reader import open_run  # lazy: `drifttool --help` needs no pyarrow
    from drifttool.diff.compare import diff_runs  # lazy: likewise
    from drifttool.diff.render import render  # lazy: likewise
    from drifttool.diff.report import exit_code  # lazy: likewise

    if fixture is not None and not (localize or localize_dir):
        raise typer.BadParameter("--fixture goes with --localize", param_hint="--fixture")
    report = diff_runs(open_run(run_a), open_run(run_b))
    result = None
    if localize or localize_dir is not None:
        from drifttool.training.localize import localize as run_localize  # lazy: torch, only here
        from drifttool.training.options import RerunOptions  # lazy: likewise

        _, result = run_localize(run_a, run_b, out_dir=localize_dir, report=report,
                                 options=RerunOptions(fixture=fixture))
    with tolerate_closed_stdout():
        if as_json:
            data = report.to_dict()
            if result is not None:
                data["localize"] = result.to_dict()
            typer.echo(json.dumps(data, indent=2, allow_nan=False))
        else:
            render(report, console)
            if result is not None:
                from drifttool.diff.render_localize import render_localize  # lazy: likewise

                render_localize(result, console)
    raise typer.Exit(exit_code(report.verdict))
