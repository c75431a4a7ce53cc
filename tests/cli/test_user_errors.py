"""Exit codes of the command wrapper: running out of memory is one line, not a bug's traceback."""

import pytest
import torch
import typer

from drifttool.cli._errors import user_errors


def _command(exc: BaseException):
    def fn():
        raise exc
    return user_errors(fn, command="run")


@pytest.mark.parametrize("exc,where", [
    (MemoryError("Unable to allocate 4.66 TiB for an array"), "host"),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB"), "device"),
])
def test_out_of_memory_is_one_line(exc, where, capsys):
    with pytest.raises(typer.Exit) as info:
        _command(exc)()
    assert info.value.exit_code == 2
    err = capsys.readouterr().err
    assert f"out of {where} memory" in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if line.strip()]) <= 2  # one line, maybe wrapped


def test_a_bug_is_one_line_and_exit_4(capsys, monkeypatch):
    monkeypatch.delenv("DRIFTTOOL_DEBUG", raising=False)
    with pytest.raises(typer.Exit) as info:
        _command(ZeroDivisionError("a bug"))()
    err = capsys.readouterr().err
    assert info.value.exit_code == 4 and "internal error: ZeroDivisionError: a bug" in err, err
    assert "Traceback" not in err and len([x for x in err.splitlines() if x.strip()]) <= 2, err


def test_drifttool_debug_shows_a_bugs_traceback(capsys, monkeypatch):
    monkeypatch.setenv("DRIFTTOOL_DEBUG", "1")
    with pytest.raises(typer.Exit) as info:
        _command(ZeroDivisionError("a bug"))()
    err = capsys.readouterr().err
    assert info.value.exit_code == 4 and "Traceback" in err and "internal error" in err, err
