"""A probe as data: the one change it makes to the baseline run and what the diff must then say.

    >>> from drifttool.probes.catalog import probe
    >>> p = probe("rope_rotate_half")
    >>> p.factor, p.kind, p.expect.op, p.expect.stream
    ('RoPE', 'mismatch', 'multi_axis_rope', 'img')

Three kinds (design.md, "Probes"; RFC "Experiments"); distributed probes
(``drifttool.probes.distributed``) are mismatches and invariants whose probe run is a parallel
layout, and may declare the owning rank of the first drift (``Expectation.rank``):

===========  ==============================================================================
mismatch     one factor changed the way a real pipeline got it wrong; the run must drift and its
             first drift must be the declared operator (and step/block/stream where declared),
             as an origin (every earlier record matches)
invariant    a change that must not move a byte (repeat, batch size and position, prompt padding,
             CFG layout, ...); the diff must say identical
sensitivity  a planted 1-ULP change in one element of one operator output; the diff must locate it
             exactly: operator, step, block, stream, branch, sample and the one differing row
===========  ==============================================================================

A probe whose expectation fails is a *finding*: it is reported and makes ``drifttool probe`` exit
non-zero, never skipped. A probe whose machinery does not exist yet (``pending``) is listed as
pending, never run and never counted as a pass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from drifttool.artifact.schema import block_words, names_one
from drifttool.errors import DriftToolError

KINDS = ("mismatch", "invariant", "sensitivity")

@dataclass(frozen=True, kw_only=True)
class ProbeContext:
    """What a probe with its own execution (``Probe.execute``) gets: the baseline ``RunSpec``
    (``base``), the baseline artifact, a scratch directory (``work``), the directory its probe run
    must be written to (``run_dir``), the baseline's checkpoint folder, and where its runs
    execute: ``dist`` (``DistContext``: this process's rank in a torchrun launch, None for one
    process) and ``parallel`` (the launch's ``ParallelDims``, None for sample-parallel or one
    process), as ``runner.execute`` takes them. Under a launch every rank calls the probe; files
    that are not a run's own are written by rank 0 (``dist.rank``)."""

    base: Any
    baseline: Path
    work: Path
    run_dir: Path
    checkpoint: Path
    dist: Any = None
    parallel: Any = None
    noop: dict[str, str] = field(default_factory=dict)
    """Filled by an execution that proved its change a no-op on these weights and inputs:
    ``{"reason": ...}`` (the probe is then NOT APPLICABLE when its diff is identical)."""

    @property
    def launched(self) -> bool:
        """Whether the probe runs on several ranks of a torchrun launch."""
        return self.dist is not None and self.dist.world_size > 1


VariantFactory = Callable[[], Callable[..., Any]]
"""Builds a fresh operator variant (one per run: variants may keep per-run state)."""

WeightTransform = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
"""Maps a checkpoint state dict (checkpoint names) to the probe's state dict."""


@dataclass(frozen=True, kw_only=True)
class Expectation:
    """What the diff of the probe run against the baseline must say.

    Attributes:
        verdict: ``"drift"``, ``"identical"`` or ``"observed"`` (run and reported, never judged:
            production arithmetic whose verdict depends on the machine; status ``OBSERVED``).
        op: RFC operator of the first drift (``drift`` only; required for mismatch probes).
        step, block, stream, branch, sample: further fields of the first drift, checked when set.
        rows: the differing rows of the first-drift record, exactly (e.g. ``("img (2, 1)",)``,
            ``("txt 3",)``); needs capture level L2. Checked when set.
        origin: the first drift must be an origin (every earlier record present and equal).
        rank: the owning rank of the first drift in the probe run (run B of the diff): the rank
            that computed its first differing row under SP (``FirstDrift.row_rank_b``), else the
            rank that wrote the record (distributed probes). Checked when set.
        blocks: the baseline model's number of blocks, where ``block`` may be the one after the
            last (``describe`` then says ``after block <n-1>``, as a first drift's location
            does); never checked.
    """

    verdict: str
    op: str | None = None
    step: int | None = None
    block: int | None = None
    stream: str | None = None
    branch: str | None = None
    sample: int | None = None
    rows: tuple[str, ...] | None = None
    origin: bool = True
    rank: int | None = None
    blocks: int | None = None

    def describe(self) -> str:
        """One line, e.g. ``drift at multi_axis_rope (img, block 0, step 0)``."""
        if self.verdict != "drift":
            return self.verdict
        where = ["before step 0" if k == "step" and getattr(self, k) < 0 else
                 block_words(self.block, self.blocks) if k == "block" else f"{k} {getattr(self, k)}"
                 for k in ("step", "block", "branch", "sample") if getattr(self, k) is not None]
        if names_one(self.stream):
            where.insert(0, self.stream)
        if self.rows is not None:
            where.append("rows " + ", ".join(self.rows))
        if self.rank is not None:
            where.append(f"rank {self.rank}")
        return f"drift at {self.op}" + (f" ({', '.join(where)})" if where else "")


