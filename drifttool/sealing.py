"""``drifttool fixture seal``: seal a fixture only when ``fixture verify`` can pass it.

    >>> seal_fixture("my-fixture")                 # checks, then writes seal.json
    'c5a1…'
    >>> seal_fixture("my-fixture", rebuild=True)   # re-runs expected/ from fixture.json first

A seal says "these files re-verify". So before ``seal.json`` is written the fixture must be one
that ``fixture verify`` and ``run --fixture`` read without a refusal:

- ``fixture.json`` well formed (``fixture.load_fixture``,
  ``fixture_settings.check_fixture_settings``) and complete: every setting a re-run needs
  (``fixture_settings.check_complete``: ``REQUIRED``; without a ``preset``, also
  ``PRESET_GIVES``), since a fixture re-runs from its own settings alone;
- the model it runs (``transformer/``) and its expected artifact (``expected/manifest.json``, and
  for a chain or edit fixture the decoded images, ``verify.expected_images``) present;
- settings its re-run takes (``verify.check_rerun``: a preset's mode and seed, the prompt
  embeddings or pipeline folders it runs from), checked before the expected artifact is, so that
  ``rebuild`` is offered only where a re-run can make it;
- the expected artifact made with the settings ``fixture.json`` holds now: a fixture whose seed
  was edited after its expected run was made would seal and then fail every verify;
- and then what only a run shows (a condition image or prompt file missing or unreadable,
  weights truncated, a config that does not fit them): the fixture is sealed, verified
  (``verify.verify_fixture``: re-run and diffed against ``expected/``, images included), and
  the seal is taken back (the one before it, if any, restored) unless it verifies identical.

The checks that come before ``expected/`` is compared or anything re-runs are
``verify.check_reseal``'s, which ``fixture verify`` also asks, without torch, what ``fixture seal
--rebuild`` would say about a fixture whose seal no longer holds.

``rebuild`` re-runs the fixture (``verify.rerun``, as its build script made it) into a temporary
directory and puts the artifact and its images in place of ``expected/`` before sealing (that
re-run is the verification).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from drifttool.artifact.manifest import read_manifest
from drifttool.errors import ArtifactError, FixtureError
from drifttool.fixture import SEAL, Fixture, reseal_command, seal
from drifttool.verify import (DEFAULT_MODE, check_model, check_reseal, expected_images, fixture_kind, rerun,
                              verify_fixture)


def _expected_manifest(fx: Fixture) -> dict[str, Any]:
    path = fx.expected_dir / "manifest.json"
    if not path.is_file():
        raise FixtureError(f"{fx.path}: no expected artifact (expected/manifest.json); "
                           f"`{reseal_command(fx.path)}` makes it")
    try:
        return read_manifest(fx.expected_dir)
    except ArtifactError as e:
        raise FixtureError(f"{e}; `{reseal_command(fx.path)}` makes it again") from None


def _shown(key: str, value: Any) -> str:
    if isinstance(value, list):
        return ("x" if key == "img_grid" else ", ").join(map(str, value))
    return "null" if value is None else str(value)


def check_expected(fx: Fixture) -> None:
    """Raise unless ``fx``'s model and expected artifact are present and the artifact was made with
    the settings ``fixture.json`` holds.

    Raises:
        FixtureError: no ``transformer/``, no or an unreadable ``expected/manifest.json``, a
            decoded image missing, or settings that differ (each named: the expected run's value
            and fixture.json's).
    """
    check_model(fx)
    manifest = _expected_manifest(fx)
    made = manifest["settings"]
    wanted = {"mode": DEFAULT_MODE, **fx.settings}
    differ = [k for k in sorted(wanted) if made.get(k) != wanted[k]]
    if differ:
        was = ", ".join(f"{k} {_shown(k, made.get(k))}" for k in differ)
        now = ", ".join(f"{k} {_shown(k, wanted[k])}" for k in differ)
        raise FixtureError(f"{fx.expected_dir}: made with {was}, where fixture.json says {now}; "
                           f"`{reseal_command(fx.path)}` re-runs it")
    expected_images(fx, manifest)


def rebuild_expected(fx: Fixture) -> None:
    """Re-run ``fx`` into a temporary directory and put the artifact (and a chain or edit
    fixture's decoded images) in place of ``expected/`` (and ``expected*.png``).

    Raises:
        DriftToolError: the re-run's own refusals (its settings, its model), before anything in
            the fixture is replaced.
    """
    fixture_kind(fx)  # a malformed chain or edit entry: refused before the run
    work = Path(tempfile.mkdtemp(prefix="drifttool-rebuild-"))
    try:
        images = rerun(fx, work / "expected")
        old = [fx.expected_dir, *fx.path.glob("expected.png"), *fx.path.glob("expected-*.png")]
        for p in old:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            elif p.exists() or p.is_symlink():
                p.unlink()
        shutil.move(str(work / "expected"), str(fx.expected_dir))
        for image in images:
            shutil.move(str(image), str(fx.path / image.name))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def seal_fixture(path: str | Path, *, rebuild: bool = False) -> str:
    """Check the fixture at ``path`` (module docstring), re-make its expected artifact first with
    ``rebuild``, and write ``seal.json``; returns the content digest.

    Raises:
        FixtureError: not a fixture directory, a malformed or incomplete ``fixture.json``, a
            missing model, expected artifact or image, an expected artifact of other settings, a
            re-run that does not reproduce ``expected/``, settings its re-run refuses
            (``verify.check_reseal``, before ``expected/`` is compared); no seal is left (an
            earlier one is restored).
        DriftToolError: the re-run's refusals (``verify.rerun``).
    """
    path = Path(path)
    fx = check_reseal(path, rebuild=rebuild)  # before expected/ is compared (and --rebuild offered)
    if rebuild:
        rebuild_expected(fx)
    check_expected(fx)
    if rebuild:  # its re-run just made expected/
        return seal(path)
    return _seal_verified(path)


def _seal_verified(path: Path) -> str:
    """``seal(path)``, kept only if the fixture then verifies identical (module docstring)."""
    before = (path / SEAL).read_bytes() if (path / SEAL).is_file() else None
    digest = seal(path)
    kept = False
    try:
        try:
            result = verify_fixture(path)
        except ArtifactError as e:  # expected/ damaged: what its reader refuses, and the remedy
            raise FixtureError(f"{e}; not sealed (`{reseal_command(path)}` re-makes expected/)") from None
        shutil.rmtree(result.run_dir.parent, ignore_errors=True)
        if result.exit_code != 0:
            fd = result.report.first_drift
            why = (f"first drift at {fd.where()}" if fd is not None else
                   "the decoded images differ" if result.report.exit_code == 0 else
                   f"verdict {result.report.verdict.value}")
            raise FixtureError(f"{path}: its re-run does not reproduce expected/ ({why}); not "
                               f"sealed (`{reseal_command(path)}` re-makes expected/)")
        kept = True
        return digest
    finally:
        if not kept:
            if before is None:
                (path / SEAL).unlink(missing_ok=True)
            else:
                (path / SEAL).write_bytes(before)
