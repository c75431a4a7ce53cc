"""The host's memory as Linux reports it (``/proc/meminfo``), without importing torch: what a
run's memory check (``drifttool.memory``) and the command line's watchdog
(``cli._memory_guard``) read.

    >>> host_meminfo()          # None where /proc/meminfo is missing or unreadable
    HostMemory(available=20317315072, total=25219592192)
"""

from __future__ import annotations

from typing import NamedTuple

MEMINFO = "/proc/meminfo"


class HostMemory(NamedTuple):
    """``MemAvailable`` and ``MemTotal``, in bytes."""

    available: int
    total: int


def host_meminfo(path: str | None = None) -> HostMemory | None:
    """``MemAvailable`` and ``MemTotal`` of ``path`` (default ``MEMINFO``), or None where the file
    is missing, unreadable or lacks either line."""
    found: dict[str, int] = {}
    try:
        with open(path or MEMINFO) as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in ("MemAvailable", "MemTotal"):
                    found[key] = int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    if len(found) != 2:
        return None
    return HostMemory(found["MemAvailable"], found["MemTotal"])
