"""The ``drifttool`` command: one module per subcommand, listed here.

    drifttool run -o runs/a                   # strict run of the embedded default
    drifttool run --mode auto -o runs/b
    drifttool diff runs/a runs/b              # exit 0 identical, 1 drift, 3 incomparable/inconclusive
    drifttool fixture verify                  # re-run the sealed default and check its digests
    drifttool trace runs/a                    # the operator trace
    drifttool report runs/a runs/b -o report.html

Exit codes (``drifttool.exit_codes``, the last line of every command's ``--help``): 0 identical
or success, 1 drift, 2 a usage error or bad input (``DriftToolError``, a bad option value, a
file-system error on a path the user named: one ``error:`` line, no traceback), 3 incomparable or
inconclusive, 4 an internal error (a bug: one ``internal error:`` line; ``DRIFTTOOL_DEBUG=1``
prints its traceback), 130 Ctrl-C, 143 SIGTERM (after the command's cleanup ran; each one line
naming a run directory it left incomplete). typer's ``--install-completion [SHELL]`` and
``--show-completion [SHELL]`` install or print shell completion (``cli._completion``).

Start-up: ``main`` imports and builds only the command its command line names (``drifttool diff
A B`` builds ``diff`` alone: no other command module is imported and typer turns one signature,
not every one, into options); without one (``--help``, completion, an unknown name) it builds all.
``app`` (tests, ``typer.testing``) is the full group, built on first use.
"""

from __future__ import annotations

import atexit
import difflib
import importlib
import os
import signal
import sys
import threading
import warnings
from typing import Any

import typer
from typer.core import TyperGroup

import drifttool
from drifttool.cli._command import Command, FittedHelp
from drifttool.cli._completion import completion_help, shell_named
from drifttool.cli import _console
from drifttool.cli._console import error_line
from drifttool.cli._errors import SIGNALS, Terminated, internal_error, stopped, user_errors
from drifttool.cli._threads import threaded
from drifttool.exit_codes import EXIT_HELP, ExitCode

# click's exceptions as typer raises them (typer >= 0.2x vendors click as ``typer._click``)
_click_errors = sys.modules[typer.BadParameter.__module__]
_NO_ARGS_IS_HELP = getattr(_click_errors, "NoArgsIsHelpError", ())  # click >= 8.2


class _Group(FittedHelp, TyperGroup):
    """The ``drifttool`` group: click/typer usage errors (bad or missing option, unknown command)
    as one ``error:`` line naming the command's ``--help``, exit 2, instead of typer's boxed
    usage text; an exception no command handled (a bug) as one ``internal error:`` line, exit 4;
    ``--help``, ``--version`` and shell completion behave as usual; a bare group prints its
    help (stdout), then one ``error:`` line naming its commands (``_missing_command``), exit 2."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        completion_help(self.params)
        args = list(sys.argv[1:] if args is None else args)
        if not standalone_mode:
            args = shell_named(args, self.params)
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            args = shell_named(args, self.params)  # `--show-completion zsh`: zsh's script
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except _NO_ARGS_IS_HELP as e:  # the help was printed (stdout) when the error was built
            _missing_command(e.ctx)
            code = ExitCode.USAGE
        except _click_errors.ClickException as e:
            _close_suggestions(e)
            ctx = getattr(e, "ctx", None)
            hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
            error_line(f"{e.format_message()}{hint}")
            code = ExitCode.USAGE  # never 1, which means "drift"
        except (typer.Abort, KeyboardInterrupt, Terminated) as e:
            stopped(e)  # outside a command (user_errors prints it inside one)
            code = ExitCode.TERMINATED if isinstance(e, Terminated) else ExitCode.INTERRUPTED
        except Exception as e:  # noqa: BLE001 - a bug outside a command's own handling
            internal_error(e)
            code = ExitCode.INTERNAL
        if SIGNALS.sigterm and code != ExitCode.TERMINATED:  # the handler's exception was lost
            stopped(Terminated())
            code = ExitCode.TERMINATED
        sys.exit(code if isinstance(code, int) else 0)


def _missing_command(ctx: Any) -> None:
    """The ``error:`` line under a bare group's help (``drifttool``, ``drifttool fixture``):
    naming the group's commands and its ``--help``, as every other usage error names it."""
    names = ", ".join(ctx.command.list_commands(ctx))
    error_line(f"Missing command: give one of {names}. (see '{ctx.command_path} --help')")


SUGGEST_AT = 0.6
"""How alike an unknown option's name and a suggested one must be (difflib's ratio of the names
without their dashes): click compares them with the dashes, so ``--bogus`` was offered ``--out``."""


def _close_suggestions(e: Exception) -> None:
    """Keep, of the options click suggests for an unknown one, those alike by ``SUGGEST_AT``."""
    if isinstance(e, _click_errors.NoSuchOption) and e.possibilities:
        name = e.option_name.lstrip("-")
        e.possibilities = [p for p in e.possibilities
                           if difflib.SequenceMatcher(None, name, p.lstrip("-")).ratio() >= SUGGEST_AT]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"drifttool {drifttool.__version__}")
        raise typer.Exit(0)


