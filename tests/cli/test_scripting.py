"""Scripting the CLI: exit codes documented in every command's --help, typer's shell
completion, piped tables that never cut identifiers, the probe matrix's progress bar."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
from rich.console import Console

from drifttool.exit_codes import EXIT_HELP
from tests.cli.scripting import invoke

COMMANDS = [["run"], ["diff"], ["trace"], ["probe"], ["overlay"], ["replay"], ["recompute"],
            ["report"], ["fixture", "verify"], ["fixture", "seal"], ["experiment", "train-rollout"],
            ["experiment", "grpo"], []]
_MAIN = "import sys; sys.argv[0] = 'drifttool'; from drifttool.cli.app import main; main()"
"""The console script's entry point, as ``drifttool`` (completion reads its name)."""


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "drifttool")
def test_every_help_documents_the_exit_codes(command):
    res = invoke(*command, "--help", env={"COLUMNS": "400"})
    assert res.exit_code == 0
    assert EXIT_HELP in " ".join(res.output.replace("│", " ").split()), res.output[-800:]


def test_shell_completion_is_typers():
    res = invoke("--help", env={"COLUMNS": "400"})
    assert "--install-completion" in res.output and "--show-completion" in res.output
    env = {**os.environ, "_DRIFTTOOL_COMPLETE": "complete_bash", "COMP_WORDS": "drifttool di",
           "COMP_CWORD": "1"}
    r = subprocess.run([sys.executable, "-c", _MAIN], env=env, capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["diff"], r.stdout + r.stderr


def test_piped_trace_never_cuts_an_operator_name(strict_run):
    r = subprocess.run([sys.executable, "-c", _MAIN, "trace",
                        str(strict_run)], capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if k != "COLUMNS"})
    assert r.returncode == 0, r.stderr
    assert "…" not in r.stdout
    for name in ("latent_proj_gemm", "txt_in_rmsnorm_linear", "timestep_embed_mlp"):
        assert f" {name} " in r.stdout


def test_probe_matrix_progress_bar_shows_done_total_and_time_left():
    from drifttool.cli._console import advance, matrix_progress

    buf = io.StringIO()
    on = Console(file=buf, force_terminal=True, force_interactive=True, width=160)
    with matrix_progress(12, "probe matrix", on) as bar:
        for name in ("repeat", "gelu_exact", "batch_split"):
            advance(bar, type("R", (), {"name": name, "status": "PASS"})())
        bar.refresh()
        text = buf.getvalue()
    assert "probe matrix" in text and "3/12" in text and "probes" in text
    assert "left" in text and "batch_split PASS" in text
    off = matrix_progress(2, "probe matrix", Console(file=io.StringIO(), force_terminal=False))
    assert off.disable
