"""``drifttool fixture verify``: check a sealed fixture's seal, re-run it, diff against its
expected artifact (and, for a fixture that decodes images, compare the images' SHA-256).

    >>> result = verify_fixture("tiny-t2i", workdir)
    >>> result.report.verdict
    <Verdict.IDENTICAL: 'identical'>

Three kinds of fixture, told apart by ``fixture.json``:

- a trajectory (``tiny-t2i``): the settings' run on ``transformer/`` with ``prompts.safetensors``
  (``runner.execute``);
- a prompt run (``tiny-t2i-chain``; a ``chain`` key with ``prompts`` and optional
  ``negative_prompts``): the fixture folder is a pipeline folder and the whole chain re-runs —
  text encoder, trajectory, VAE decode (``drifttool.chain.run_chain``);
- an edit run (``tiny-edit``; an ``edit`` key with ``condition_images``, files of the fixture,
  optionally ``vae_image_area``, the resize's pixel area, default the pipelines' 1024², and
  ``prompts``, ``negative_prompts``, ``prompt_positions``: ``Fixture.edit``): the fixture folder
  is a pipeline folder; the condition images resized, the prompts encoded with them by the text
  encoder and its vision tower, the images through the VAE encode, the trajectory, the decode
  (``drifttool.chain_edit.run_edit``, which takes these from the fixture).

The settings' ``mode`` and ``preset`` are the re-run's. A chain or edit fixture keeps the
images its expected run decoded beside ``expected/`` (``expected.png``, or ``expected-<s>.png``
for several samples); each re-run image must have the same SHA-256, else the fixture fails
(exit 1, the differing images named) even when every record is identical.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from drifttool.artifact.directory import foreign_files, holds_run
from drifttool.artifact.manifest_schema import STRICT_MODES
from drifttool.artifact.schema import MANIFEST
from drifttool.artifact.reader import open_run
from drifttool.diff.compare import diff_runs
from drifttool.diff.report import DiffReport
from drifttool.errors import ArtifactError, DriftToolError, FixtureError
from drifttool.exit_codes import ExitCode
from drifttool.fixture import (DEFAULT_FIXTURE, Fixture, check_seal, check_sealable, extracted, is_text_list,
                               load_fixture, reseal_command, sealed_above)
from drifttool.fixture_prompts import read_prompts
from drifttool.fixture_settings import check_complete, check_fixture_settings
from drifttool.sampling.preset_table import check_preset_seed

if TYPE_CHECKING:  # pragma: no cover
    from drifttool.settings import RunSpec


@dataclass
class ImageCheck:
    """One decoded image: its expected file, the re-run's file and both SHA-256 digests."""

    expected: str
    replay: str
    expected_sha256: str
    replay_sha256: str | None

    @property
    def equal(self) -> bool:
        return self.expected_sha256 == self.replay_sha256


@dataclass
class VerifyResult:
    fixture: str
    content_digest: str
    run_dir: Path
    report: DiffReport
    images: list[ImageCheck] = field(default_factory=list)
    note: str | None = None
    """Why a production fixture may drift here: the re-run's CPU dispatch or torch version is not
    the build's (``environment_note``)."""

    @property
    def exit_code(self) -> int:
        """The diff's exit code; 1 (drift) when the records agree but an image does not."""
        code = int(self.report.exit_code)
        if code == ExitCode.OK and any(not i.equal for i in self.images):
            return int(ExitCode.DRIFT)
        return code


DEFAULT_MODE = "strict"
"""The mode of a fixture whose settings name none."""


