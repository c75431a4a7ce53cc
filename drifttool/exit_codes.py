"""The exit codes of every ``drifttool`` command, distinct for CI:

    0  identical, or the command succeeded
    1  drift or a semantic mismatch (a probe matrix: a finding)
    2  a usage error or bad input (an option, a path, an unreadable artifact or fixture)
    3  incomparable or inconclusive: the runs cannot be aligned, or records are missing
    4  an internal error (a drifttool bug): one line; DRIFTTOOL_DEBUG=1 adds the traceback

Ctrl-C exits 130 and SIGTERM 143 (after the command's cleanup ran), as a shell reports them.
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """A command's exit status (module docstring)."""

    OK = 0
    DRIFT = 1
    USAGE = 2
    UNSURE = 3
    INTERNAL = 4
    INTERRUPTED = 130
    TERMINATED = 143


DEBUG_ENV = "DRIFTTOOL_DEBUG"
"""Set (to anything but empty or 0) to print an internal error's traceback."""

MEANINGS: dict[ExitCode, str] = {
    ExitCode.OK: "identical or success",
    ExitCode.DRIFT: "drift or semantic mismatch (probe: a finding)",
    ExitCode.USAGE: "usage error or bad input",
    ExitCode.UNSURE: "incomparable or inconclusive",
    ExitCode.INTERNAL: f"internal error ({DEBUG_ENV}=1 prints its traceback)",
    ExitCode.INTERRUPTED: "interrupted (Ctrl-C)",
    ExitCode.TERMINATED: "terminated (SIGTERM)",
}
"""What each exit code means, in the words of every ``--help`` (``EXIT_HELP``)."""

EXIT_HELP = "Exit codes: " + ", ".join(f"{int(code)} {MEANINGS[code]}" for code in ExitCode) + "."
"""The line every command's ``--help`` ends with, one entry per ``ExitCode``."""