def _main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """Byte-level train-rollout consistency checks and drift forensics for the Qwen-Image MMDiT."""


COMMANDS = (
    ("run", "run", "run"), ("diff", "diff", "diff"), ("trace", "trace", "trace"),
    ("probe", "probe", "probe"), ("overlay", "overlay", "overlay"), ("replay", "replay", "replay"),
    ("recompute", "replay", "recompute"), ("report", "report", "report"),
)
"""Every ``drifttool`` command, in one list: (name, module under ``drifttool.cli``, function);
each wrapped by ``user_errors``."""
GROUPS = (("fixture", "fixture"), ("experiment", "experiment"))
"""Every ``drifttool`` command group: (name, module under ``drifttool.cli`` whose ``app`` it is)."""
_RANKS = ("run", "replay", "recompute", "probe")
"""Commands that run on torchrun's ranks (``cli._layout``); every other command refuses torchrun
in one line naming why (``cli._errors.one_process_refusal``)."""
_COMPUTES = ("run", "replay", "recompute", "probe", "diff", "overlay", "report")
"""Commands that run torch's operators and take ``--threads`` (``cli._threads``)."""



def _module(name: str) -> Any:
    return importlib.import_module(f"drifttool.cli.{name}")


def build(only: str | None = None) -> typer.Typer:
    """The ``drifttool`` group with every command, or with command (or group) ``only`` alone."""
    group = typer.Typer(
        name="drifttool",
        cls=_Group,
        help="Byte-level train-rollout consistency checks and drift forensics for the Qwen-Image MMDiT.",
        epilog=EXIT_HELP,
        no_args_is_help=True,
        pretty_exceptions_enable=False,
    )
    group.callback()(_main)
    for name, module, fn in COMMANDS:
        if only in (None, name):
            cmd = getattr(_module(module), fn)
            cmd = threaded(cmd) if name in _COMPUTES else cmd
            group.command(name, cls=Command, epilog=EXIT_HELP)(
                user_errors(cmd, command=name, ranks=name in _RANKS))
    for name, module in GROUPS:
        if only in (None, name):
            group.add_typer(_module(module).app, name=name)
    return group


def invoked(args: list[str]) -> str | None:
    """The command or group a command line names (its first argument, when that is one), else
    None (``--help``, ``--version``, completion, no argument, an unknown name)."""
    names = {n for n, *_ in COMMANDS} | {n for n, _ in GROUPS}
    return args[0] if args and args[0] in names else None


def __getattr__(name: str) -> Any:
    """``app``: the full group, built on first use (``main`` builds only what it runs)."""
    if name != "app":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()["app"] = full = build()
    return full


def _terminated(signum: int, frame: Any) -> None:
    """SIGTERM (``kill``, a batch scheduler, torchrun stopping its ranks) as an exit the command
    unwinds through: its ``finally`` and context-manager cleanups run (a temporary re-run is
    removed, an open artifact closed ``complete: false``), then one line saying so, exit 143
    (``ExitCode.TERMINATED``). Also sets ``SIGNALS.sigterm``, for when Python loses the
    exception (``cli._errors.check_terminated``)."""
    SIGNALS.sigterm = True
    raise Terminated()


class _Unpadded:
    """A text stream that writes each line without its trailing spaces (typer's rich help pads
    every line to the console's width), a line when its newline comes; the rest on ``close``."""

    def __init__(self, out: Any) -> None:
        self.out, self.pending = out, ""

    def write(self, text: str) -> int:
        *lines, self.pending = (self.pending + text).split("\n")
        for line in lines:
            self.out.write(line.rstrip(" ") + "\n")
        return len(text)

    def close(self) -> None:
        self.out.write(self.pending.rstrip(" "))
        self.pending = ""
        self.out.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.out, name)


def _help_width() -> None:
    """``--help`` (or a bare command group's help) on a pipe or in a CI log: typer's help console would take ``COLUMNS`` (often 80)
    and cut option names with an ellipsis; it gets the pipe width of drifttool's own output
    instead (``_console.PIPE_WIDTH``), unless ``TERMINAL_WIDTH`` sets one; and its lines reach
    the pipe without the padding to that width (``_Unpadded``), as the rest of the output."""
    args = sys.argv[1:]
    wants_help = "--help" in args or not args or (len(args) == 1 and args[0] in dict(GROUPS))  # a bare group
    if wants_help and not sys.stdout.isatty():
        if not os.environ.get("TERMINAL_WIDTH"):
            import typer.rich_utils

            typer.rich_utils.MAX_WIDTH = _console.PIPE_WIDTH
        sys.stdout = _Unpadded(sys.stdout)
        atexit.register(sys.stdout.close)


def main() -> None:
    # a refused CUDA graph capture: the command's summary says it in one line (graph_warning)
    warnings.filterwarnings("ignore", message=r".*the model runs eagerly from now on", category=RuntimeWarning)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminated)
    _help_width()
    build(invoked(sys.argv[1:]))()


if __name__ == "__main__":
    sys.exit(main())
