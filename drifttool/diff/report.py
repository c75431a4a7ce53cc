"""The diff result as data: verdict, first drift, per-step drift. ``to_json`` for machines.

    {"schema_version": 1, "verdict": "drift", "reason": "first drift at rollout step 3 block 5 img qk_rmsnorm ...",
     "level": "L2", "covers": "step records, operator outputs and their row digests",
     "first_drift": {"kind": "op", "rank_a": 1, "rank_b": 0, "row_rank_a": null,
                     "row_rank_b": null, "step": 3, "block": 5,
                     "op": "qk_rmsnorm", "sample": 1, "origin": true, "origin_kind": "record",
                     "rows": {"n_rows": 4102, "n_differ": 1, "first": [{"kind": "img", ...}]}},
     "steps": [{"step": 0, "identical": true, ...}, ...]}

Exit codes (``drifttool.exit_codes``): identical 0, drift 1, incomparable 3, inconclusive 3
(records are missing, so "no drift seen" is not "identical": a script must not read it as a pass);
the CLI exits 2 on bad input and 4 on an internal error.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from dataclasses import dataclass, field
from typing import Any

from drifttool.artifact.schema import DEFAULT_COMPONENT, SAMPLER_BLOCK
from drifttool.exit_codes import ExitCode
from drifttool.jsondata import SCHEMA_VERSION, plain


class Verdict(str, enum.Enum):
    """identical: every record present in both runs and bitwise equal; drift: a common record
    differs; incomparable: the runs cannot be aligned (schema, ``fingerprint.arch``, capture
    level); inconclusive: no drift in the common records, but records are missing or a run is
    incomplete."""

    IDENTICAL = "identical"
    DRIFT = "drift"
    INCOMPARABLE = "incomparable"
    INCONCLUSIVE = "inconclusive"


EXIT_CODES = {Verdict.IDENTICAL: ExitCode.OK, Verdict.DRIFT: ExitCode.DRIFT,
              Verdict.INCOMPARABLE: ExitCode.UNSURE, Verdict.INCONCLUSIVE: ExitCode.UNSURE}


def exit_code(verdict: Verdict) -> int:
    """0 identical, 1 drift, 3 incomparable or inconclusive (``drifttool.exit_codes``)."""
    return int(EXIT_CODES[Verdict(verdict)])


@dataclass(kw_only=True)
class RowRef:
    """One canonical row: ``kind`` is ``"txt"`` (``pos``), ``"img"`` (``i``, ``j``) or ``"row"``."""

    row: int
    kind: str
    pos: int | None = None
    i: int | None = None
    j: int | None = None

    @classmethod
    def of(cls, row: int, rid: tuple) -> "RowRef":
        """From ``drifttool.capture.layout.row_id``'s tuple."""
        if rid[0] == "img":
            return cls(row=row, kind="img", i=rid[1], j=rid[2])
        return cls(row=row, kind=rid[0], pos=rid[1])

    def __str__(self) -> str:
        return f"img ({self.i}, {self.j})" if self.kind == "img" else f"{self.kind} {self.pos}"


@dataclass(kw_only=True)
class RowDrift:
    """Row-level localisation (both runs hold L2 row digests of equal count)."""

    n_rows: int
    n_differ: int
    first: list[RowRef]  # the first few differing rows, in row order


LEVEL_COVERS = {"L0": "step boundaries only",
                "L1": "step records and operator outputs, without row digests",
                "L2": "step records, operator outputs and their row digests"}
"""What a verdict at each common capture level covers (``DiffReport.covers``)."""


