"""``drifttool fixture verify|seal``: sealed fixtures anyone can re-verify."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Optional

import typer

from drifttool.cli import _completion, _json, _paths
from drifttool.cli._command import Command, Group
from drifttool.cli._console import console, notice
from drifttool.cli._errors import user_errors
from drifttool.cli._threads import threaded
from drifttool.exit_codes import EXIT_HELP

app = typer.Typer(cls=Group, help="Verify or seal fixtures.", epilog=EXIT_HELP, no_args_is_help=True)


@app.command("verify", cls=Command, epilog=EXIT_HELP)
@threaded
def verify(
    fixture: Optional[str] = typer.Argument(None, metavar="[NAME|DIR|TAR]", autocompletion=_completion.fixtures, help="Fixture name (tiny-t2i, tiny-t2i-chain, tiny-edit: packaged in the folder `python -c \"from drifttool.fixture import packaged_fixtures; print(packaged_fixtures())\"` prints; copy one to make your own), directory or .tar(.gz) (default tiny-t2i)."),
    workdir: Optional[Path] = typer.Option(
        None, parser=_paths.path, help="Where to write the replay artifact, as WORKDIR/replay (default: a temp dir, removed when the replay is identical, kept for inspection when it is not). An earlier replay there is replaced only if fixture verify wrote it and it is unchanged (WORKDIR/fixture-verify.json records its files); anything else in WORKDIR/replay, or as WORKDIR/replay*.png, is refused."),
    as_json: bool = _json.option(),
) -> None:
    """Check the seal, re-run the fixture and diff against its expected digests.

    Exit 0 when the replay is identical to the expected artifact (and, for a chain or edit
    fixture, every decoded image has the expected SHA-256), 1 on a drift or a differing image,
    3 when they are incomparable or the comparison is inconclusive, 2 on a broken seal or a bad
    fixture.
    """
    from drifttool.diff.render import render  # lazy: `drifttool --help` needs no pyarrow
    from drifttool.verify import verify_fixture  # lazy: likewise

    result = user_errors(verify_fixture, command="fixture verify")(fixture, workdir)
    code = result.exit_code
    keep = workdir is not None or code != 0  # a failed replay stays for inspection
    images = [{"expected": i.expected, "replay": i.replay if keep else None, "equal": i.equal,
               "expected_sha256": i.expected_sha256, "replay_sha256": i.replay_sha256}
              for i in result.images]
    if not keep:
        shutil.rmtree(result.run_dir.parent, ignore_errors=True)
    # only paths that still exist are shown: the removed re-run, an archive's extracted expected/
    gone = {"run_a": f"expected/ of {fixture} (extracted to a temporary directory, removed)",
            "run_b": "the fixture's re-run (removed; --workdir DIR keeps it)"}
    gone = {k: words for k, words in gone.items() if not Path(getattr(result.report, k)).exists()}
    if as_json:
        shown = dataclasses.replace(result.report, **dict.fromkeys(gone))
        _json.emit("fixture verify", {
            "fixture": result.fixture, "content_digest": result.content_digest, "seal": "ok",
            "replay_dir": str(result.run_dir) if keep else None, "exit_code": code,
            "images": images, "note": result.note, "report": shown.to_dict()})
    else:
        where = ("replay removed" if not keep else f"replay in {result.run_dir}" if workdir is not None
                 else f"replay kept for inspection in {result.run_dir} (remove it when done)")
        console.print(f"fixture [bold]{result.fixture}[/] seal ok ({result.content_digest}); {where}")
        render(dataclasses.replace(result.report, **gone), console)
        for i in result.images:
            if i.equal:
                console.print(f"image {i.expected}: sha256 identical ({i.expected_sha256})", highlight=False)
            else:
                console.print(f"[bold red]image {i.expected} differs[/]: sha256 {i.expected_sha256} "
                              f"expected, {i.replay_sha256 or 'no image'} in the replay", highlight=False)
        if result.note:
            notice("note", result.note)
    raise typer.Exit(code)


@app.command("seal", cls=Command, epilog=EXIT_HELP)
def seal_cmd(
    path: Path = typer.Argument(..., parser=_paths.input_path, metavar="DIR", help="Fixture directory to (re)seal."),
    rebuild: bool = typer.Option(False, "--rebuild", help="Re-run the fixture from its fixture.json first and put the result in place of expected/ (and its decoded images), as after editing its settings."),
) -> None:
    """Write seal.json (xxh3_128 of every file) for a fixture directory.

    Only a fixture that `fixture verify` can pass is sealed: fixture.json well formed and
    complete, the model (transformer/) and expected/ present, expected/ made with the
    settings fixture.json holds (after editing them: --rebuild), and the sealed fixture's
    re-run identical to expected/ (as `fixture verify` checks it). Otherwise exit 2, no seal
    left (an earlier one restored).
    """
    from drifttool.sealing import seal_fixture  # lazy: it brings torch, which `drifttool --help` does not need

    console.print(f"sealed {path}: {user_errors(seal_fixture, command='fixture seal')(path, rebuild=rebuild)}")
