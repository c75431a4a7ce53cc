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


def test_a_bug_still_shows_its_traceback(capsys):
    with pytest.raises(typer.Exit) as info:
        _command(ZeroDivisionError("a bug"))()
    assert info.value.exit_code == 2 and "internal error" in capsys.readouterr().err
