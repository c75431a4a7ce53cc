"""``drifttool fixture verify``: check a sealed fixture's seal, re-run it, diff against its
expected artifact.

    >>> result = verify_fixture("tiny-t2i", workdir)
    >>> result.report.verdict
    <Verdict.IDENTICAL: 'identical'>
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from drifttool.artifact.reader import open_run
from drifttool.diff.compare import diff_runs
from drifttool.diff.report import DiffReport
from drifttool.fixture import DEFAULT_FIXTURE, check_seal, load_fixture


@dataclass
class VerifyResult:
    fixture: str
    content_digest: str
    run_dir: Path
    report: DiffReport


def verify_fixture(name_or_path: str | Path | None = None, workdir: str | Path | None = None) -> VerifyResult:
    """Seal check, strict re-run with the fixture's settings, diff against ``expected/``.

    Raises:
        FixtureError: the seal does not match (tampered, missing or extra files) — nothing runs.
        ArtifactError: the expected artifact cannot be read.
    """
    fx = load_fixture(name_or_path or DEFAULT_FIXTURE)
    digest = check_seal(fx.path)
    from drifttool.runner import RunSpec, execute  # torch: only once the seal holds

    work = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="drifttool-verify-"))
    run_dir = work / "replay"
    execute(RunSpec(fixture=fx.path, mode=fx.settings.get("mode", "strict")), run_dir, overwrite=True)
    report = diff_runs(open_run(fx.expected_dir), open_run(run_dir))
    return VerifyResult(fixture=fx.name, content_digest=digest, run_dir=run_dir, report=report)
