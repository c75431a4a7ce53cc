"""``drifttool fixture verify``: check a sealed fixture's seal, re-run it, diff against its
expected artifact.

    >>> result = verify_fixture("tiny-t2i", workdir)
    >>> result.report.verdict
    <Verdict.IDENTICAL: 'identical'>
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from drifttool.artifact.schema import MANIFEST
from drifttool.artifact.reader import open_run
from drifttool.diff.compare import diff_runs
from drifttool.diff.report import DiffReport
from drifttool.errors import ArtifactError
from drifttool.fixture import DEFAULT_FIXTURE, check_seal, extracted, load_fixture


@dataclass
class VerifyResult:
    fixture: str
    content_digest: str
    run_dir: Path
    report: DiffReport


def verify_fixture(name_or_path: str | Path | None = None, workdir: str | Path | None = None) -> VerifyResult:
    """Seal check, strict re-run with the fixture's settings, diff against ``expected/``.

    An archive is extracted into a temporary directory that is removed before this returns or
    raises (``drifttool.fixture.extracted``); so is the temporary ``workdir`` when anything
    raises (the caller owns it after a return).

    Raises:
        FixtureError: the seal does not match (tampered, missing or extra files, a symlink or a
            special file), or an archive cannot be extracted safely — nothing runs.
        ArtifactError: the expected artifact cannot be read (before anything runs), or
            ``workdir`` is itself an artifact (a run directory holds its own files only; the
            re-run goes to ``workdir/replay``).
    """
    if workdir is not None and (Path(workdir) / MANIFEST).is_file():
        raise ArtifactError(f"--workdir {workdir} is a drifttool artifact; give a directory of its "
                            "own (the re-run is written to WORKDIR/replay)")
    with extracted(name_or_path or DEFAULT_FIXTURE) as path:
        digest = check_seal(path)  # before anything in the fixture is read
        fx = load_fixture(path)
        expected = open_run(fx.expected_dir)  # a damaged expected artifact: refused before the run
        from drifttool.runner import execute  # lazy: torch only once the seal holds
        from drifttool.settings import RunSpec  # lazy: torch only once the seal holds

        work = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="drifttool-verify-"))
        try:
            run_dir = work / "replay"
            execute(RunSpec(fixture=fx.path, mode=fx.settings.get("mode", "strict")), run_dir,
                    overwrite=True)
            report = diff_runs(expected, open_run(run_dir))
        except BaseException:
            if not workdir:
                shutil.rmtree(work, ignore_errors=True)
            raise
    return VerifyResult(fixture=fx.name, content_digest=digest, run_dir=run_dir, report=report)
