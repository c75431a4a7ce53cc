"""Inputs a newcomer gave that were read as something else: an empty path as the current folder,
an empty fixture name as the default fixture, a batch of 2**31 samples filling the host's memory
before the memory check could weigh it. Each is one ``error:`` line and exit 2."""

from __future__ import annotations

import pytest

from drifttool import memory
from drifttool.chain import default_pipeline
from drifttool.model.checkpoint import read_config
from drifttool.settings import RunSpec, resolve


@pytest.mark.parametrize("argv", [("diff", "", "x"), ("diff", "x", ""), ("report", "", "x"),
                                  ("replay", ""), ("recompute", ""), ("trace", ""),
                                  ("fixture", "seal", ""), ("overlay", "x", ""),
                                  ("run", "--checkpoint", "")])
def test_an_empty_path_is_refused(cli, argv, tmp_path):
    code, out = cli(*argv, *(("-o", tmp_path / "r") if argv[0] == "run" else ()))
    assert code == 2 and "empty path" in out and "Traceback" not in out, out


@pytest.mark.parametrize("argv", [("run", "--fixture", ""), ("fixture", "verify", "")])
def test_an_empty_fixture_name_is_refused(cli, argv, tmp_path):
    code, out = cli(*argv, *(("-o", tmp_path / "r") if argv[0] == "run" else ()))
    assert code == 2 and "empty fixture name" in out and "tiny-t2i" in out, out


def test_a_batch_past_what_one_run_takes_is_refused_before_its_samples_are_listed(cli, tmp_path):
    code, out = cli("run", "--batch", "2147483647", "--capture", "L0", "-o", tmp_path / "r")
    assert code == 2 and "--batch 2147483647" in out and "at most 1,048,576" in out, out
    assert not (tmp_path / "r").exists()


def test_the_memory_refusal_names_the_samples(monkeypatch):
    _, s = resolve(RunSpec(batch=3))
    monkeypatch.setattr(memory, "available_bytes", lambda device: 1)
    with pytest.raises(Exception, match=r"^3 samples at --height \d+ --width \d+: the run needs"):
        memory.check_memory(s, read_config(default_pipeline()))


def test_summary_tables_show_words_not_python_reprs(cli, tmp_path):
    """``run`` and ``replay``'s summaries: ``complete yes``, ``samples 0, 1``, ``img_grid 4, 6``
    (they showed ``True``, ``[0, 1]`` and ``[4, 6]``)."""
    code, out = cli("run", "--capture", "L0", "--steps", "2", "-o", tmp_path / "a")
    assert code == 0, out
    code, rep = cli("replay", tmp_path / "a", "-o", tmp_path / "b")
    assert code == 0, rep
    for text in (out, rep):
        cells = [" ".join(line.replace("│", " ").split()) for line in text.splitlines()]
        assert "complete yes" in cells and "img_grid 4, 6" in cells, text
        assert "True" not in text and "[" not in text.replace("[bold", ""), text
    assert "samples 0, 1" in [" ".join(line.replace("│", " ").split()) for line in out.splitlines()], out
