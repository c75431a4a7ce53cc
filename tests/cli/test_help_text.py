"""Help and usage text: arguments in capitals (``RUN_A RUN_B``) in usage lines and errors, each
command's line in the group's list unbroken, and an unknown option offered only options alike."""

from __future__ import annotations

import pytest
import typer

from tests.cli.scripting import invoke

WIDE = {"COLUMNS": "400"}


@pytest.mark.parametrize("command, arguments", [
    (["diff"], "RUN_A RUN_B"), (["report"], "RUN_A RUN_B"), (["trace"], "RUN_DIR"),
    (["replay"], "RUN_DIR"), (["recompute"], "RUN_DIR"), (["overlay"], "RUN_A RUN_B..."),
    (["fixture", "verify"], "[NAME|DIR|TAR]"), (["fixture", "seal"], "DIR"),
], ids=lambda c: "-".join(c) if isinstance(c, list) else "")
def test_usage_names_arguments_in_capitals(command, arguments):
    res = invoke(*command, "--help", env=WIDE)
    assert res.exit_code == 0
    usage = next(ln.strip() for ln in res.output.splitlines() if "Usage:" in ln)
    assert usage == f"Usage: drifttool {' '.join(command)} [OPTIONS] {arguments}"


def test_a_missing_argument_is_named_in_capitals():
    res = invoke("diff", "runs/a")
    assert res.exit_code == 2
    assert res.stderr.strip() == "error: Missing argument 'RUN_B'. (see 'drifttool diff --help')"


@pytest.mark.parametrize("name, ends", [
    ("trace", "in and after the model, then the sampler)."),
    ("overlay", "against the baseline RUN_A on one figure (RFC qwenimage_ablation_overlay)."),
])
def test_each_commands_line_in_the_group_help_is_unbroken(name, ends):
    res = invoke("--help", env=WIDE)
    rows = [ln for ln in res.output.splitlines() if ln.lstrip("│ ").startswith(f"{name} ")]
    assert len(rows) == 1 and ends in rows[0], rows


def test_an_unknown_option_is_offered_only_alike_options():
    res = invoke("run", "--bogus")
    assert res.exit_code == 2
    assert res.stderr.strip() == "error: No such option: --bogus (see 'drifttool run --help')"
    res = invoke("run", "--mdoe", "auto")
    assert "No such option: --mdoe (Possible options: --mode)" in res.stderr


@pytest.mark.parametrize("command", ["run", "replay", "probe"])
def test_help_on_a_pipe_keeps_option_names_whole_at_80_columns(command):
    """``--help`` piped into a CI log (``COLUMNS=80``): no option name or help text cut with an
    ellipsis (typer's help console gets the pipe width)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "COLUMNS": "80"}
    env.pop("TERMINAL_WIDTH", None)
    out = subprocess.run([sys.executable, "-m", "drifttool.cli.app", command, "--help"], env=env,
                         capture_output=True, text=True, timeout=120).stdout
    assert "…" not in out, [line for line in out.splitlines() if "…" in line][:3]
    assert "--overwrite" in out


@pytest.mark.parametrize("columns", [40, 60, 80])
@pytest.mark.parametrize("command", [[], ["run"], ["recompute"], ["replay"], ["probe"], ["diff"], ["report"],
                                     ["fixture"], ["fixture", "verify"], ["experiment"], ["experiment", "grpo"]],
                         ids=lambda c: "-".join(c) or "group")
def test_help_on_a_narrow_terminal_cuts_no_name(command, columns):
    """A help page typer's tables would cut (``--negative-pro…`` for two options at 80 columns)
    prints as click's plain help: no ``…``, every option and command named whole; a wide terminal
    keeps typer's page (its boxes)."""
    from drifttool.cli.app import app

    res = invoke(*command, "--help", env={"COLUMNS": str(columns)})
    wide = invoke(*command, "--help", env={"COLUMNS": "400"}).output
    assert res.exit_code == 0 and "…" not in res.output, res.output
    group = typer.main.get_command(app)
    cmd = group
    for name in command:
        cmd = cmd.commands[name] if hasattr(cmd, "commands") else cmd
    names = [o for p in cmd.params for o in (*p.opts, *p.secondary_opts) if o.startswith("--")]
    names += list(getattr(cmd, "commands", {}))
    words = set(res.output.replace(",", " ").replace("/", " ").split())
    assert names and all(n in words for n in names), [n for n in names if n not in words]
    assert "╭" in wide