def fixture_kind(fx: Fixture) -> str:
    """``trajectory``, ``chain`` or ``edit`` (module docstring).

    Raises:
        FixtureError: a malformed ``chain`` or ``edit`` entry, or both.
    """
    chain = fx.meta.get("chain")
    if chain is not None and fx.meta.get("edit") is not None:
        raise FixtureError(f"{fx.path}: fixture.json has both 'chain' and 'edit'; a fixture is one run")
    if chain is not None:
        unknown = sorted(set(chain) - {"prompts", "negative_prompts"}) if isinstance(chain, dict) else []
        if unknown:
            raise FixtureError(f"{fx.path / 'fixture.json'}: unknown key chain.{unknown[0]} (one of "
                               "prompts, negative_prompts)")
        negs = chain.get("negative_prompts") if isinstance(chain, dict) else None
        if not (isinstance(chain, dict) and is_text_list(chain.get("prompts"))
                and (negs is None or is_text_list(negs))):
            raise FixtureError(f"{fx.path}: fixture.json 'chain' needs 'prompts' (a list of texts) "
                               "and optionally 'negative_prompts'")
        return "chain"
    if fx.edit is not None:
        return "edit"
    return "trajectory"


def fixture_spec(fx: Fixture) -> "RunSpec":
    """The ``RunSpec`` that re-runs ``fx``: its settings (``fixture``), its ``mode`` and
    ``preset``, and for a chain or edit fixture the fixture folder as the pipeline folder."""
    from drifttool.settings import RunSpec  # lazy: torch only once the seal holds

    kind = fixture_kind(fx)
    return RunSpec(fixture=fx.path, mode=fx.settings.get("mode", DEFAULT_MODE),
                   preset=fx.settings.get("preset"),
                   checkpoint=None if kind == "trajectory" else fx.path)


_PROMPT_PARTS = ("tokenizer", "text_encoder")
"""The pipeline folders that encode a chain or edit fixture's prompts."""


def check_rerun(fx: Fixture) -> None:
    """Refuse, in the fixture's own words, what its re-run (``rerun``: ``fixture verify``,
    ``fixture seal``) would refuse in the words of ``drifttool run``, naming a flag those
    commands do not have (``--steps``, ``--mode``, ``--prompt-embeds``, ``--checkpoint``).
    Nothing here imports torch (``check_reseal``).

    Raises:
        FixtureError: a setting a re-run needs missing from ``fixture.json``
            (``fixture_settings.check_complete``); a ``preset`` under a mode of the strict
            family (``settings.mode``, strict where it names none: a preset reproduces a
            production pipeline), or with a seed its generators cannot take
            (``check_preset_seed``: seed + sample id outside [0, 2^63) for diffusers' generator
            list); a fixture without a
            ``chain`` or ``edit`` entry and without ``prompts.safetensors`` (the prompt
            embeddings it runs from); a chain fixture, or an edit fixture with prompts, whose
            folder lacks ``tokenizer/`` or ``text_encoder/``; a chain or edit fixture without
            ``vae/``.
    """
    check_complete(fx)
    source = fx.path / "fixture.json"
    preset, mode = fx.settings.get("preset"), fx.settings.get("mode", DEFAULT_MODE)
    if preset is not None and mode in STRICT_MODES:  # the modes of the strict family (Mode.family)
        named = f"mode {mode!r}" if "mode" in fx.settings else f"no mode ({DEFAULT_MODE})"
        raise FixtureError(f"{source}: settings: preset {preset!r} reproduces a production "
                           f"pipeline's arithmetic (bf16 latents, its scheduler step), and the "
                           f"settings name {named}, of the strict family: set settings.mode to "
                           "auto or off")
    if preset is not None and isinstance(fx.settings.get("seed"), int) and fx.settings.get("samples"):
        try:
            check_preset_seed(preset, fx.settings["seed"], fx.settings["samples"])
        except DriftToolError as e:
            raise FixtureError(f"{source}: settings: {e}") from None
    kind = fixture_kind(fx)
    if kind == "trajectory":
        if not (fx.path / "prompts.safetensors").is_file():
            raise FixtureError(f"{fx.path}: no prompt embeddings (prompts.safetensors), which a "
                               "fixture without a 'chain' or 'edit' entry in fixture.json runs from")
        return
    prompts = kind == "chain" or fx.edit.get("prompts") is not None
    missing = [p for p in (*(_PROMPT_PARTS if prompts else ()), "vae") if not (fx.path / p).is_dir()]
    if missing:
        raise FixtureError(f"{fx.path}: no {', '.join(p + '/' for p in missing)} ({'an' if kind == 'edit' else 'a'} {kind} fixture "
                           "re-runs its own pipeline: tokenizer/ and text_encoder/ encode its prompts, "
                           "vae/ its images)")


