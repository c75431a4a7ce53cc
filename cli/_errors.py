"""Exit codes for a command (``drifttool.exit_codes``): a user error is one ``error:`` line and
exit 2, a bug one ``internal error:`` line and exit 4 (its traceback with ``DRIFTTOOL_DEBUG=1``),
so that exit 1 always means "drift" and 3 "incomparable or inconclusive"."""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

import typer
from rich.markup import escape

from drifttool.cli._console import err, error_line, one_line, silence_stdout
from drifttool.cli._memory_guard import host_memory_guard
from drifttool.errors import DriftToolError, left_incomplete
from drifttool.exit_codes import DEBUG_ENV, ExitCode
from drifttool.launch_env import launched_ranks


class Terminated(SystemExit):
    """SIGTERM, raised where the process is (``cli.app``'s handler) so that the command unwinds
    through its cleanups; exits 143 (``ExitCode.TERMINATED``)."""

    def __init__(self) -> None:
        super().__init__(ExitCode.TERMINATED)


class _Signals:
    """Set by ``cli.app``'s SIGTERM handler. Python can lose the exception a signal handler raises
    when the signal arrives while a module is being imported; the command then runs on. The
    group's ``main`` still exits 143 with the one line when ``sigterm`` is set, and a long command
    stops at its next step (``check_terminated``)."""

    sigterm = False


SIGNALS = _Signals()


def check_terminated() -> None:
    """Raise ``Terminated`` if a SIGTERM arrived whose exception was lost: called between the
    steps of a long command (``drifttool run``'s per-step callback), so it stops within a step.

    Raises:
        Terminated: ``SIGNALS.sigterm`` is set.
    """
    if SIGNALS.sigterm:
        raise Terminated()


def stopped(e: BaseException) -> None:
    """Print the one line of a command stopped by Ctrl-C (``KeyboardInterrupt``, ``typer.Abort``)
    or SIGTERM (``Terminated``), naming each run directory it left, kept and ``complete: false``
    (``drifttool.errors.left_incomplete``)."""
    what = "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted (Ctrl-C)"
    runs = left_incomplete(e)
    kept = ""
    if runs:
        names = ", ".join(runs)
        kept = (f": the run director{'ies' if len(runs) > 1 else 'y'} {names} "
                f"{'are' if len(runs) > 1 else 'is'} kept, marked incomplete (complete: false)")
    err.print(f"[bold red]{what}[/]{escape(kept)}", highlight=False)


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


_WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM,
                           errno.EISDIR, errno.ENOENT, errno.ENOTDIR, errno.EFBIG, errno.EIO})
"""File-system errors of a write: the machine's state, not a drifttool bug, even where the error
names no file."""


def torch_oom() -> type[BaseException]:
    """``torch.OutOfMemoryError`` when torch is loaded (the CLI imports it lazily), else a class
    nothing raises."""
    import sys

    torch = sys.modules.get("torch")
    return getattr(torch, "OutOfMemoryError", _NeverRaised) if torch is not None else _NeverRaised


class _NeverRaised(Exception):
    pass


_HOST_OOM = ("DefaultCPUAllocator", "can't allocate memory")
"""Words of torch's CPU allocator failing (``c10::DefaultCPUAllocator``: a ``RuntimeError``)."""


def host_oom(e: BaseException) -> bool:
    """Whether ``e`` is torch's CPU allocator running out of host memory."""
    return isinstance(e, RuntimeError) and any(w in str(e) for w in _HOST_OOM)


def _out_of_memory(where: str, e: BaseException) -> str:
    """One line for a run that does not fit in memory (``where``: host or device)."""
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    return (f"out of {where} memory: {first} (a smaller image: --height/--width, or --image-area "
            "for an edit; fewer samples or a lower capture level fits)")


ALIKE = "alike_on_every_rank"
"""Attribute set on a ``DriftToolError`` that every rank raises alike (``alike_on_every_rank``)."""

TORCHRUN_COMMANDS = "`drifttool run`, `replay`, `recompute`, `probe` and `experiment`"
"""The commands that run under torchrun (sample-parallel, or a --tp/--sp/--cfg-parallel layout)."""

_ONE_PROCESS = {
    "diff": "it reads artifacts (a multi-rank artifact diffs in one process)",
    "trace": "it reads an artifact (every rank's trace)",
    "overlay": "it reads artifacts",
    "report": "it reads artifacts",
    "fixture verify": "it re-runs the fixture in one process",
    "fixture seal": "it writes one seal",
}
"""Why a command runs in one process only: named in its refusal under torchrun."""


def one_process_refusal(command: str) -> str:
    """The line a command that does not run under torchrun refuses it with, naming why."""
    why = _ONE_PROCESS.get(command, "it has no multi-rank layout")
    return (f"drifttool {command or 'this command'} runs in one process: {why}; launch it without "
            f"torchrun (only {TORCHRUN_COMMANDS} run under torchrun: sample-parallel, or "
            "--tp/--sp/--cfg-parallel)")


@contextlib.contextmanager
def alike_on_every_rank() -> Iterator[None]:
    """A ``DriftToolError`` raised in the block is one that every rank raises alike: the block
    reads only the command line, the files it names and ``WORLD_SIZE`` (the checks before a
    process group starts). ``user_errors`` prints it once, on local rank 0, instead of once per
    rank (one line for the launch, not one per rank)."""
    try:
        yield
    except DriftToolError as e:
        setattr(e, ALIKE, True)
        raise


