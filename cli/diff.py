"""``drifttool diff``: first drift between two runs; ``--localize`` escalates to L2 where it drifts."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from drifttool.cli import _checkpoint, _completion, _json, _paths
from drifttool.cli._console import console, notice, tolerate_closed_stdout


def diff(
    run_a: Path = typer.Argument(..., parser=_paths.input_path, help="Baseline artifact directory."),
    run_b: Path = typer.Argument(..., parser=_paths.input_path, help="Artifact directory to compare."),
    as_json: bool = _json.option(),
    junit: Optional[Path] = typer.Option(
        None, "--junit", metavar="FILE", parser=_paths.path,
        help="Also write the diff as JUnit XML (one test case per compared step, the first drift "
             "as the failure message) for CI; missing parent folders are created, as -o does."),
    localize: bool = typer.Option(
        False, "--localize",
        help="Re-execute the first drifting step of both runs at L2 (attention unfused) from their "
             "replay inputs and name the operator, block, branch and rows there."),
    localize_dir: Optional[Path] = typer.Option(
        None, "--localize-dir", parser=_paths.path,
        help="Keep the re-executed artifacts in DIR/a and DIR/b (implies --localize; default: a "
             "temporary directory, removed). Unused, with a note, where no step is re-executed."),
    fixture: Optional[str] = typer.Option(
        None, autocompletion=_completion.fixtures, help="With --localize: fixture holding the model, if a manifest's name does not resolve."),
    checkpoint: Optional[Path] = _checkpoint.option(
        "With --localize: the model of both runs (fingerprint-checked), as replay --checkpoint "
        "takes it; needed for a captured diffusers pipeline (its pipeline folder)."),
    tolerance: Optional[str] = typer.Option(
        None, "--tolerance", metavar="PROFILE", autocompletion=_completion.tolerance_profiles,
        help="Also judge every differing record against a tolerance profile (a shipped one: "
             f"{', '.join(_completion.tolerance_profile_names())}; or a profile JSON file): "
             "within/beyond per record, the first record beyond named. Exit 0 when every "
             "differing record is within it."),
    clip_range: Optional[float] = typer.Option(
        None, "--clip-range", metavar="EPS",
        help="Also report the log-prob drift per step and CFG branch against a PPO clip range "
             "(e.g. 1e-4): mean/max |Δlogp_t|, max |exp(Δlogp_t) − 1| as a share of EPS, and "
             "whether it is below or above the clip noise floor. The exit code is unchanged."),
) -> None:
    """Align two runs by identity and report the first drift.

    With --localize (for runs captured at L0, L1, or L2 with --no-internals) the first step whose
    input x_t matches and whose records differ is re-executed for both runs at L2, attention
    internals included, and the first drifting operator there is reported, with the time it took
    beside an estimate of an L2 pair of whole runs. Prompt or edit runs whose drift starts before
    the transformer (in the text encoder or the VAE encode) are not re-executed: the status says
    which stage it starts in.

    With --tolerance PROFILE the differing records are judged against the profile's bounds
    (step quantities on their values, operator outputs on their summaries) and the first record
    beyond it is named; the bitwise verdict is still printed.

    Before any record, a semantic pre-check compares what makes the runs different programs
    (schedule, shift, timestep encoding, CFG, SDE, noise provenance, LoRA, weights, attention
    backend) and reports a SEMANTIC MISMATCH first, naming each difference.

    With --clip-range EPS the log-prob drift per step and branch is judged against the clip range.

    With --junit FILE the diff is also written as JUnit XML, which CI systems show as tests.

    Exit 0 identical (or, with --tolerance, a drift within the profile), 1 drift or semantic
    mismatch, 2 bad input, 3 incomparable or inconclusive.
    """
    from drifttool.artifact.reader import open_run  # lazy: `drifttool --help` needs no pyarrow
    from drifttool.diff.compare import diff_runs  # lazy: likewise
    from drifttool.diff.render import render  # lazy: likewise

    for name, given in (("--fixture", fixture), ("--checkpoint", checkpoint)):
        if given is not None and not (localize or localize_dir):
            raise typer.BadParameter(f"{name} goes with --localize", param_hint=name)
    if junit is not None:
        _paths.output_file(junit, "--junit", "junit")
    if localize_dir is not None:
        _paths.output_dir(localize_dir, "--localize-dir")
    profile = None
    if tolerance is not None:
        from drifttool.diff.tolerance import load_profile  # lazy: likewise

        profile = load_profile(tolerance)
    report = diff_runs(open_run(run_a), open_run(run_b), tolerance=profile, clip_range=clip_range)
    result = None
    if localize or localize_dir is not None:
        from drifttool.training.localize import localize as run_localize  # lazy: torch, only here
        from drifttool.training.options import RerunOptions  # lazy: likewise

        _, result = run_localize(run_a, run_b, out_dir=localize_dir, report=report,
                                 options=RerunOptions(fixture=fixture, checkpoint=checkpoint))
        unused = [f"{name} {value}" for name, value in (("--localize-dir", localize_dir),
                  ("--fixture", fixture), ("--checkpoint", checkpoint)) if value is not None]
        if unused and not result.reexecuted:  # they serve a re-execution, which did not happen
            notice("note", f"{', '.join(unused)}: unused, as no step was re-executed "
                           f"({result.status.replace('_', ' ')})")
    if junit is not None:
        from drifttool.reports.junit import diff_suite, write_junit  # lazy: only --junit needs it

        write_junit([diff_suite(report)], junit)
    if as_json:
        data = report.to_dict()
        if result is not None:
            data["localize"] = result.to_dict()
        _json.emit("diff", data)
    else:
        with tolerate_closed_stdout():
            render(report, console)
            if result is not None:
                from drifttool.training.render_localize import render_localize  # lazy: likewise

                render_localize(result, console)
    raise typer.Exit(report.exit_code)
