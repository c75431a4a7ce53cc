"""Shell completion through the installed console script: ``--show-completion SHELL`` and
``--install-completion SHELL`` write the named shell's script (typer's), not the detected
shell's; an unknown shell is one error line; option values and fixture names complete."""

from __future__ import annotations

import os
import subprocess

import pytest

from drifttool.fixture import packaged_fixtures
from tests.cli.scripting import console_script


def _drifttool(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([console_script(), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def test_show_completion_writes_the_named_shells_script():
    scripts = {}
    for shell in ("bash", "zsh", "fish"):
        r = _drifttool("--show-completion", shell)
        assert r.returncode == 0 and not r.stderr, r.stderr
        scripts[shell] = r.stdout
    assert len(set(scripts.values())) == 3
    assert "_DRIFTTOOL_COMPLETE=complete_bash" in scripts["bash"]
    assert scripts["zsh"].startswith("#compdef drifttool") and "=complete_zsh" in scripts["zsh"]
    assert scripts["fish"].startswith("complete --command drifttool")
    assert "=complete_fish" in scripts["fish"]
    assert _drifttool("--show-completion=zsh").stdout == scripts["zsh"]


def test_install_completion_installs_for_the_named_shell(tmp_path):
    r = _drifttool("--install-completion", "fish", env={"HOME": str(tmp_path)})
    assert r.returncode == 0, r.stdout + r.stderr
    installed = tmp_path / ".config" / "fish" / "completions" / "drifttool.fish"
    assert "=complete_fish" in installed.read_text()
    assert not (tmp_path / ".bashrc").exists() and not (tmp_path / ".zshrc").exists()


def test_an_unknown_shell_is_one_error_line():
    r = _drifttool("--show-completion", "tcsh")
    assert r.returncode == 2 and not r.stdout
    assert r.stderr.strip().splitlines() == [
        "error: Invalid value for '--show-completion': unsupported shell 'tcsh' (one of bash, zsh, "
        "fish, powershell, pwsh)"]


def _complete(words: str) -> list[str]:
    """What bash completion offers for the last word of ``words`` (a trailing space: a new word)."""
    parts = words.split(" ")
    r = _drifttool(env={"_DRIFTTOOL_COMPLETE": "complete_bash", "COMP_WORDS": words,
                        "COMP_CWORD": str(len(parts) - 1)})
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


@pytest.mark.parametrize("words, offered", [
    ("drifttool run --mode ", ["strict", "audit", "auto", "off"]),
    ("drifttool run --mode a", ["audit", "auto"]),
    ("drifttool replay RUN --capture ", ["L0", "L1", "L2"]),
    ("drifttool run --device ", ["cpu", "cuda"]),
    ("drifttool run --preset diffusers-e", ["diffusers-edit", "diffusers-edit-plus"]),
])
def test_option_values_complete(words, offered):
    assert _complete(words) == offered


def test_fixture_names_complete():
    names = sorted(d.name for d in packaged_fixtures().iterdir() if (d / "fixture.json").is_file())
    assert "tiny-t2i" in names and len(names) >= 3
    assert _complete("drifttool fixture verify ") == names
    assert _complete("drifttool run --fixture tiny-t2i-") == [n for n in names if n.startswith("tiny-t2i-")]


def test_tolerance_profiles_complete_and_are_named_in_the_help():
    """The shipped profiles (``tolerance.available``, read here without the diff package) complete
    after --tolerance and are named in diff's and report's help."""
    from drifttool.cli._completion import tolerance_profile_names
    from drifttool.diff.tolerance import available

    names = available()
    assert len(names) >= 2 and list(tolerance_profile_names()) == names
    assert _complete("drifttool diff A B --tolerance ") == names
    assert _complete("drifttool report A B -o r.html --tolerance strict-cuda1-vs-cpu-") == [
        n for n in names if n.startswith("strict-cuda1-vs-cpu-")]
    for cmd in ("diff", "report"):
        r = _drifttool(cmd, "--help", env={"COLUMNS": "400"})
        flat = " ".join(r.stdout.replace("│", " ").split())  # the help box's wrapped lines joined
        assert r.returncode == 0 and f"a shipped one: {', '.join(names)};" in flat, r.stdout