def _local_ranks() -> tuple[int, bool]:
    """(LOCAL_RANK, whether the launch spans several hosts: LOCAL_WORLD_SIZE < WORLD_SIZE)."""
    try:
        local = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
        hosts = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))) \
            < int(os.environ.get("WORLD_SIZE", "1"))
        return local, hosts
    except ValueError:
        return 0, False


QUIET_RANK_WAIT_S = 3.0
"""How long a rank that leaves an alike error to local rank 0 waits before it exits: torchrun
stops every other rank as soon as one exits non-zero, and local rank 0 must print first."""


def _print_error(e: DriftToolError, rank: int, world: int) -> None:
    """One line per rank under torchrun (prefixed with the rank), or, for an error every rank
    raises alike, one line from local rank 0 (prefixed with the rank only when the launch spans
    several hosts: one line per host); the other ranks wait ``QUIET_RANK_WAIT_S`` before they
    exit, so that torchrun does not stop local rank 0 before it printed, and exit with the error's
    status, silently, when torchrun stops them (SIGTERM) in that wait."""
    if world > 1 and getattr(e, ALIKE, False):
        local, hosts = _local_ranks()
        if local == 0:
            error_line(f"[rank {rank}] {e}" if hosts else str(e))
        else:
            try:
                time.sleep(QUIET_RANK_WAIT_S)
            except Terminated:  # torchrun stopping this rank once local rank 0 exited: expected
                SIGNALS.sigterm = False  # no "terminated" line beside rank 0's error
        return
    error_line(f"[rank {rank}] {e}" if world > 1 else str(e))


def user_errors(fn: Callable[..., Any], *, command: str = "", ranks: bool = False
                ) -> Callable[..., Any]:
    """Exit codes for a command (``drifttool.exit_codes``): ``DriftToolError``, an ``OSError``
    on a named path (not a directory, permission denied, name too long, disk full), a write's
    file-system error that names no path (``_WRITE_ERRNOS``) and running
    out of host (``MemoryError``, torch's CPU allocator's ``RuntimeError``: ``host_oom``; the host's
    available memory falling below the watchdog's floor, ``cli._memory_guard``) or
    device memory → one line, exit 2; Ctrl-C → one line, exit 130, SIGTERM
    (``Terminated``) → one line, exit 143, each naming the run directory left incomplete
    (``stopped``); any other
    exception (a bug) → one ``internal error:`` line, exit 4 (``internal_error``); a closed
    stdout (``| head``) keeps the command's own exit code.

    Under torchrun (``WORLD_SIZE`` > 1) a command that does not run on several ranks
    (``ranks=False``: all but ``run``, ``replay``, ``recompute``, ``probe`` and ``experiment``)
    is refused in one line naming why (``one_process_refusal``) instead of having
    every rank race for the same output; under torchrun every rank prefixes its error line with
    its rank, except for an error every rank raises alike (``alike_on_every_rank``), printed once."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        rank, world = launched_ranks()
        try:
            if world > 1 and not ranks:
                raise DriftToolError(one_process_refusal(command))
            prefix = f"[rank {rank}] " if world > 1 else ""
            with host_memory_guard(lambda why: f"error: {prefix}{_out_of_memory('host', MemoryError(why))}"):
                return fn(*args, **kwargs)
        except DriftToolError as e:
            _print_error(e, rank, world)
            raise typer.Exit(ExitCode.USAGE) from None
        except KeyboardInterrupt as e:
            stopped(e)
            raise typer.Exit(ExitCode.INTERRUPTED) from None
        except Terminated as e:
            stopped(e)
            raise typer.Exit(ExitCode.TERMINATED) from None
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except BrokenPipeError:
            silence_stdout()
            raise typer.Exit(ExitCode.USAGE) from None
        except MemoryError as e:  # numpy's _ArrayMemoryError too: the run does not fit, no bug
            error_line(_out_of_memory("host", e))
            raise typer.Exit(ExitCode.USAGE) from None
        except torch_oom() as e:
            error_line(_out_of_memory("device", e))
            raise typer.Exit(ExitCode.USAGE) from None
        except Exception as e:  # noqa: BLE001 - a bug: one line, exit 4
            if hasattr(e, "show") and hasattr(e, "exit_code"):  # click/typer usage errors
                raise
            if host_oom(e):  # torch's CPU allocator raises a RuntimeError, not a MemoryError
                error_line(_out_of_memory("host", e))
                raise typer.Exit(ExitCode.USAGE) from None
            if isinstance(e, OSError) and isinstance(e.filename, (str, bytes, os.PathLike)):
                # the file system (a path the user named), not a bug
                error_line(_os_error(e))
                raise typer.Exit(ExitCode.USAGE) from None
            if isinstance(e, OSError) and e.errno in _WRITE_ERRNOS:
                # a write that named no file (``drifttool.errors.writing`` names those it wraps)
                error_line(f"writing the outputs: {e.strerror or e}")
                raise typer.Exit(ExitCode.USAGE) from None
            internal_error(e)
            raise typer.Exit(ExitCode.INTERNAL) from None

    return wrapper


def debugging() -> bool:
    """Whether ``DRIFTTOOL_DEBUG`` asks for tracebacks (set, and not empty or ``0``)."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def internal_error(e: BaseException) -> None:
    """Report a bug on stderr in one line (``internal error: TYPE: MESSAGE``), its traceback
    first when ``debugging()``."""
    if debugging():
        traceback.print_exception(type(e), e, e.__traceback__)
        hint = "please report it with the traceback above"
    else:
        hint = f"{DEBUG_ENV}=1 prints its traceback; please report it"
    what = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    err.print(f"[bold red]internal error:[/] {escape(one_line(what))} (a drifttool bug; {hint})",
              highlight=False, soft_wrap=True)
