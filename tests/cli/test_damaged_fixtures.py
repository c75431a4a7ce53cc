"""Damaged fixtures and archives (issue #8 item 3): ``fixture verify`` and ``fixture seal`` exit 2
with one clear line, never a traceback; the seal covers regular files only; an archive's
extraction directory is removed from ``$TMPDIR`` on success and on failure."""

from __future__ import annotations

import io
import os
import shutil
import tarfile
import tempfile

import pytest

from drifttool.fixture import locate


def _one_clean_line(code, out, *needles):
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert code == 2, out
    assert "Traceback" not in out and "internal error" not in out, out
    assert len(lines) == 1 and lines[0].startswith("error:"), out
    for n in needles:
        assert n in out, out


@pytest.fixture
def fx(tmp_path):
    """A writable copy of the sealed default fixture."""
    out = tmp_path / "fx"
    shutil.copytree(locate("tiny-t2i"), out, ignore=shutil.ignore_patterns("__pycache__"))
    return out


@pytest.fixture
def tmpdir_(tmp_path, monkeypatch):
    """A fresh, empty ``$TMPDIR`` (and ``tempfile``'s cached copy of it)."""
    d = tmp_path / "TMPDIR"
    d.mkdir()
    monkeypatch.setenv("TMPDIR", str(d))
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


def _tar(src, dest, mode="w:gz"):
    with tarfile.open(dest, mode) as tar:
        tar.add(src, arcname="tiny-t2i")
    return dest


@pytest.mark.parametrize("victim", ["prompts.safetensors", "expected/steps.rank0.arrow",
                                    "transformer/config.json"])
def test_symlink_to_identical_bytes_fails_the_seal(cli, fx, tmp_path, victim):
    outside = tmp_path / "outside.bin"
    shutil.copyfile(fx / victim, outside)
    os.remove(fx / victim)
    os.symlink(outside, fx / victim)
    _one_clean_line(*cli("fixture", "verify", fx), "regular files only", victim)
    _one_clean_line(*cli("fixture", "seal", fx), "regular files only", victim)


def test_fifo_or_linked_folder_in_a_fixture_fails_the_seal(cli, fx, tmp_path):
    os.mkfifo(fx / "pipe")
    _one_clean_line(*cli("fixture", "verify", fx), "pipe")
    os.remove(fx / "pipe")
    shutil.move(fx / "transformer", tmp_path / "transformer")
    os.symlink(tmp_path / "transformer", fx / "transformer")
    _one_clean_line(*cli("fixture", "verify", fx), "transformer")


def _last_member_middle(arc) -> int:
    """Offset of the middle of the last regular member's data in an uncompressed tar."""
    with tarfile.open(arc) as tar:
        last = [m for m in tar.getmembers() if m.isfile()][-1]
    return last.offset_data + last.size // 2


@pytest.mark.parametrize("mode,cut", [("w:gz", 0.5), ("w:gz", 0.01), ("w", 0.5), ("w", "last")])
def test_truncated_archive_is_one_clean_line_and_leaves_no_temp_dir(cli, fx, tmp_path, tmpdir_,
                                                                  mode, cut):
    arc = _tar(fx, tmp_path / "fx.tar", mode)
    data = arc.read_bytes()
    arc.write_bytes(data[: _last_member_middle(arc) if cut == "last" else int(len(data) * cut)])
    _one_clean_line(*cli("fixture", "verify", arc), str(arc))
    assert list(tmpdir_.iterdir()) == []


