"""``drifttool report``: one self-contained HTML page for a pair of runs.

    drifttool report runs/a runs/b -o report.html     # open it in any browser, offline
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from drifttool.cli import _completion, _paths
from drifttool.cli._console import console
from drifttool.errors import DriftToolError, writing


def report(
    run_a: Path = typer.Argument(..., parser=_paths.input_path, help="Baseline artifact directory."),
    run_b: Path = typer.Argument(..., parser=_paths.input_path, help="Artifact directory to compare."),
    out: Path = typer.Option(..., "-o", "--out", parser=_paths.path,
                           help="HTML file to write (e.g. report.html; missing parent folders are created)."),
    tolerance: Optional[str] = typer.Option(
        None, "--tolerance", metavar="PROFILE", autocompletion=_completion.tolerance_profiles,
        help="Also judge every differing record against a tolerance profile, as diff does (a "
             f"shipped one: {', '.join(_completion.tolerance_profile_names())}; or a profile JSON file)."),
    junit: Optional[Path] = typer.Option(
        None, "--junit", metavar="FILE", parser=_paths.path,
        help="Also write the diff as JUnit XML (as diff --junit)."),
) -> None:
    """Diff two runs and write one self-contained HTML page.

    The page holds the verdict, the first drift, the differences in context, the per-step table,
    the drift heatmap (step x block) and the per-step drift overlay, the figures embedded in it:
    nothing else is fetched, so it opens offline and can be kept as a CI job's artifact. The
    heatmap counts differing operator records: runs captured at L0 (step boundaries only) have
    none, and the page says so in its place.

    Exits as `drifttool diff` does: 0 identical (or a drift within --tolerance), 1 drift,
    2 bad input, 3 incomparable or inconclusive.
    """
    from drifttool.artifact.reader import open_run  # lazy: `drifttool --help` needs no pyarrow
    from drifttool.diff.compare import diff_runs  # lazy: likewise
    from drifttool.reports.figures import diff_figures  # lazy: matplotlib, only here
    from drifttool.reports.html import render_html  # lazy: likewise

    if not out.is_dir() and out.suffix.lower() not in (".html", ".htm"):
        raise DriftToolError(f"-o {out}: give an HTML file name ending in .html")
    _paths.output_file(out, "-o", "report")
    if junit is not None:
        _paths.output_file(junit, "--junit", "junit")
        if junit.resolve() == out.resolve():
            raise DriftToolError(f"--junit {junit}: is the -o report file; give another file name")
    profile = None
    if tolerance is not None:
        from drifttool.diff.tolerance import load_profile  # lazy: likewise

        profile = load_profile(tolerance)
    diff = diff_runs(open_run(run_a), open_run(run_b), tolerance=profile)
    page = render_html(diff, diff_figures(run_a, run_b, diff))
    with writing(out):
        _paths.parent_made(out).write_text(page, encoding="utf-8")
    if junit is not None:
        from drifttool.reports.junit import diff_suite, write_junit  # lazy: likewise

        write_junit([diff_suite(diff)], junit)
    console.print(f"{diff.verdict.value.upper()}  {diff.reason}", highlight=False, markup=False,
                  soft_wrap=True)
    if diff.tolerance is not None:  # the line that decides the exit beside a drift or an identical pair
        console.print(f"{diff.tolerance.verdict.upper()}  {diff.tolerance.words()}", highlight=False,
                      markup=False, soft_wrap=True)
    console.print(f"wrote {out}" + ("" if junit is None else f" and {junit}"), highlight=False)
    raise typer.Exit(diff.exit_code)
