"""torchrun's launch variables as a process reads them before any launch check.

``distributed.context`` validates ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` and names a bad value;
what runs earlier or must stay light (the CLI's error handling, the artifact directory's writer
lock) needs only a lenient reading, free of torch and pyarrow: ``launched_ranks``.
"""

from __future__ import annotations

import os


def launched_ranks() -> tuple[int, int]:
    """``(RANK, WORLD_SIZE)`` as torchrun sets them; ``(0, 1)`` when unset or unreadable."""
    try:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 0, 1