def check_model(fx: Fixture) -> None:
    """Raise unless ``fx`` holds the model it runs.

    Raises:
        FixtureError: no ``transformer/``, or one without its ``config.json`` or any
            ``.safetensors`` weights (checked without torch: what loading it would refuse first).
    """
    if not fx.model_dir.is_dir():
        raise FixtureError(f"{fx.path}: no transformer/ (the model the fixture runs)")
    if not (fx.model_dir / "config.json").is_file():
        raise FixtureError(f"{fx.model_dir}: no config.json (the configuration of the model the fixture runs)")
    if not any(p.is_file() for p in fx.model_dir.glob("*.safetensors")):
        raise FixtureError(f"{fx.model_dir}: no .safetensors weights (the model the fixture runs)")


def check_reseal(path: str | Path, *, rebuild: bool = False) -> Fixture:
    """What ``fixture seal`` (``drifttool.sealing.seal_fixture``) refuses about the fixture at
    ``path`` before it compares ``expected/`` or re-runs anything, and with ``rebuild`` what
    ``fixture seal --rebuild`` refuses before its re-run; returns the fixture. Nothing here
    imports torch, so ``fixture verify`` says with it what ``fixture seal --rebuild`` would say
    about a fixture whose seal no longer holds (``reseal_advice``) as fast as it checks the seal.

    Raises:
        FixtureError: not a fixture directory (``fixture.check_sealable``); a malformed or
            incomplete ``fixture.json`` (``fixture.load_fixture``,
            ``fixture_settings.check_fixture_settings``, ``fixture_settings.check_complete``, a
            malformed ``chain`` or ``edit`` entry: ``fixture_kind``); settings its re-run refuses
            (``check_rerun``); a trajectory fixture's ``prompts.safetensors`` that is not
            prompt embeddings (``fixture_prompts.read_prompts``); with ``rebuild``, no
            ``transformer/`` or a fixture folder (or its ``expected/``) that is not writable.
    """
    path = Path(path)
    check_sealable(path)
    fx = load_fixture(path)
    check_fixture_settings(fx)
    check_complete(fx)
    kind = fixture_kind(fx)  # a malformed chain or edit entry
    check_rerun(fx)  # what its re-run refuses: before expected/ is compared (and --rebuild offered)
    if kind == "trajectory":
        read_prompts(fx.path / "prompts.safetensors")  # what its re-run reads first
    if rebuild:
        check_model(fx)
        if not os.access(fx.path, os.W_OK) or (fx.expected_dir.exists() and not os.access(fx.expected_dir, os.W_OK)):
            raise FixtureError(f"{fx.path}: not writable; nothing re-run or written")
    return fx


def reseal_advice(path: Path, *, archive: Path | None = None) -> str:
    """What to do about the fixture at ``path`` whose files were edited after it was sealed
    (``fixture.check_seal``'s ``advice``): the ``fixture seal PATH --rebuild`` that re-seals it,
    or, where that command would refuse the fixture as it is (``check_reseal``), its refusal
    instead. ``archive``: the archive ``path`` was extracted from, named in place of ``path`` (a
    temporary folder, removed afterwards; an archive is re-sealed as a folder).
    """
    try:
        check_reseal(path, rebuild=True)
    except DriftToolError as e:
        if archive is None:
            return f"`{reseal_command(path)}` would refuse it as it is: {e}"
        return (f"`drifttool fixture seal --rebuild` would refuse its folder as it is: "
                f"{str(e).replace(str(path), str(archive))}")
    if archive is None:
        return f"if edited on purpose, `{reseal_command(path)}` re-seals it"
    return ("if edited on purpose, extract it, re-seal the fixture folder with `drifttool fixture seal "
            "--rebuild` and archive that again")