@dataclass(kw_only=True)
class FirstDrift:
    """The first differing record in run A's program order (``drifttool.diff.order``: phase,
    step, block, ``op_pos``, index, branch, sample — the same on every rank and layout).

    ``rank_a``/``rank_b`` are the owning ranks of the record in each run (the rank that
    computed and holds it; a 2-rank run may own it on rank 1 where a single process owns it on
    rank 0): in a TP/SP/CFG-parallel run, the rank that *wrote* it (TP and SP coordinate 0).
    ``row_rank_a``/``row_rank_b``: in a run of layout ``parallel`` with SP > 1, the rank that
    *computed* the first differing row (its SP shard, ``drifttool.diff.owners.row_owner``;
    ``None`` when not applicable: another layout, no row digests, a replicated text-stream or
    sampler record, Ulysses attention). ``owner_a``/``owner_b`` are the row's rank where known,
    else the writer. ``op_pos`` is the op record's program position in its (phase, step, branch,
    block).

    ``kind`` is ``"op"`` (an operator output) or ``"step"`` (a step quantity: ``op`` holds the
    quantity name, ``block``/``stream``/``call``/``index``/``role`` are ``None``). A record is an
    origin only if the inputs it consumed match; ``origin_kind`` says which:

    - ``"record"``: every earlier record of both runs is present in both and equal, and the
      step's input ``x_t`` matches: the drift is born in this record.
    - ``"between_steps"``: the step's ``x_t`` differs while every record of the previous step
      matched (its ``x_next`` included): the latent changed between the steps, outside every
      recorded operator. The first drift is then that ``x_t`` record, not an operator of the step.
    - ``"inputs"``: the replay inputs differ (``x_t`` of the phase's first step, or a prompt,
      mask or SDE noise that ``DiffReport.input_differences`` names, ``input_note`` its first
      line): the record consumed them and is the first where they show (e.g.
      ``txt_in_rmsnorm_linear`` for a prompt).
    - ``"ranks"``: the ranks of a TP/SP layout disagree on this record (a replicated output
      that one rank computed with other bytes, ``disagree_a``/``disagree_b``), while every
      earlier record agrees on every rank and matches: the drift is born here, on that rank.
      This is a finding in one run alone (a run diffed against itself).
    - ``"unknown"``: records missing in one run precede it; the origin may be earlier.
    - ``"unchecked"``: an earlier operator output of a TP/SP run was not checked on every rank
      (written without ``rank_disagree``: schema version 3); a rank may have drifted there
      unseen, so no origin is claimed.

    ``disagree_a``/``disagree_b``: the ranks whose copy of the record differs from the owning
    rank's in each run (``rank_disagree``; empty or ``None`` when they agree or were not
    checked). ``part_rank_a``/``part_rank_b``: where both runs hold every rank's digest partial
    of the record in the same layout (``rank_digests``), the first rank whose partial differs —
    the rank whose rows (outside attention) or heads (inside attention, Ulysses and TP) differ.

    ``origin`` is ``origin_kind`` not ``"unknown"`` or ``"unchecked"``; ``prev_step`` is the previous step of a
    ``"between_steps"`` origin (``None`` otherwise); ``unmatched_before`` counts the records of
    one run only that precede it.
    """

    kind: str
    rank_a: int
    rank_b: int
    component: str
    phase: str
    step: int
    sigma: float
    branch: str
    block: int | None
    op_pos: int | None
    stream: str | None
    op: str
    call: int | None
    index: int | None
    role: str | None
    sample: int
    dtype: tuple[str, str]
    shape: tuple[list[int], list[int]]
    digest: tuple[str, str]
    nonfinite: tuple[int, int]
    maxabs: tuple[float, float]
    origin: bool
    origin_kind: str
    prev_step: int | None = None
    unmatched_before: int = 0
    input_note: str | None = None
    rows: RowDrift | None = None
    row_rank_a: int | None = None
    row_rank_b: int | None = None
    disagree_a: list[int] | None = None
    disagree_b: list[int] | None = None
    part_rank_a: int | None = None
    part_rank_b: int | None = None

    @staticmethod
    def _owner(rank: int, row: int | None, part: int | None, disagree: list[int] | None) -> int:
        if disagree:
            return disagree[0]
        if part is not None:
            return part
        return rank if row is None else row

    @property
    def owner_a(self) -> int:
        """Run A's first rank that disagrees with the owning rank, else the rank whose digest
        partial differs, else the rank that computed the first differing row, else the
        record's writer."""
        return self._owner(self.rank_a, self.row_rank_a, self.part_rank_a, self.disagree_a)

    @property
    def owner_b(self) -> int:
        """As ``owner_a``, for run B."""
        return self._owner(self.rank_b, self.row_rank_b, self.part_rank_b, self.disagree_b)

    def origin_words(self) -> str:
        """The origin in words, e.g. ``x_t of step 2 differs; step 1's outputs match — changed
        between steps``."""
        return {
            "record": "origin (every earlier record matches)",
            "between_steps": f"x_t of step {self.step} differs; step {self.prev_step}'s outputs "
                             "match — changed between steps",
            "inputs": (f"the replay inputs differ ({self.input_note}); x_t of step {self.step} "
                       "matches" if self.input_note else
                       f"x_t of step {self.step}, the first step of phase {self.phase}, differs — "
                       "the replay inputs differ"),
            "ranks": "ranks disagree here: every earlier record agrees on every rank",
            "unknown": f"{self.unmatched_before} unmatched records precede it: origin may be "
                       "earlier",
            "unchecked": "earlier records were not checked on every rank (schema version 3): "
                         "origin may be earlier, on another rank",
        }[self.origin_kind]

    def owning_rank(self) -> str:
        """The owning ranks in words: ``owning rank 0`` when both runs agree, else ``owning
        rank 1 in run A, 0 in run B``. Where a run names the rank that computed the first
        differing row (``row_rank_a``/``row_rank_b``), that rank is the owner and the writer is
        added: ``owning rank 1 (the SP rank of its first differing row; written by rank 0)``,
        ``owning rank 0 in run A, 1 in run B (run B: the SP rank of its first differing row;
        written by rank 0)``."""
        words, detail = self._owner_words()
        return words if detail is None else f"{words} ({detail})"

    def _owner_words(self) -> tuple[str, str | None]:
        """(``owning rank ...``, what the row owner and the writer are, or ``None``)."""
        oa, ob = self.owner_a, self.owner_b
        words = f"owning rank {oa}" if oa == ob else f"owning rank {oa} in run A, {ob} in run B"
        ranks = [(s, d, w) for s, d, w in (("A", self.disagree_a, self.rank_a),
                                           ("B", self.disagree_b, self.rank_b)) if d]
        if ranks:
            return words, "; ".join(
                f"ranks disagree in run {s}: rank{'s' if len(d) > 1 else ''} "
                f"{', '.join(map(str, d))} ≠ rank {w}, its writer" for s, d, w in ranks)
        parts = [(s, p, w) for s, p, w in (("A", self.part_rank_a, self.rank_a),
                                           ("B", self.part_rank_b, self.rank_b)) if p is not None]
        if parts:
            written = {w for _, _, w in parts}
            return words, ("the rank whose part of it differs; written by rank "
                           + (str(written.pop()) if len(written) == 1 else
                              f"{self.rank_a} in run A, {self.rank_b} in run B"))
        sides = [(s, w) for s, r, w in (("A", self.row_rank_a, self.rank_a),
                                        ("B", self.row_rank_b, self.rank_b)) if r is not None]
        if not sides:
            return words, None
        writers = {w for _, w in sides}
        which = "" if len(sides) == 2 else f"run {sides[0][0]}: "
        written = (f"written by rank {writers.pop()}" if len(writers) == 1 else
                   f"written by rank {self.rank_a} in run A, {self.rank_b} in run B")
        return words, f"{which}the SP rank of its first differing row; {written}"

    def _rank_note(self) -> str:
        """The owning rank as ``where()`` puts it in parentheses (no nested parentheses)."""
        words, detail = self._owner_words()
        return words if detail is None else f"{words}; {detail}"

    def where(self) -> str:
        """One-line location, e.g. ``rollout step 3 cond block 5 img qk_rmsnorm#0 sample 1
        (owning rank 0)``; a component other than the MMDiT is named first."""
        comp = "" if self.component == DEFAULT_COMPONENT else f"{self.component} "
        if self.kind == "step":
            return (f"{comp}{self.phase} step {self.step} {self.branch} {self.op} sample "
                    f"{self.sample} ({self._rank_note()})")
        out = "" if self.index == 0 else f" out{self.index}"
        role = "" if self.role == "output" else f" {self.role}"
        block = "sampler" if self.block == SAMPLER_BLOCK else f"block {self.block}"
        return (f"{comp}{self.phase} step {self.step} {self.branch} {block} {self.stream} "
                f"{self.op}#{self.call}{out}{role} sample {self.sample} ({self._rank_note()})")


