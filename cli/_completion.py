"""Shell completion: the shell ``--show-completion``/``--install-completion`` are for, and the
values the options complete to.

    drifttool --show-completion zsh         # typer's zsh script (the shell named, not detected)
    drifttool --install-completion fish     # typer's installer, for fish
    drifttool run --mode <TAB>              # strict audit auto off

typer (0.28) makes both options flags that detect the running shell (shellingham) and leaves a
shell named after them to be read as a command; ``shell_named`` takes that name off the command
line and hands it to typer's own callbacks, which take a shell name in place of detection. The
completers import nothing heavy (completion runs ``drifttool`` on every TAB): their values come
from the torch-free manifest schema, the packaged fixtures' folder and the shipped tolerance
profiles' folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import typer
from typer._completion_shared import Shells

import drifttool

SHELLS = tuple(s.value for s in Shells)
"""The shells typer writes completion scripts for."""
_OPTIONS = {"--show-completion": "show_completion", "--install-completion": "install_completion"}
"""The group's completion options (typer's) and their parameter names."""


def shell_named(args: list[str], params: list[Any]) -> list[str]:
    """``args`` with the shell named after ``--show-completion`` or ``--install-completion``
    (``--show-completion zsh`` or ``--show-completion=zsh``, before any command) taken off, and
    that option's parameter among ``params`` made to pass the shell to typer's callback (which
    then writes that shell's script instead of the detected shell's). Without a shell name the
    option detects the shell, as typer does.

    Raises:
        typer.BadParameter: the word after the option is no shell typer supports (``SHELLS``).
    """
    for i, arg in enumerate(args):
        if not arg.startswith("-"):
            return args  # a command: its own options follow
        option, eq, shell = arg.partition("=")
        if option not in _OPTIONS:
            continue
        if not eq:
            if i + 1 == len(args) or args[i + 1].startswith("-"):
                return args  # no shell named: typer detects it
            shell = args[i + 1]
        if shell not in SHELLS:
            raise typer.BadParameter(f"unsupported shell {shell!r} (one of {', '.join(SHELLS)})",
                                     param_hint=f"'{option}'")
        for p in params:
            if p.name == _OPTIONS[option] and p.callback is not None:
                p.callback = _with_shell(p.callback, shell)
        return [*args[:i], option, *args[i + 1 + (not eq):]]
    return args


def _with_shell(callback: Callable[..., Any], shell: str) -> Callable[..., Any]:
    """typer's completion callback, given ``shell`` (a name) in place of the flag's True."""
    def given(ctx: Any, param: Any, value: Any) -> Any:
        return callback(ctx, param, shell if value else value)
    return given


def completion_help(params: list[Any]) -> None:
    """Say in the completion options' help that a shell may be named after them."""
    for p in params:
        if p.name in _OPTIONS.values():
            verb = "Show" if p.name == "show_completion" else "Install"
            p.help = (f"{verb} completion for the current shell, or for the shell named after it "
                      f"({', '.join(SHELLS)}).")


def _starting(values: tuple[str, ...]) -> Callable[[str], list[str]]:
    def complete(incomplete: str) -> list[str]:
        return [v for v in values if v.startswith(incomplete)]
    return complete


def _schema(name: str) -> tuple[str, ...]:
    from drifttool.artifact import manifest_schema  # lazy: only when completing

    return tuple(getattr(manifest_schema, name))


def modes(incomplete: str) -> list[str]:
    """``--mode`` values: strict, audit, auto, off."""
    return _starting(_schema("MODES"))(incomplete)


def levels(incomplete: str) -> list[str]:
    """``--capture`` values: the capture levels."""
    from drifttool.artifact.levels import LEVELS  # lazy: only when completing

    return _starting(tuple(LEVELS))(incomplete)


def presets(incomplete: str) -> list[str]:
    """``--preset`` values of ``run``."""
    return _starting(_schema("PRESETS"))(incomplete)


def dtypes(incomplete: str) -> list[str]:
    """``--dtype`` values: the model dtypes."""
    return _starting(_schema("MODEL_DTYPES"))(incomplete)


def cfg_layouts(incomplete: str) -> list[str]:
    """``--cfg-layout`` values."""
    return _starting(_schema("CFG_LAYOUTS"))(incomplete)


devices = _starting(("cpu", "cuda"))
"""``--device`` values (``cuda:N`` is typed out)."""


def fixtures(incomplete: str) -> list[str]:
    """Names of the packaged fixtures (a directory or archive is completed by the shell)."""
    from drifttool.fixture import packaged_fixtures  # lazy: only when completing

    names = sorted(d.name for d in packaged_fixtures().iterdir() if (d / "fixture.json").is_file())
    return _starting(tuple(names))(incomplete)


def tolerance_profile_names() -> tuple[str, ...]:
    """The shipped tolerance profiles' names (``drifttool.diff.tolerance.available``), read from
    their folder without importing the diff package."""
    folder = Path(drifttool.__file__).parent / "diff" / "profiles"
    return tuple(sorted(p.stem for p in folder.glob("*.json")))


def tolerance_profiles(incomplete: str) -> list[str]:
    """``--tolerance`` values: the shipped profiles (a profile file is completed by the shell)."""
    return _starting(tolerance_profile_names())(incomplete)
