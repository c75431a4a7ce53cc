"""A watchdog of the host's memory for the length of a command: when the memory still available
falls below a floor (``FLOOR_BYTES`` or ``FLOOR_FRACTION`` of the total, the larger), the
command stops with ``MemoryError`` raised in its main thread, before the kernel's out-of-memory
killer would end the process without a word: one ``error: out of host memory`` line, exit 2,
and the run directory left readable, ``complete: false``, with the steps it finished
(``cli._errors.user_errors``).

    with host_memory_guard():
        ...  # the command

A run's memory check (``drifttool.memory.check_memory``) refuses before any work what cannot fit
by a lower bound of its peak; what that bound does not count (an operator's working tensors, a
very large batch of a small model) is what this catches. Linux only (``/proc/meminfo``; nothing
is watched elsewhere), the main thread only (where Python runs signal handlers).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Any, Iterator

from drifttool.host_memory import host_meminfo

FLOOR_BYTES = 512 << 20
FLOOR_FRACTION = 0.04
POLL_SECONDS = 0.02
SIGNAL = signal.SIGUSR2 if hasattr(signal, "SIGUSR2") else None
"""The signal the watchdog sends its own process to raise ``MemoryError`` in the main thread."""


def floor(total: int) -> int:
    """The available bytes below which a command stops, for a host of ``total`` bytes."""
    return max(FLOOR_BYTES, int(total * FLOOR_FRACTION))


@contextlib.contextmanager
def host_memory_guard() -> Iterator[None]:
    """Watch the host's available memory while the body runs (module docstring); a no-op off the
    main thread, without ``/proc/meminfo`` or without ``SIGUSR2``.

    Raises:
        MemoryError: in the body, when the host's available memory fell below ``floor``.
    """
    start = host_meminfo()
    if start is None or SIGNAL is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    low: list[int] = []
    stop = threading.Event()

    def raised(signum: int, frame: Any) -> None:
        if low:
            raise MemoryError(f"the host's available memory fell to {low[0] >> 20} MiB of "
                              f"{start.total >> 20} MiB; the command stopped before the system's "
                              "out-of-memory killer would have")

    def watch() -> None:
        while not stop.wait(POLL_SECONDS):
            now = host_meminfo()
            if now is not None and now.available < floor(now.total):
                low.append(now.available)
                os.kill(os.getpid(), SIGNAL)
                return

    previous = signal.signal(SIGNAL, raised)
    thread = threading.Thread(target=watch, name="drifttool-host-memory", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        signal.signal(SIGNAL, previous)
