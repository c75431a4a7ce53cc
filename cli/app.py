"""The ``drifttool`` command: one module per subcommand, listed here.

    drifttool run -o runs/a                   # strict run of the embedded default
    drifttool run --mode auto -o runs/b
    drifttool diff runs/a runs/b              # exit 0 identical, 1 drift, 2 error/incomparable
    drifttool fixture verify                  # re-run the sealed default and check its digests
    drifttool trace runs/a                    # the operator trace

User errors (``DriftToolError``) print one line and exit 2, without a traceback. An internal
error (a bug) prints its traceback and also exits 2, so that exit 1 always means "drift".
"""

from __future__ import annotations

import functools
import sys
import traceback
from typing import Any, Callable

import typer
from rich.markup import escape
from drifttool.cli._console import err, silence_stdout  # noqa: E402
import drifttool
from drifttool.errors import DriftToolError

app = typer.Typer(
    name="drifttool",
    help="Byte-level train-rollout consistency checks and drift forensics for the Qwen-Image MMDiT.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Exit codes for a command: ``DriftToolError`` and Ctrl-C → one line, exit 2; any other
    exception (a bug) → its traceback plus a line saying so, exit 2 (never 1, which means drift);
    a closed stdout (``| head``) keeps the command's own exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except DriftToolError as e:
            err.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
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