def rerun(fx: Fixture, out: Path, *, overwrite: bool = False) -> list[Path]:
    """Run ``fx`` (``fixture_spec``) into the artifact ``out``; returns the images it wrote.

    Raises:
        FixtureError: what ``check_rerun`` refuses, before anything runs.
        DriftToolError: the run's own refusals (a missing condition image, …), each message led
            by the fixture's ``fixture.json`` where it does not name it already (the user never
            typed the flag it may mention); a ``FixtureError`` about one of the fixture's files
            (its ``prompts.safetensors``) names that file.
    """
    check_rerun(fx)
    source = str(fx.path / "fixture.json")
    try:
        return _rerun(fx, out, overwrite=overwrite)
    except DriftToolError as e:
        if source not in str(e) and not isinstance(e, FixtureError):  # (which names its own file)
            e.args = (f"{source}: {e}",)
        raise


def _rerun(fx: Fixture, out: Path, *, overwrite: bool) -> list[Path]:
    kind = fixture_kind(fx)
    spec = fixture_spec(fx)
    if kind == "chain":
        from drifttool.chain import run_chain  # lazy: torch only once the seal holds

        chain = fx.meta["chain"]
        summary = run_chain(spec, out, prompts=chain["prompts"],
                            negative_prompts=chain.get("negative_prompts"), overwrite=overwrite)
        return [Path(p) for p in summary["images"]]
    if kind == "edit":
        from drifttool.chain_edit import run_edit  # lazy: torch only once the seal holds

        images = [fx.path / p for p in fx.edit["condition_images"]]  # its area and prompts: run_edit's
        return [Path(p) for p in run_edit(spec, out, condition_images=images, overwrite=overwrite)["images"]]
    from drifttool.runner import execute  # lazy: torch only once the seal holds

    execute(spec, out, overwrite=overwrite)
    return []


def expected_images(fx: Fixture, expected_manifest: dict[str, Any]) -> list[Path]:
    """The images a chain or edit fixture's expected run decoded (``chain.image_paths`` of
    ``expected/`` for the samples of its manifest); none for a trajectory fixture.

    Raises:
        FixtureError: an image the expected manifest lists is missing from the fixture.
    """
    section = expected_manifest.get(fixture_kind(fx)) if fixture_kind(fx) != "trajectory" else None
    if section is None:
        return []
    samples = expected_manifest.get("settings", {}).get("samples") or []
    out = fx.expected_dir
    paths = ([out.with_name(out.name + ".png")] if len(samples) == 1
             else [out.with_name(f"{out.name}-{s}.png") for s in samples])
    missing = [p.name for p in paths if not p.is_file()]
    if missing or len(section.get("images", [])) != len(paths):
        raise FixtureError(f"{fx.path}: the expected run's images are not all in the fixture "
                           f"(missing {', '.join(missing) or 'entries in expected/manifest.json'})")
    return paths


ENVIRONMENT_KEYS = ("cpu_capability", "aten_cpu_capability_env", "torch")
"""What production (non-strict) CPU bytes depend on, from the manifests' ``environment``."""


def environment_note(expected: dict[str, Any], replay: dict[str, Any]) -> str | None:
    """One line when a production fixture (mode auto or off) is re-run where its bytes need not
    hold: another CPU dispatch level, CPU matrix extensions (``cpu_matrix``) or torch version
    than the build's; else None. A build that recorded no ``cpu_matrix`` (before drifttool
    recorded it) is compared by its CPU model instead."""
    if expected.get("settings", {}).get("mode") not in ("auto", "off"):
        return None
    a, b = expected.get("environment", {}), replay.get("environment", {})
    keys = (*ENVIRONMENT_KEYS, "cpu_matrix" if "cpu_matrix" in a else "cpu")
    moved = [f"{k} {a.get(k)} → {b.get(k)}" for k in keys if a.get(k) != b.get(k)]
    if not moved:
        return None
    return ("this fixture runs production arithmetic, whose bytes hold only where it was built "
            "(the same CPU dispatch level, CPU matrix extensions and torch), and here "
            + ", ".join(moved) + ": a drift is expected here and is no regression")


def _sha256(p: Path) -> str | None:
    return hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None


