"""Write jobs run in order on one thread beside the run: the artifact writer's Parquet files take
each step's records while the next step computes.

    jobs = OrderedJobs()
    jobs.submit(parquet.write, batch)  # returns once the job is queued (waits while `depth` are)
    error = jobs.stop()                # every queued job done, the thread gone: the first failure

At full size a step's L2 records are about 120 MB (a row digest per token row of every operator
output). Writing them as Parquet once more when the run closes would read and write the whole
artifact again after the last step; on the run's own thread each step would wait for it. pyarrow
encodes and writes without holding the GIL, so the next step's Python and kernels run meanwhile
(docs/benchmarks.md, "Writing the records").

Order and failures: jobs run one at a time in the order they were submitted. The first job that
raises is kept and no later job runs; ``submit`` raises it (so a run stops at its next write,
with the error the write gave), and ``stop`` returns it for its caller to raise when it must
(``ArtifactWriter.close``). At most ``depth`` jobs wait at once, so a disk slower than the run
holds the run back rather than filling memory with batches.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable

DEPTH = 2
"""Jobs that may wait at once: a step's batches while the next step's are made."""

POLL_S = 0.2
"""How often the write thread looks at the queue without being woken: a signal handler's
exception (SIGTERM's, ``lifecycle``) raised inside ``queue.Queue.put`` on the run's thread can
lose its wake-up, and a run's close must not wait for it for ever."""


class OrderedJobs:
    """Jobs run in submission order on one daemon thread, started by the first ``submit``.

    Args:
        depth: jobs that may wait at once (``submit`` blocks past it).
        name: the thread's name.
    """

    def __init__(self, depth: int = DEPTH, name: str = "drifttool-writes") -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, int(depth)))
        self._name = name
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._error: BaseException | None = None

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn(*args)``.

        Raises:
            The first failure of an earlier job (nothing is queued then).
            RuntimeError: the jobs were stopped.
        """
        if self._error is not None:
            raise self._error
        if self._stopped:
            raise RuntimeError("write jobs submitted after stop()")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        self._queue.put((fn, args))

    def stop(self) -> BaseException | None:
        """Wait for every queued job, end the thread, and return the first failure (None if
        every job ran). A second call returns the same."""
        if self._thread is not None and not self._stopped:
            self._queue.put(None)
            self._thread.join()
        self._stopped = True
        return self._error

    def _run(self) -> None:
        while True:
            try:
                job = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if job is None:
                return
            fn, args = job
            if self._error is None:  # after a failure, nothing more is written
                try:
                    fn(*args)
                except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                    self._error = e
