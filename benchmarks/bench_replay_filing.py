"""The host's filing after a replayed forward: one call at a time against the bulk filing of
``drifttool.model.replay``, side by side in one run (ratios against one call at a time).

    $ python benchmarks/bench_replay_filing.py [--layers 60] [--repeat 20]
    capture  batch  records/forward  one by one ms  bulk ms  ratio

A CUDA graph replays a forward's kernels, its digest kernels included, without Python; what the
eager forward filed call by call (a site and a trace entry per operator call, a record per
captured part) is then filed on the host, while the GPU waits for the next launch. This measures
that host work alone, on the CPU: a forward of a ``--layers``-block transformer of the tiny
width (the same operator calls and records per forward as the full model: 1,865 records at
batch 1) is run once under ``model.replay.logging_runtime``, its digests are computed and read
back once (a GPU's row tables are finished on the device; the CPU's small-tensor digests would
otherwise be summed again at every filing and hide what is timed), and each configuration files
them ``--repeat`` times, each into its own step, flushing the step's
batch as the sampler does once per step:

* **one by one**: ``Runtime.site`` and ``OperatorTrace.record`` per call, then
  ``Recorder.capture_digested`` per captured output (``materialize`` reads every digest back);
* **bulk**: ``ReplayRecords.file`` (one counter advance, one ``record_calls``, one read-back of a
  planned ``ReadBack``, one ``Recorder.capture_records``).

Both leave the same records, trace and counters (checked here on the last repeat; tested in
``tests/model/test_replay_filing.py``). The GPU path reads its digests from row tables
(``digest_rows.RowTables``) rather than the CPU's per-record vectors; what it files is the same.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from drifttool.capture.digest import materialize  # noqa: E402
from drifttool.capture.recorder import Recorder  # noqa: E402
from drifttool.model.replay import ReplayRecords, logging_runtime  # noqa: E402
from drifttool.environment import environment  # noqa: E402
from drifttool.model.config import tiny  # noqa: E402
from drifttool.model.mmdit import MMDiT, random_init_  # noqa: E402
from drifttool.runtime import Runtime  # noqa: E402

GRID, SLOTS = (8, 9), 13


def _scope(batch: int, step: int) -> dict:
    return dict(phase="rollout", step=step, sigma=1.0 - step / 1000, samples=list(range(batch)),
                txt_lens=[SLOTS] * batch, img_grid=GRID,
                branch="cond" if batch == 1 else ("cond", "uncond") * (batch // 2))


def _one_by_one(records: ReplayRecords, rt: Runtime) -> None:
    """What a replay filed before the bulk filing: a site and a trace entry per call, then one
    ``capture_digested`` per captured output."""
    captured = []
    for call in records.calls:
        site = rt.site(call.op, call.stream, block=call.block)
        rt.trace.record(site=site, **call.trace)
        captured.extend((site, *c) for c in call.captures)
    done = iter(materialize([d for *_, parts in captured for _, d in parts]))
    for site, index, role, parts in captured:
        rt.recorder.capture_digested(site, [(p, next(done)) for p, _ in parts], index=index, role=role)


def _bulk(records: ReplayRecords, rt: Runtime) -> None:
    records.file(rt)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=60)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    cfg = dataclasses.replace(tiny(), num_layers=args.layers)
    model = random_init_(MMDiT(cfg), seed=0)
    g = torch.Generator().manual_seed(0)
    rows = []
    for level in ("L1", "L2"):
        for batch in (1, 2):
            x = torch.randn(batch, GRID[0] * GRID[1], 64, generator=g)
            txt = torch.randn(batch, SLOTS, cfg.joint_attention_dim, generator=g)
            rt0 = Runtime(mode="strict", recorder=Recorder(level))
            with rt0.scope(**_scope(batch, 0)), torch.no_grad():
                quiet, log = logging_runtime(rt0, level)
                model(x, txt, None, torch.rand(batch, generator=g), GRID, quiet)
            for call in log.calls:  # digests read back once: what is timed is the filing
                call.captures = [(i, role, [(part, d) for (part, _), d in
                                            zip(parts, materialize([d for _, d in parts]))])
                                 for i, role, parts in call.captures]
            records = ReplayRecords(log.calls, level)
            runs = {name: Runtime(mode="strict", recorder=Recorder(level)) for name in ("one", "bulk")}
            times: dict[str, list[float]] = {name: [] for name in runs}
            for r in range(args.repeat + 2):  # the first two: warm-up
                for name, fn in (("one", _one_by_one), ("bulk", _bulk)):
                    rt = runs[name]
                    with rt.scope(**_scope(batch, r)):
                        t0 = time.perf_counter()
                        fn(records, rt)
                        rt.recorder.flush()
                        if r >= 2:
                            times[name].append(time.perf_counter() - t0)
            assert runs["one"].recorder.ops_table().equals(runs["bulk"].recorder.ops_table())
            assert runs["one"].trace.rows() == runs["bulk"].trace.rows()
            one, bulk = (statistics.median(times[k]) * 1e3 for k in ("one", "bulk"))
            rows.append((level, batch, len(records), one, bulk))
    env = environment()
    table = Table(title=f"filing after a replay, {args.layers} blocks — {datetime.date.today()} — "
                        f"{env['cpu']} ({env['cpu_count']} cores, torch {torch.__version__}, "
                        f"{platform.python_version()}), medians of {args.repeat}")
    for col in ("capture", "batch", "records/forward", "one by one ms", "bulk ms", "ratio"):
        table.add_column(col, justify="right")
    for level, batch, n, one, bulk in rows:
        table.add_row(level, str(batch), f"{n:,}", f"{one:.1f}", f"{bulk:.1f}", f"{bulk / one:.2f}")
    Console().print(table)


if __name__ == "__main__":
    main()
