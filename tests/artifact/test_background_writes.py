"""The writer's Parquet files written as the run goes (``artifact.background``,
``parquet.ParquetFile``): the same bytes as a conversion of the stream at close, digests left
uncompressed, failures raised on the caller's thread, nothing left behind by an incomplete close."""

from __future__ import annotations

import errno
import threading
import time

import pyarrow as pa
import pytest

from drifttool.artifact import open_run
from drifttool.artifact import schema as S
from drifttool.artifact.background import OrderedJobs
from drifttool.artifact.parquet import ParquetFile, file_digest, write_parquet
from tests.artifact.test_artifact_io import write_run


def test_jobs_run_in_order_and_the_first_failure_stops_the_rest():
    done, jobs = [], OrderedJobs(depth=1)
    for i in range(5):
        jobs.submit(lambda i=i: (time.sleep(0.002 * (5 - i)), done.append((i, threading.current_thread().name))))
    assert jobs.stop() is None and [i for i, _ in done] == [0, 1, 2, 3, 4]
    assert all(name != threading.current_thread().name for _, name in done)
    with pytest.raises(RuntimeError, match="after stop"):
        jobs.submit(done.append, 9)

    failing, ran = OrderedJobs(), []
    failing.submit(ran.append, 1)
    failing.submit(lambda: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device", "x")))
    failing.submit(ran.append, 2)  # queued before the failure was seen: never runs
    err = failing.stop()
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC and ran == [1]
    assert failing.stop() is err
    with pytest.raises(OSError, match="No space"):
        failing.submit(ran.append, 3)


def test_a_lost_wake_up_of_the_write_thread_does_not_strand_stop():
    """A signal handler's exception (SIGTERM: ``lifecycle``'s ``Terminated``) raised inside the
    queue's ``put`` on the run's thread can leave the write thread waiting for a notification
    that never comes; ``stop`` (the close of an interrupted run) still returns, every job run."""
    done, jobs = [], OrderedJobs()
    jobs.submit(done.append, 0)
    cond = jobs._queue.not_empty
    for _ in range(200):  # the write thread waits for the next job
        if cond._waiters:
            break
        time.sleep(0.01)

    def lost(n=1):  # the waiter taken off the list and never woken
        if cond._waiters:
            cond._waiters.popleft()

    cond.notify = lost
    jobs.submit(done.append, 1)
    del cond.notify
    stopper = threading.Thread(target=jobs.stop, daemon=True)
    stopper.start()
    stopper.join(10)
    assert not stopper.is_alive() and done == [0, 1]


def test_the_finished_parquet_file_is_the_conversion_of_the_stream(tmp_path, monkeypatch):
    """A run's Parquet file, written batch by batch beside the stream, has the bytes that writing
    the stream's batches in one go at close gives."""
    from drifttool.artifact.writer import ArtifactWriter

    before_close = ArtifactWriter.close

    def convert_then_close(self, complete, **fields):
        for table in ("ops", "steps"):  # the streams as they stand at close
            with pa.memory_map(str(self.path / f"{table}.rank0.arrows")) as src:
                write_parquet(tmp_path / f"{table}.parquet", pa.ipc.open_stream(src), S.SCHEMAS[table])
        before_close(self, complete, **fields)

    monkeypatch.setattr(ArtifactWriter, "close", convert_then_close)
    run = write_run(tmp_path / "a", steps=4)
    assert open_run(run).complete
    for table in ("ops", "steps"):
        assert file_digest(run / f"{table}.rank0.parquet") == file_digest(tmp_path / f"{table}.parquet")
    assert [p.name for p in run.iterdir() if p.name.endswith((".tmp", S.STREAM))] == []


def test_digest_columns_are_stored_uncompressed(tmp_path):
    import pyarrow.parquet as pq

    run = write_run(tmp_path / "a")
    meta = pq.ParquetFile(run / "ops.rank0.parquet").metadata
    codecs = {meta.row_group(0).column(i).path_in_schema.split(".")[0]: meta.row_group(0).column(i).compression
              for i in range(meta.num_columns)}
    assert codecs["digest"] == codecs["row_digests"] == "UNCOMPRESSED"
    assert codecs["op"] == codecs["l2"] == "ZSTD"


@pytest.mark.parametrize("failing", [1, 6], ids=["raised-by-the-next-write", "raised-by-close"])
def test_a_failed_parquet_write_is_raised_and_the_run_closes_incomplete(tmp_path, monkeypatch, failing):
    """The ``failing``-th Parquet write of a 3-step run (2 batches a step) hits a full disk: the
    run raises the error (at a later write, once the thread has met it, or at close for the last
    batch), its manifest says incomplete, its streams keep every batch written before, and no
    Parquet file or temp file is left."""
    calls, write = [], ParquetFile.write

    def full_at_failing(self, batch):
        if not self.path.name.startswith("trace"):  # the op and step records' (the trace's: at once)
            calls.append(self.path.name)
            if len(calls) == failing:
                raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        write(self, batch)

    monkeypatch.setattr(ParquetFile, "write", full_at_failing)
    with pytest.raises(OSError, match="No space left on device"):
        write_run(tmp_path / "a")
    run = open_run(tmp_path / "a")
    assert not run.complete and run.ops_table().num_rows >= 2
    if failing == 6:
        assert run.ops_table().num_rows == 6 and run.steps_table().num_rows == 3
    assert not [p.name for p in run.path.iterdir()
                if p.name.startswith(("ops.", "steps.")) and p.name.endswith((".parquet", ".tmp"))]