@dataclass(kw_only=True)
class OpRef:
    """The first differing op record of one step (run A's program order; ``rank``: its owning
    rank in run A)."""

    rank: int
    op_pos: int
    branch: str
    block: int
    stream: str
    op: str
    call: int
    sample: int

    def __str__(self) -> str:
        block = "sampler" if self.block == SAMPLER_BLOCK else f"b{self.block}"
        return f"{self.branch} {block} {self.stream} {self.op}#{self.call} s{self.sample}"


@dataclass(kw_only=True)
class QuantityDrift:
    """One step quantity of one sample and branch, compared from the stored bytes in fp64.

    ``identical`` is ``None`` when the record is missing on one side (``note`` says which).
    ``max_abs`` and ``rel_l2`` (``‖a−b‖₂/‖a‖₂``) run over elements finite in both runs;
    ``nonfinite_mismatch`` counts elements finite in one run and not in the other.
    """

    quantity: str
    branch: str
    sample: int
    identical: bool | None
    max_abs: float | None = None
    rel_l2: float | None = None
    nonfinite_mismatch: int = 0
    note: str = ""


@dataclass(kw_only=True)
class TransitionKL:
    """KL of the SDE transition for one sample: ``mean((mu_a − mu_b)²) / (2 s²)``,
    ``s = std_t·sqrt(sigma − sigma_next)`` from run A; ``None`` when ``s = 0`` or mu is missing."""

    sample: int
    branch: str
    kl: float | None
    noise_scale: float | None


