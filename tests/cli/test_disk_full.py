"""A full disk (or another file-system error of a write) is the machine's state, not a bug: one
``error: PATH: reason`` line, exit 2, never ``internal error``. ``/dev/full`` answers every write
with ENOSPC, as a full disk does."""

import errno
import os
import shutil
from pathlib import Path

import pytest
import typer

from drifttool.cli._errors import user_errors
from tests.cli.scripting import invoke

FULL = Path("/dev/full")
needs_full = pytest.mark.skipif(not FULL.exists(), reason="no /dev/full here")


@pytest.fixture
def runs(strict_run, tmp_path):
    b = tmp_path / "b"
    shutil.copytree(strict_run, b)
    return strict_run, b


def _one_line(res, path):
    assert res.exit_code == 2, res.output
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}:"), res.stderr
    assert "No space left on device" in lines[0] and "internal error" not in res.output


@needs_full
def test_a_full_disk_under_junit_is_one_line(runs):
    a, b = runs
    _one_line(invoke("diff", a, b, "--junit", FULL), FULL)


@needs_full
@pytest.mark.parametrize("command,name", [("report", "r.html"), ("overlay", "f.png")])
def test_a_full_disk_under_a_report_or_figure_is_one_line(runs, tmp_path, command, name):
    a, b = runs
    link = tmp_path / name
    link.symlink_to(FULL)
    _one_line(invoke(command, a, b, "-o", link), link)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EIO])
def test_a_write_error_naming_no_file_is_one_line_not_a_bug(code, capsys):
    def fn():
        raise OSError(code, os.strerror(code))  # as a buffered write's flush raises it
    with pytest.raises(typer.Exit) as info:
        user_errors(fn, command="run")()
    err = capsys.readouterr().err
    assert info.value.exit_code == 2 and os.strerror(code) in err, err
    assert "internal error" not in err


def test_writing_names_the_path_of_a_nameless_write_error(tmp_path):
    from drifttool.errors import writing

    with pytest.raises(OSError) as info:
        with writing(tmp_path / "x.bin"):
            raise OSError(errno.ENOSPC, "No space left on device")
    assert info.value.filename == str(tmp_path / "x.bin") and info.value.errno == errno.ENOSPC
