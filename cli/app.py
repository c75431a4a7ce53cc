"""The ``drifttool`` command: one module per subcommand, listed here.

    drifttool run -o runs/a                   # strict run of the embedded default
    drifttool run --mode auto -o runs/b
    drifttool diff runs/a runs/b              # exit 0 identical, 1 drift, 2 error/incomparable
    drifttool fixture verify                  # re-run the sealed default and check its digests
    drifttool trace runs/a                    # the operator trace

User errors (``DriftToolError``) print one line and exit 2, without a traceback.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable

import typer
from rich.console import Console

from drifttool.errors import DriftToolError

app = typer.Typer(
    name="drifttool",
    help="Byte-level train-rollout consistency checks and drift forensics for the Qwen-Image MMDiT.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
err = Console(stderr=True)


def user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn ``DriftToolError`` (and Ctrl-C) into a one-line message and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except DriftToolError as e:
            err.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            err.print("[bold red]interrupted[/]")
            raise typer.Exit(2) from None

    return wrapper


def _register() -> None:
    from drifttool.cli import diff, fixture, run, trace

    app.command("run")(user_errors(run.run))
    app.command("diff")(user_errors(diff.diff))
    app.command("trace")(user_errors(trace.trace))
    app.add_typer(fixture.app, name="fixture")


_register()


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
