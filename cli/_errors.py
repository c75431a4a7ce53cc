"""Exit codes for a command: a user error is one ``error:`` line and exit 2, a bug its traceback
and exit 2, so that exit 1 always means "drift" (``cli/app.py``)."""

from __future__ import annotations

import errno
import functools
import os
import traceback
from pathlib import Path
from typing import Any, Callable

import typer

from drifttool.cli._console import err, error_line, silence_stdout
from drifttool.errors import DriftToolError


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


def torch_oom() -> type[BaseException]:
    """``torch.OutOfMemoryError`` when torch is loaded (the CLI imports it lazily), else a class
    nothing raises."""
    import sys

    torch = sys.modules.get("torch")
    return getattr(torch, "OutOfMemoryError", _NeverRaised) if torch is not None else _NeverRaised


class _NeverRaised(Exception):
    pass


def _out_of_memory(where: str, e: BaseException) -> str:
    """One line for a run that does not fit in memory (``where``: host or device)."""
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    return (f"out of {where} memory: {first} (a smaller --height/--width, batch or capture "
            "level fits)")


def _launched_ranks() -> tuple[int, int]:
    """(RANK, WORLD_SIZE) set by torchrun, (0, 1) otherwise or when unreadable (the command's
    own launch checks name a bad value)."""
    try:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 0, 1


def user_errors(fn: Callable[..., Any], *, command: str = "", ranks: bool = False
                ) -> Callable[..., Any]:
    """Exit codes for a command: ``DriftToolError``, an ``OSError`` on a named path (not a
    directory, permission denied, name too long, disk full), running out of host or device
    memory and Ctrl-C → one line, exit 2; any
    other exception (a bug) → its traceback plus a line saying so, exit 2 (never 1, which means
    drift); a closed stdout (``| head``) keeps the command's own exit code.

    Under torchrun (``WORLD_SIZE`` > 1) a command that does not run on several ranks
    (``ranks=False``: all but ``run``) is refused in one line instead of having every rank race
    for the same output; under torchrun every rank prefixes its error line with its rank."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        rank, world = _launched_ranks()
        try:
            if world > 1 and not ranks:
                raise DriftToolError(
                    f"drifttool {command or 'this command'} runs in one process; launch it "
                    "without torchrun (only `drifttool run` runs sample-parallel)")
            return fn(*args, **kwargs)
        except DriftToolError as e:
            error_line(f"[rank {rank}] {e}" if world > 1 else str(e))
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            err.print("[bold red]interrupted[/]")
            raise typer.Exit(2) from None
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except BrokenPipeError:
            silence_stdout()
            raise typer.Exit(2) from None
        except MemoryError as e:  # numpy's _ArrayMemoryError too: the run does not fit, no bug
            error_line(_out_of_memory("host", e))
            raise typer.Exit(2) from None
        except torch_oom() as e:
            error_line(_out_of_memory("device", e))
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
