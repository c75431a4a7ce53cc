"""One artifact life cycle for ``run``, ``replay`` and ``recompute``: manifest → writer → recorder →
runtime (trace) → complete or incomplete.

    session = ArtifactSession(mode=Mode.STRICT, level="L1", cfg_layout="batched")
    sigmas = session.sigma_table(sampler, img_grid)        # through the run's own dispatch
    manifest = {"kind": "rollout", "fingerprint": ..., ...}
    with session.open(out, manifest, overwrite=False) as s:
        s.write_inputs(replay_tensors(inputs))
        traj = rollout(fwd, inputs, sampler, s.rt)
        s.finish(complete=traj.complete)
    # an exception inside the block: finished steps flushed, the trace so far written, the
    # manifest left complete=false, and the run's own exception re-raised

What each stage does:

1. **Settings** (``ArtifactSession(...)``): mode, capture level, planted unavailable backends,
   operator variants, and where this process stands in the run: ``rank`` of ``world_size``
   with a ``layout`` description (default rank 0 of world 1, ``{"kind": "single"}``).
2. **Manifest** (the caller's dict): ``open`` adds ``layout`` = ``{"world_size", "tp", "sp",
   "cfg_parallel", "cfg_layout"}`` merged with the layout description, so the manifest states
   the real world size. ``sigma_table`` computes the fingerprint's sigma table with
   ``sampling.rollout.sigma_table`` on a silent runtime of the same mode, unavailable backends
   and variants: the manifest's table is the one the run computes (a ``flow_sigma_table``
   variant included), without a trace row or record in the run itself.
3. **Writer** (``ArtifactWriter``; ``complete: false`` from the start), **recorder**
   (``Recorder`` of this rank, only when the mode captures) and **runtime** (``Runtime`` with the
   recorder and a fresh trace).
4. **End**: ``finish(complete, **fields)`` writes the trace, checks it in strict mode
   (``OperatorTrace.check_strict``), merges ``fields`` into the manifest and closes recorder and
   writer with ``complete``. An exception in the block (``finish``'s strict check included)
   closes the artifact incomplete (``close_incomplete``) and propagates; a failure while closing
   does not replace it but is attached to it as a note (``BaseException.add_note``).

The per-rank writer (several ranks writing one artifact) plugs in at stage 3: each rank opens
its own session with its rank, the world size and the run's layout.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from drifttool.artifact.writer import ArtifactWriter
from drifttool.capture.recorder import Recorder
from drifttool.errors import note_left_incomplete
from drifttool.runtime import Mode, Runtime
from drifttool.sampling.config import SamplerConfig
from drifttool.sampling.rollout import sigma_table

SINGLE_LAYOUT: Mapping[str, Any] = {"kind": "single"}
"""The layout description of one process (rank 0 of world 1)."""


def close_incomplete(rt: Runtime | None, recorder: Recorder | None, writer: ArtifactWriter,
                     error: BaseException | None = None) -> None:
    """Flush what finished, keep the trace so far, and mark the artifact incomplete — never
    masking the run's own exception ``error``: a failure here is attached to ``error`` as a note
    (``add_note``) instead of replacing it, and the writer is closed in any case. ``error``
    records the artifact it left incomplete (``errors.note_left_incomplete``).

    Raises:
        The failure while closing, only when there is no ``error`` to attach it to.
    """
    try:
        if rt is not None:
            writer.write_trace(rt.trace.rows())
        if recorder is not None:
            recorder.close(complete=False)  # flushes the finished steps, closes the writer
    except Exception as secondary:  # noqa: BLE001 - the run's own exception is the one to report
        if error is None:
            raise
        error.add_note("while closing the artifact incomplete: "
                       + "".join(traceback.format_exception_only(secondary)).strip())
    finally:
        writer.close(complete=False)
        if error is not None:
            note_left_incomplete(error, writer.path)  # the CLI's Ctrl-C/SIGTERM line names it


class ArtifactSession:
    """The life cycle of one artifact written by this process (module docstring).

    Args:
        mode: runtime mode (decides capture and the strict trace check).
        level: capture level (``L0``/``L1``/``L2``), used when the mode captures.
        internals: at L2, also capture the fused attention's internals (``artifact.levels``);
            False pins ``Runtime.internals`` off.
        cfg_layout: the CFG execution layout recorded in the manifest's ``layout``.
        unavailable: (op, backend) pairs planted as unavailable (tests, probes).
        variants: ``{op: (variant_name, fn)}`` operator replacements (probes).
        rank: this process's rank; names its op records (``Recorder(rank=...)``).
        world_size: number of ranks writing the artifact.
        layout: description of how the run is laid out over the ranks (``{"kind": "single"}``
            for one process; a multi-rank layout also names e.g. each rank's samples); merged
            into the manifest's ``layout``.
        plan: the parallel plan (``drifttool.distributed.plan.ParallelPlan``) the runtime applies
            to every operator call; ``None`` for one device and for sample-parallel runs.

    Attributes:
        rt, recorder, writer: set by ``open`` (``recorder`` None when the mode captures nothing).

    Raises:
        ValueError: ``rank`` outside ``[0, world_size)``, or a layout stating another world size.
    """

    def __init__(self, *, mode: Mode | str, level: str, cfg_layout: str, internals: bool = True,
                 unavailable: set[tuple[str, str]] | tuple[tuple[str, str], ...] = (),
                 variants: Mapping[str, tuple[str, Callable[..., Any]]] | None = None,
                 rank: int = 0, world_size: int = 1,
                 layout: Mapping[str, Any] = SINGLE_LAYOUT, plan: Any = None) -> None:
        if not 0 <= int(rank) < int(world_size):
            raise ValueError(f"rank {rank} outside [0, world_size={world_size})")
        if int(layout.get("world_size", world_size)) != int(world_size):
            raise ValueError(f"layout states world_size {layout['world_size']}, the run has {world_size}")
        self.mode = Mode(mode)
        self.level = level
        self.internals = bool(internals)
        self.cfg_layout = cfg_layout
        self.unavailable = set(unavailable)
        self.variants = dict(variants or {})
        self.rank, self.world_size = int(rank), int(world_size)
        self.layout = dict(layout)
        self.plan = plan
        self.rt: Runtime | None = None
        self.recorder: Recorder | None = None
        self.writer: ArtifactWriter | None = None
        self.finished = False

    # -- before the artifact opens ----------------------------------------------------------
    def sigma_table(self, sampler: SamplerConfig, img_grid: tuple[int, int],
                    phase: str = "rollout") -> torch.Tensor:
        """The [num_steps + 1] fp32 sigma table the run will compute (``sampling.rollout.
        sigma_table`` under a silent runtime of this session's mode, unavailable backends and
        variants; nothing traced or recorded in the run).

        Raises:
            UnsupportedConfigError: ``flow_sigma_table`` has no backend for the mode.
        """
        silent = Runtime(mode=self.mode, unavailable=set(self.unavailable), variants=dict(self.variants))
        try:
            return sigma_table(silent, sampler, img_grid, phase)
        finally:
            if self.rt is not None:  # variants bound to the silent runtime go back to the run's
                self._bind_variants(self.rt)

    def manifest_layout(self) -> dict[str, Any]:
        """The manifest's ``layout``: world size, parallel degrees, CFG layout, description."""
        return {"world_size": self.world_size, "tp": 1, "sp": 1, "cfg_parallel": 1,
                "cfg_layout": self.cfg_layout, **self.layout}

    # -- open --------------------------------------------------------------------------------
    def open(self, out: str | Path, manifest: dict[str, Any], *,
             overwrite: bool = False) -> "ArtifactSession":
        """Create the writer (manifest with ``layout``, ``complete: false``), the recorder and
        the runtime; use the result as a context manager.

        Raises:
            ArtifactError: the artifact cannot be created (nothing is written then).
            UnsupportedConfigError: the runtime refuses the process settings (strict and TF32);
                the artifact is then closed incomplete.
        """
        self.writer = ArtifactWriter(out, {**manifest, "layout": self.manifest_layout()},
                                     overwrite=overwrite)
        if self.mode.captures:
            self.recorder = Recorder(level=self.level, writer=self.writer, rank=self.rank)
        try:
            self.rt = Runtime(mode=self.mode, recorder=self.recorder, rank=self.rank,
                              unavailable=set(self.unavailable), variants=dict(self.variants),
                              plan=self.plan, internals=None if self.internals else False)
        except BaseException as e:
            close_incomplete(None, self.recorder, self.writer, e)
            raise
        return self

    def __enter__(self) -> "ArtifactSession":
        if self.writer is None:
            raise RuntimeError("ArtifactSession.open(out, manifest) before entering it")
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None:
            close_incomplete(self.rt, self.recorder, self.writer, exc)
        elif not self.finished:  # left without finish(): the run did not say it completed
            close_incomplete(self.rt, self.recorder, self.writer)

    # -- during the run ----------------------------------------------------------------------
    def write_inputs(self, tensors: dict[str, torch.Tensor]) -> None:
        """Store the replay inputs (``inputs.safetensors``)."""
        self.writer.write_inputs(tensors)

    def update_manifest(self, **fields: Any) -> None:
        """Merge ``fields`` into the manifest now (still ``complete: false``)."""
        self.writer.update_manifest(**fields)

    # -- end ---------------------------------------------------------------------------------
    def finish(self, complete: bool, **fields: Any) -> None:
        """Write the trace, check it in strict mode, then close recorder and writer with
        ``complete``; ``fields`` are merged into the manifest before it is closed.

        Raises:
            UnsupportedConfigError: a strict run whose trace holds a fallback
                (``check_strict``); raised before anything is closed, so the block's exit closes
                the artifact incomplete.
        """
        self.writer.write_trace(self.rt.trace.rows())
        if self.mode is Mode.STRICT:
            self.rt.trace.check_strict()
        if fields:
            self.writer.update_manifest(**fields)
        if self.recorder is not None:
            self.recorder.close(complete=complete)
        self.writer.close(complete=complete)
        self.finished = True

    @staticmethod
    def _bind_variants(rt: Runtime) -> None:
        for _, fn in rt.variants.values():
            bind = getattr(fn, "bind_runtime", None)
            if callable(bind):
                bind(rt)