@dataclass(frozen=True, kw_only=True)
class Probe:
    """One entry of the probe matrix.

    Attributes:
        name: unique identifier (``--only`` selects by it).
        factor: the RFC factor (mismatch), or the invariance it controls.
        kind: ``mismatch`` | ``invariant`` | ``sensitivity``.
        change: the one change, in words.
        source: where the mistake was seen or documented (numerics spec section, issue, ...).
        expect: the expectation the diff is judged against.
        spec: ``RunSpec`` field overrides for the probe run (e.g. ``{"cfg_layout": "sequential"}``).
        variants: ``{op: (variant_name, factory)}``; each factory builds the replacement of that
            operator for one run (``RunSpec.variants``).
        weights: checkpoint transform; the probe runs on the transformed copy of the baseline's
            checkpoint (written under the probe's directory).
        compare: ``"all"`` (every record) or ``"common_samples"`` (records of the logical samples
            both runs hold, for batch-size controls; a run with other samples is not "missing").
        execute: a probe that is not one ``execute`` of a changed spec (replay, training
            recompute, ...): called with a ``ProbeContext``, writes its runs and returns the
            (reference, probe) artifact pair to diff; default: (baseline, the changed spec's run).
        pending: non-empty when the probe cannot run yet; says what it waits for.
        layout: the parallel layout a distributed probe runs (``"TP2"``, ``"SP2 agrs"``;
            ``drifttool.probes.distributed``); empty for the one-process probes.
    """

    name: str
    factor: str
    kind: str
    change: str
    expect: Expectation
    source: str = ""
    spec: Mapping[str, Any] = field(default_factory=dict)
    variants: Mapping[str, tuple[str, VariantFactory]] = field(default_factory=dict)
    weights: WeightTransform | None = None
    compare: str = "all"
    execute: Callable[[ProbeContext], tuple[Path, Path]] | None = None
    pending: str = ""
    layout: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"probe {self.name}: kind {self.kind!r} not in {KINDS}")
        if self.compare not in ("all", "common_samples"):
            raise ValueError(f"probe {self.name}: compare {self.compare!r}")
        want = "identical" if self.kind == "invariant" else "drift"
        if self.expect.verdict not in (want, "observed"):
            raise ValueError(f"probe {self.name}: a {self.kind} probe expects {want!r}")
        if self.expect.verdict == "observed" and self.kind == "sensitivity":
            raise ValueError(f"probe {self.name}: a sensitivity probe is judged, never observed")
        if self.kind != "invariant" and self.expect.verdict != "observed" and not self.expect.op:
            raise ValueError(f"probe {self.name}: a {self.kind} probe must declare its operator")
        if self.kind == "sensitivity" and self.expect.rows is None:
            raise ValueError(f"probe {self.name}: a sensitivity probe must declare its row")

    def refusal(self, device: str) -> str:
        """Why the probe cannot run on device type ``device`` (empty: it can): the first refusal
        of its variants or of its own execution, each asked through its ``refuses(device)``
        where it has one (``variants.Variant.refuses``, ``suspects.Paired``, ...)."""
        return first_refusal([*(factory() for _, factory in self.variants.values()), self.execute],
                             device)

    def build_variants(self) -> dict[str, tuple[str, Callable[..., Any]]]:
        """Fresh ``RunSpec.variants`` for one run."""
        return {op: (name, factory()) for op, (name, factory) in self.variants.items()}

    def with_(self, **changes: Any) -> "Probe":
        """A copy with fields replaced (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)


def first_refusal(parts: list, device: str) -> str:
    """The first non-empty ``part.refuses(device)`` among ``parts`` (a part without ``refuses``
    refuses nothing); empty when none refuses device type ``device``."""
    for part in parts:
        refuses = getattr(part, "refuses", None)
        why = refuses(device) if callable(refuses) else ""
        if why:
            return why
    return ""


def select(probes: list, only: str | None, what: str = "probe") -> list:
    """The ``probes`` (anything with a ``name``) named in the comma-separated ``only``, in
    catalog order; all when ``only`` is ``None``. ``what`` names them in messages.

    Raises:
        DriftToolError: an unknown name, an empty entry (``"a,"``), or none at all (the message
            lists the known ones).
    """
    if only is None:
        return probes
    names = [n.strip() for n in only.split(",")]
    known = ", ".join(p.name for p in probes)
    if not any(names):
        raise DriftToolError(f"--only names no {what} ({only!r}); known: {known}")
    if not all(names):
        raise DriftToolError(f"--only: an empty entry in {only!r} (comma-separated {what} names; "
                             f"known: {known})")
    unknown = sorted(set(names) - {p.name for p in probes})
    if unknown:
        raise DriftToolError(f"unknown {what}{'s' if len(unknown) > 1 else ''} "
                             f"{', '.join(unknown)}; known: {known}")
    return [p for p in probes if p.name in names]
