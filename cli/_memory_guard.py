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

Python runs the handler only when the main thread is back in the interpreter: one long native
call (a large tensor operation allocating as it goes) defers it while the memory keeps falling.
So when the available memory falls below half the floor, or ``GRACE_SECONDS`` pass, before the
handler ran, the watchdog ends the process itself: the same one line on stderr, exit 2, as a
``kill`` would leave the run directory (readable, ``complete: false``, its finished steps), but
not by the kernel's out-of-memory killer, which may pick another process of the machine.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Any, Callable, Iterator

from drifttool.host_memory import host_meminfo

FLOOR_BYTES = 512 << 20
FLOOR_FRACTION = 0.04
POLL_SECONDS = 0.02
GRACE_SECONDS = 2.0
"""How long the main thread may take to run the handler before the watchdog ends the process."""
EXIT_CODE = 2
"""The exit code of a command the watchdog ends itself (``drifttool.exit_codes``: bad input)."""
SIGNAL = signal.SIGUSR2 if hasattr(signal, "SIGUSR2") else None
"""The signal the watchdog sends its own process to raise ``MemoryError`` in the main thread."""


def floor(total: int) -> int:
    """The available bytes below which a command stops, for a host of ``total`` bytes."""
    return max(FLOOR_BYTES, int(total * FLOOR_FRACTION))


@contextlib.contextmanager
def host_memory_guard(line: Callable[[str], str] = lambda why: why) -> Iterator[None]:
    """Watch the host's available memory while the body runs (module docstring); a no-op off the
    main thread, without ``/proc/meminfo`` or without ``SIGUSR2``. ``line``: the error line the
    watchdog writes on stderr when it ends the process itself, from the reason in words.

    Raises:
        MemoryError: in the body, when the host's available memory fell below ``floor``.
    """
    start = host_meminfo()
    if start is None or SIGNAL is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    low: list[int] = []
    handled = threading.Event()
    stop = threading.Event()

    def why() -> str:
        return (f"the host's available memory fell to {low[-1] >> 20} MiB of {start.total >> 20} "
                "MiB; the command stopped before the system's out-of-memory killer would have")

    def raised(signum: int, frame: Any) -> None:
        if low and not handled.is_set():
            handled.set()
            raise MemoryError(why())

    def watch() -> None:
        while not stop.wait(POLL_SECONDS):
            now = host_meminfo()
            if now is not None and now.available < floor(now.total):
                low.append(now.available)
                os.kill(os.getpid(), SIGNAL)
                break
        else:
            return
        deadline = time.monotonic() + GRACE_SECONDS
        while not stop.wait(POLL_SECONDS) and not handled.is_set():
            now = host_meminfo()
            if now is not None:
                low.append(now.available)
            if time.monotonic() > deadline or (now is not None and now.available < floor(now.total) // 2):
                os.write(2, (line(why()) + "\n").encode())
                os._exit(EXIT_CODE)  # the main thread is in one native call: end here, not by the kernel

    previous = signal.signal(SIGNAL, raised)
    thread = threading.Thread(target=watch, name="drifttool-host-memory", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        signal.signal(SIGNAL, previous)
