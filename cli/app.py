"""The ``drifttool`` command: one module per subcommand, listed here.

    drifttool run -o runs/a                   # strict run of the embedded default
    drifttool run --mode auto -o runs/b
    drifttool diff runs/a runs/b              # exit 0 identical, 1 drift, 2 error/incomparable
    drifttool fixture verify                  # re-run the sealed default and check its digests
    drifttool trace runs/a                    # the operator trace

User errors (``DriftToolError``, a usage error such as a bad option value, a file-system error
on a path the user named) print one ``error:`` line and exit 2, without a traceback. An internal
error (a bug) prints its traceback and also exits 2, so that exit 1 always means "drift".
"""

from __future__ import annotations

import errno
import functools
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

import typer
from typer.core import TyperGroup

import drifttool
from drifttool.cli._console import err, error_line, silence_stdout
from drifttool.errors import DriftToolError

# click's exceptions as typer raises them (typer >= 0.2x vendors click as ``typer._click``)
_click_errors = sys.modules[typer.BadParameter.__module__]
_NO_ARGS_IS_HELP = getattr(_click_errors, "NoArgsIsHelpError", ())  # click >= 8.2


class _Group(TyperGroup):
    """The ``drifttool`` group: click/typer usage errors (bad or missing option, unknown command)
    as one ``error:`` line naming the command's ``--help``, exit 2, instead of typer's boxed
    usage text; ``--help``, ``--version`` and a bare group's help behave as usual."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except _NO_ARGS_IS_HELP:  # the help was printed when the error was built
            code = 2
        except _click_errors.ClickException as e:
            ctx = getattr(e, "ctx", None)
            hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
            error_line(f"{e.format_message()}{hint}")
            code = 2  # never 1, which means "drift"
        except typer.Abort:
            err.print("[bold red]interrupted[/]")
            code = 2
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(
    name="drifttool",
    cls=_Group,
    help="Byte-level train-rollout consistency checks and drift forensics for the Qwen-Image MMDiT.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _os_error(e: OSError) -> str:
    """One line for a file-system error on a path the user named; a regular file where a
    directory is needed (``-o afile/sub``) is named as such."""
    path = Path(os.fsdecode(e.filename))
    if e.errno in (errno.ENOTDIR, errno.EEXIST):
        for p in (path, *path.parents):
            if p.exists() and not p.is_dir():
                return f"{p} exists and is not a directory" + (f" (writing {path})" if p != path else "")
    where = path if e.filename2 is None else f"{path} -> {os.fsdecode(e.filename2)}"
    return f"{where}: {e.strerror or e}"


def user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Exit codes for a command: ``DriftToolError``, an ``OSError`` on a named path (not a
    directory, permission denied, name too long, disk full) and Ctrl-C → one line, exit 2; any
    other exception (a bug) → its traceback plus a line saying so, exit 2 (never 1, which means
    drift); a closed stdout (``| head``) keeps the command's own exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except DriftToolError as e:
            error_line(str(e))
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            err.print("[bold red]interrupted[/]")
            raise typer.Exit(2) from None
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except BrokenPipeError:
            silence_stdout()
            raise typer.Exit(2) from None
        except Exception as e:  # noqa: BLE001 - a bug: show it, but keep exit 1 meaning "drift"
            if hasattr(e, "show") and hasattr(e, "exit_code"):  # click/typer usage errors
                raise
            if isinstance(e, OSError) and isinstance(e.filename, (str, bytes, os.PathLike)):
                # the file system (a path the user named), not a bug
                error_line(_os_error(e))
                raise typer.Exit(2) from None
            traceback.print_exc()
            err.print("[bold red]internal error[/] (a drifttool bug, please report it with the "
                      "traceback above)")
            raise typer.Exit(2) from None

    return wrapper


def _version(value: bool) -> None:
    if value:
        typer.echo(f"drifttool {drifttool.__version__}")
        raise typer.Exit(0)


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """Byte-level train-rollout consistency checks and drift forensics for the Qwen-Image MMDiT."""


def _register() -> None:
    from drifttool.cli import diff, fixture, run, trace

    app.command("run")(user_errors(run.run))
    app.command("diff")(user_errors(diff.diff))
    app.command("trace")(user_errors(trace.trace))
    app.add_typer(fixture.app, name="fixture")
    from drifttool.cli.probe import register; register(app, user_errors)  # noqa: E702 probe, overlay
    from drifttool.cli.train import register as register_train; register_train(app, user_errors)  # noqa: E702 replay, recompute, experiment


_register()


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