def test_archive_with_a_link_member_is_refused_and_leaves_no_temp_dir(cli, tmp_path, tmpdir_):
    arc = tmp_path / "links.tar"
    with tarfile.open(arc, "w") as tar:
        data = b"{}"
        info = tarfile.TarInfo("fx/fixture.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("fx/prompts.safetensors")
        link.type, link.linkname = tarfile.SYMTYPE, "fixture.json"
        tar.addfile(link)
    _one_clean_line(*cli("fixture", "verify", arc), "links or special files", "prompts.safetensors")
    assert list(tmpdir_.iterdir()) == []


def test_an_archive_without_a_fixture_is_named_not_its_temp_dir(cli, tmp_path, tmpdir_):
    arc = tmp_path / "bad.tar.gz"
    (tmp_path / "afile").write_text("not a fixture")
    with tarfile.open(arc, "w:gz") as tar:
        tar.add(tmp_path / "afile", arcname="afile")
    code, out = cli("fixture", "verify", arc)
    _one_clean_line(code, out, f"{arc}: not a fixture archive")
    assert "drifttool-fixture-" not in out
    assert list(tmpdir_.iterdir()) == []


def test_tampered_archive_fails_and_leaves_no_temp_dir(cli, fx, tmp_path, tmpdir_):
    (fx / "fixture.json").write_text((fx / "fixture.json").read_text().replace("386", "387"))
    _one_clean_line(*cli("fixture", "verify", _tar(fx, tmp_path / "fx.tgz")), "modified fixture.json")
    assert list(tmpdir_.iterdir()) == []


@pytest.mark.parametrize("edit, advice", [
    (("386", "387"), "; if edited on purpose, extract it, re-seal the fixture folder with `drifttool "
     "fixture seal --rebuild` and archive that again"),
    (('"steps"', '"stepz"'), "; `drifttool fixture seal --rebuild` would refuse its folder as it is: "
     "{arc}/fixture.json: unknown key settings.stepz"),
], ids=["re-sealable", "refused"])
def test_a_tampered_archive_is_named_with_advice_for_an_archive(cli, fx, tmp_path, tmpdir_, edit, advice):
    """A tampered archive's seal failure names the archive, not the temporary folder it was
    extracted to (removed by then), and says how to re-seal it, or what `fixture seal --rebuild`
    would refuse about its folder: no command on a path that is gone."""
    (fx / "fixture.json").write_text((fx / "fixture.json").read_text().replace(*edit))  # same size
    arc = _tar(fx, tmp_path / "fx.tgz")
    code, out = cli("fixture", "verify", arc)
    _one_clean_line(code, out, f"error: {arc}: seal check failed: modified fixture.json" + advice.format(arc=arc))
    assert "drifttool-fixture-" not in out and str(tmpdir_) not in out, out
    assert list(tmpdir_.iterdir()) == []


def test_verified_archive_leaves_no_temp_dir(cli, fx, tmp_path, tmpdir_):
    code, out = cli("fixture", "verify", _tar(fx, tmp_path / "fx.tar.gz"))
    assert code == 0 and "seal ok" in out and "IDENTICAL" in out, out
    assert list(tmpdir_.iterdir()) == []


@pytest.mark.parametrize("seal", [
    "[" * 100_000 + "]" * 100_000,
    '{"algorithm": "xxh3_128", "content_digest": "x", "files": ["fixture.json"]}',
    '{"algorithm": "xxh3_128", "content_digest": "x", "files": {"fixture.json": 5}}',
    '{"algorithm": "xxh3_128", "content_digest": 7, "files": {}}',
    '["xxh3_128"]',
    '{"algorithm": "xxh3_128", "files": {"fixture.json": "' + "9" * 5000 + '"}, "content_digest": ' + "9" * 5000 + "}",
])
def test_hostile_seal_json_is_one_clean_line(cli, fx, seal):
    (fx / "seal.json").write_text(seal)
    _one_clean_line(*cli("fixture", "verify", fx), "seal.json")


def test_fifo_for_fixture_json_is_refused_before_it_is_opened(cli, fx):
    os.remove(fx / "fixture.json")
    os.mkfifo(fx / "fixture.json")
    _one_clean_line(*cli("fixture", "verify", fx), "fixture.json")


def test_seal_of_a_missing_directory_or_a_file_is_one_clean_line(cli, tmp_path):
    (tmp_path / "afile").write_text("x")
    for target, needle in ((tmp_path / "nope", "no such directory"), (tmp_path / "afile", "not a fixture directory")):
        _one_clean_line(*cli("fixture", "seal", target), needle)
    assert not (tmp_path / "nope").exists()


def test_seal_refuses_a_run_directory_and_writes_nothing(cli, tmp_path):
    """``fixture seal`` on a run directory (no fixture.json) would add a file the run's manifest
    does not list and break every later diff: refused, one line, nothing written."""
    from drifttool.runner import execute
    from drifttool.settings import RunSpec

    run = tmp_path / "run"
    execute(RunSpec(steps=2, samples=[0], capture="L0"), run)
    before = sorted(p.name for p in run.iterdir())
    code, out = cli("fixture", "seal", run)
    assert code == 2 and "not a fixture directory (no fixture.json)" in out and len(out.strip().splitlines()) == 1
    assert sorted(p.name for p in run.iterdir()) == before
    assert cli("diff", run, run)[0] == 0


def test_a_member_declaring_another_size_is_refused_before_extraction_or_hashing(
        cli, fx, tmp_path, tmpdir_, monkeypatch):
    """A sealed file replaced by a sparse member of 10 GiB (GNU tar --sparse, a few KiB on disk):
    refused from the headers, with nothing extracted and no byte hashed."""
    import subprocess

    import drifttool.fixture as F

    if shutil.which("tar") is None or "GNU" not in subprocess.run(
            ["tar", "--version"], capture_output=True, text=True).stdout:
        pytest.skip("needs GNU tar to write a sparse member")
    src = tmp_path / "src" / "tiny-t2i"
    shutil.copytree(fx, src)
    with open(src / "prompts.safetensors", "r+b") as f:
        f.truncate(10 << 30)  # sparse: no data blocks
    arc = tmp_path / "big.tar"
    subprocess.run(["tar", "--sparse", "-cf", str(arc), "-C", str(src.parent), "tiny-t2i"],
                   check=True)
    assert arc.stat().st_size < 10 << 20
    monkeypatch.setattr(F, "_digest_file", lambda p: pytest.fail(f"hashed {p}"))
    _one_clean_line(*cli("fixture", "verify", arc), "size differs", "prompts.safetensors",
                    "10737418240 bytes")
    assert list(tmpdir_.iterdir()) == []


def test_a_file_of_another_size_is_refused_before_it_is_hashed(cli, fx, monkeypatch):
    import drifttool.fixture as F

    with open(fx / "prompts.safetensors", "r+b") as f:
        f.truncate(10 << 30)  # sparse: 10 GiB of zeros on disk for free
    real = F._digest_file
    monkeypatch.setattr(F, "_digest_file", lambda p: pytest.fail(f"hashed {p}")
                        if p.name == "prompts.safetensors" else real(p))
    _one_clean_line(*cli("fixture", "verify", fx), "modified prompts.safetensors (size 10737418240")


@pytest.mark.parametrize("as_json", [False, True])
def test_verify_shows_only_paths_that_still_exist(cli, fx, tmp_path, tmpdir_, as_json):
    """The re-run and an archive's extracted ``expected/`` are removed before the user reads the
    report: it names them as removed (``null`` in ``--json``), never by a path that is gone."""
    import json
    import re

    arc = _tar(fx, tmp_path / "fx.tar.gz")
    code, out = cli("fixture", "verify", arc, *(["--json"] if as_json else []))
    assert code == 0, out
    assert list(tmpdir_.iterdir()) == []  # the extraction and the re-run are gone
    if as_json:
        report = json.loads(out)["report"]
        assert report["run_a"] is None and report["run_b"] is None, out
        return
    assert str(tmpdir_) not in out, out
    assert re.search(r"^A: expected/ of .*fx\.tar\.gz \(.*removed\)$", out, re.M), out
    assert re.search(r"^B: .*re-run \(removed; --workdir DIR keeps it\)$", out, re.M), out


@pytest.mark.parametrize("victim, refusal", [
    ("transformer/config.json", "transformer: no config.json"),
    ("transformer/diffusion_pytorch_model.safetensors", "transformer: no .safetensors weights"),
])
def test_a_fixture_without_its_model_files_is_not_offered_a_rebuild(cli, fx, victim, refusal):
    """``fixture verify`` on a fixture whose model files were deleted says what ``fixture seal
    --rebuild`` refuses, not that it re-seals it; and ``--rebuild`` refuses it so."""
    os.remove(fx / victim)
    _one_clean_line(*cli("fixture", "verify", fx), f"missing {victim}", "would refuse it as it is", refusal)
    _one_clean_line(*cli("fixture", "seal", fx, "--rebuild"), refusal)


@pytest.mark.parametrize("victim, refusal", [
    ("expected/manifest.json", "no expected artifact (expected/manifest.json)"),
    ("expected/ops.rank0.arrow", "complete run lacks ops.rank0.arrow; not sealed"),
])
def test_seal_of_a_damaged_expected_artifact_names_the_rebuild_that_remakes_it(cli, fx, victim, refusal):
    """``fixture seal`` refuses a fixture whose expected artifact lost a file in one line that
    names the command re-making it, with the fixture's path (it lacked the path, or any hint)."""
    os.remove(fx / victim)
    _one_clean_line(*cli("fixture", "seal", fx), refusal, f"`drifttool fixture seal {fx} --rebuild`")