REPLAY = "replay"
"""The folder of ``--workdir`` the re-run is written to (a chain or edit fixture's decoded images
beside it: ``replay.png``, ``replay-<sample>.png``)."""
VERIFY_MARK = "fixture-verify.json"
"""The file ``fixture verify`` writes beside its re-run in ``--workdir`` once the re-run is done:
the fixture it re-ran, its content digest, and the SHA-256 of the re-run's ``manifest.json`` and
of each decoded image. An earlier re-run there is replaced only while those still match
(``check_workdir``): a run or image the user put there since is refused."""


def _replay_images(workdir: Path) -> list[Path]:
    """What in ``workdir`` a re-run's decoded images would be (``replay.png``, ``replay-N.png``),
    whatever they are now (a file, a folder, a link)."""
    return sorted(p for p in workdir.glob(f"{REPLAY}*.png") if p.name == f"{REPLAY}.png"
                  or p.name[len(REPLAY):-4].startswith("-") and p.name[len(REPLAY) + 1:-4].isdigit())


def _mark_of(workdir: Path) -> dict | None:
    """``workdir``'s ``VERIFY_MARK`` as written by ``_write_mark``; None when there is none.

    Raises:
        ArtifactError: a ``VERIFY_MARK`` that ``fixture verify`` did not write (not its JSON).
    """
    mark = workdir / VERIFY_MARK
    if not mark.exists() and not mark.is_symlink():
        return None
    try:
        if mark.is_symlink() or not mark.is_file():
            raise ValueError
        body = json.loads(mark.read_text())
        if not (isinstance(body, dict) and isinstance(body.get("manifest_sha256"), str)
                and isinstance(body.get("images"), dict)):
            raise ValueError
        return body
    except (ValueError, OSError, UnicodeDecodeError):
        raise ArtifactError(f"--workdir {workdir}: {mark} is not what `drifttool fixture verify` writes there; "
                            "give another --workdir, or move it away first") from None


def _write_mark(workdir: Path, fixture: str, digest: str, images: list[Path]) -> None:
    """Record the re-run just written in ``workdir`` (``VERIFY_MARK``)."""
    body = {"fixture": fixture, "content_digest": digest,
            "manifest_sha256": _sha256(workdir / REPLAY / MANIFEST),
            "images": {p.name: _sha256(p) for p in images if p.parent == workdir}}
    (workdir / VERIFY_MARK).write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")


def check_workdir(workdir: Path) -> None:
    """Refuse, before any work, a ``--workdir`` the re-run cannot be written to: a file, a
    drifttool artifact itself (a run directory holds its own files only), a folder inside a
    sealed fixture (the re-run's files would break its seal), or one where the re-run would
    replace what no earlier ``fixture verify`` wrote: ``replay`` as a link or a file, a
    ``replay`` folder or a ``replay*.png`` image other than those ``VERIFY_MARK`` records (a
    run or files of the user's), or a ``VERIFY_MARK`` of the user's.

    Raises:
        ArtifactError: naming ``--workdir``, what is in the way and what to do.
    """
    if workdir.exists() and not workdir.is_dir():
        raise ArtifactError(f"--workdir {workdir}: exists and is not a directory (the re-run is "
                            f"written to WORKDIR/{REPLAY})")
    if (workdir / MANIFEST).is_file():
        raise ArtifactError(f"--workdir {workdir} is a drifttool artifact; give a directory of its "
                            f"own (the re-run is written to WORKDIR/{REPLAY})")
    sealed = sealed_above(workdir)
    if sealed is not None:
        raise ArtifactError(f"--workdir {workdir}: inside the sealed fixture {sealed}, whose seal the "
                            "re-run's files would break; give a path outside it")
    if not workdir.is_dir():
        return
    mark = _mark_of(workdir)
    replay = workdir / REPLAY
    theirs = "that `drifttool fixture verify` did not write; give another --workdir, or move it away first"
    if replay.is_symlink() or (replay.exists() and not replay.is_dir()):
        raise ArtifactError(f"--workdir {workdir}: {replay}, where the re-run goes, is a "
                            f"{'link' if replay.is_symlink() else 'file'} {theirs}")
    if replay.is_dir() and any(replay.iterdir()):
        if mark is None or _sha256(replay / MANIFEST) != mark["manifest_sha256"]:
            what = "a drifttool run" if holds_run(replay) else "files"
            raise ArtifactError(f"--workdir {workdir}: {replay}, where the re-run goes, holds {what} {theirs}")
        if foreign_files(replay):
            raise ArtifactError(f"--workdir {workdir}: {replay}, where the re-run goes, also holds "
                                f"{', '.join(foreign_files(replay)[:5])} {theirs}")
    for image in _replay_images(workdir):
        if image.is_symlink() or mark is None or mark["images"].get(image.name) != _sha256(image):
            what = "link" if image.is_symlink() else "folder" if image.is_dir() else "file"
            raise ArtifactError(f"--workdir {workdir}: {image}, where a re-run's decoded image goes, "
                                f"is a {what} {theirs}")