@dataclass(kw_only=True)
class StepDrift:
    """Drift of one (phase, step).

    Attributes:
        identical: every step and op record of the step is present in both runs and equal.
        carried_in: the step's input ``x_t`` already differed (any sample); ``None``: no x_t.
        first_op: the step's first differing op record (run A's program order), if any.
        ops_differ: number of differing op records in the step.
        missing: records of the step present in one run only.
    """

    phase: str
    step: int
    sigma: float
    sigma_next: float
    identical: bool
    carried_in: bool | None
    first_op: OpRef | None
    ops_differ: int
    missing: int
    quantities: list[QuantityDrift] = field(default_factory=list)
    kl: list[TransitionKL] = field(default_factory=list)

    def worst(self, quantity: str) -> QuantityDrift | None:
        """The entry of ``quantity`` with the largest ``max_abs`` (differing ones first)."""
        qs = [q for q in self.quantities if q.quantity == quantity]
        if not qs:
            return None
        return max(qs, key=lambda q: (q.identical is False, _key(q.max_abs), _key(q.rel_l2)))


def _key(x: float | None) -> float:
    return -1.0 if x is None else (math.inf if math.isnan(x) else x)


@dataclass(kw_only=True)
class Counts:
    """Records compared in one table (``ops`` or ``steps``)."""

    a: int
    b: int
    matched: int
    differ: int
    only_a: int
    only_b: int


@dataclass(kw_only=True)
class DiffReport:
    """Result of ``diff_runs``.

    Attributes:
        verdict: see ``Verdict``; ``reason`` says why in one line.
        incomparable: the fields that prevent alignment (empty unless incomparable).
        context: other differences between the runs, listed first (fingerprint outside
            ``arch``, inputs, capture level, operator trace); the runs are still diffed.
        input_differences: the replay inputs that differ or that one run lacks (compared per
            common sample, prompt padding removed); a run with any is never ``identical``.
        level: the common capture level (the lower of the two runs'); ``covers``: what a verdict
            at that level covers (``LEVEL_COVERS``), e.g. ``"step boundaries only"`` at L0.
        notes: what the reader or aligner noticed (cut files, duplicate identities, levels).
        counts: per table (``"ops"``, ``"steps"``), see ``Counts``; ops absent when not compared.
        identical_through: the last ``[phase, step]`` up to which every record matched.
        first_drift: see ``FirstDrift``. steps: per-step drift, in program order.
        tolerance: with a tolerance profile (``diff --tolerance``), the differing records judged
            against it (``drifttool.diff.tolerance.ToleranceResult``); ``None`` without one.
        semantic: the semantic pre-check (``drifttool.diff.semantic.SemanticCheck``): whether
            the runs are the same program, each program field that differs named; ``None`` when
            the runs are incomparable (nothing else was read).
        clip: with a clip range (``diff --clip-range``), the log-prob drift per step and branch
            against it (``drifttool.diff.clip.ClipDrift``); ``None`` without one.
    """

    verdict: Verdict
    reason: str
    run_a: str
    run_b: str
    level: str | None = None
    covers: str | None = None
    incomparable: list[str] = field(default_factory=list)
    context: list[str] = field(default_factory=list)
    input_differences: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    counts: dict[str, Counts] = field(default_factory=dict)
    identical_through: tuple[str, int] | None = None
    first_drift: FirstDrift | None = None
    steps: list[StepDrift] = field(default_factory=list)
    tolerance: Any = None
    semantic: Any = None
    clip: Any = None

    @property
    def exit_code(self) -> int:
        """``exit_code(self.verdict)``; with a tolerance profile, a drift whose differing records
        are all within it exits 0. A semantic mismatch (the runs are different programs) exits 1
        whatever the bytes say, tolerance or not; incomparable and inconclusive stay 3."""
        if self.semantic is not None and self.semantic.mismatch and self.verdict in (
                Verdict.IDENTICAL, Verdict.DRIFT):
            return int(ExitCode.DRIFT)
        if self.verdict == Verdict.DRIFT and self.tolerance is not None and self.tolerance.ok:
            return 0
        return exit_code(self.verdict)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data with ``schema_version`` first; a non-finite float becomes
        ``null`` beside a ``<key>_nonfinite`` key naming it (``drifttool.jsondata``)."""
        return {"schema_version": SCHEMA_VERSION, **plain(dataclasses.asdict(self))}

    def to_json(self, **kwargs: Any) -> str:
        """``to_dict()`` as strict JSON (``kwargs`` go to ``json.dumps``; default indent 2)."""
        kwargs.setdefault("indent", 2)
        return json.dumps(self.to_dict(), allow_nan=False, **kwargs)