def verify_fixture(name_or_path: str | Path | None = None, workdir: str | Path | None = None) -> VerifyResult:
    """Seal check, re-run with the fixture's settings (``rerun``), diff against ``expected/``,
    and the decoded images' SHA-256 against the fixture's.

    An archive is extracted into a temporary directory that is removed before this returns or
    raises (``drifttool.fixture.extracted``); so is the temporary ``workdir`` when anything
    raises (the caller owns it after a return).

    Raises:
        FixtureError: the seal does not match (tampered, missing or extra files, a symlink or a
            special file; edited files: the line ends with ``reseal_advice``, the ``fixture seal
            PATH --rebuild`` that re-seals the fixture or what it would refuse), or an archive
            cannot be extracted safely — nothing runs; a malformed ``chain``/``edit`` entry, a
            missing expected image, or settings its re-run refuses (``check_rerun``: a setting
            ``fixture.json`` lacks, …), before it runs.
        ArtifactError: the expected artifact cannot be read (before anything runs), or
            ``workdir`` is refused by ``check_workdir`` (the re-run goes to ``workdir/replay``, and
            replaces an earlier one only where ``fixture verify`` wrote it) or cannot be made.
    """
    if workdir is not None:
        check_workdir(Path(workdir))
        try:  # before the seal is checked: the re-run's folder names --workdir, not the fixture
            Path(workdir).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ArtifactError(f"--workdir {workdir}: cannot create it ({e.strerror or e})") from None
    source = DEFAULT_FIXTURE if name_or_path is None else name_or_path
    archive = Path(source) if Path(source).is_file() else None
    with extracted(source) as path:
        try:  # before anything in the fixture is read
            digest = check_seal(path, advice=lambda: reseal_advice(path, archive=archive))
        except FixtureError as e:
            if archive is not None:  # named by the archive, not its temporary folder
                e.args = (str(e).replace(str(path), str(archive)),)
            raise
        fx = load_fixture(path)
        expected = open_run(fx.expected_dir)  # a damaged expected artifact: refused before the run
        want = expected_images(fx, expected.manifest)
        want_sha = [_sha256(p) for p in want]  # read now: an archive's folder goes away
        work = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="drifttool-verify-"))
        try:
            run_dir = work / REPLAY
            got = rerun(fx, run_dir, overwrite=True)
            if workdir:  # what lets the next verify replace this re-run (check_workdir)
                _write_mark(work, fx.name, digest, got)
            replay = open_run(run_dir)
            report = diff_runs(expected, replay)
            note = environment_note(expected.manifest, replay.manifest)
        except BaseException:
            if not workdir:
                shutil.rmtree(work, ignore_errors=True)
            raise
    images = [ImageCheck(expected=w.name, replay=str(g), expected_sha256=ws, replay_sha256=_sha256(g))
              for w, ws, g in zip(want, want_sha, got)]
    images += [ImageCheck(expected=w.name, replay="", expected_sha256=ws, replay_sha256=None)
               for w, ws in zip(want[len(got):], want_sha[len(got):])]
    return VerifyResult(fixture=fx.name, content_digest=digest, run_dir=run_dir, report=report,
                        images=images, note=note)
