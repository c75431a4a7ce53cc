"""Where the first drift is, as data: the record (``FirstDrift``), its origin and owning rank
in words, and its differing rows (``RowRef``, ``RowDrift``).

    >>> report.first_drift.where(), report.first_drift.origin_kind
    ('rollout step 3 cond block 5 img qk_rmsnorm#0 sample 1 (owning rank 0)', 'record')

``drifttool.diff.first_drift`` finds it; ``DiffReport.first_drift`` (``drifttool.diff.report``)
carries it. Source: design.md, "Diff".
"""

from __future__ import annotations

from dataclasses import dataclass

from drifttool.artifact.schema import DEFAULT_COMPONENT, block_words, names_one


@dataclass(kw_only=True)
class RowRef:
    """One canonical row: ``kind`` is ``"txt"`` (``pos``), ``"img"`` (``i``, ``j``), ``"cond"``
    (a condition image's row: ``pos`` = the condition row, or ``pos`` = the image k, ``i``, ``j``)
    or ``"row"``."""

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
        if rid[0] == "cond" and len(rid) == 4:
            return cls(row=row, kind="cond", pos=rid[1], i=rid[2], j=rid[3])
        return cls(row=row, kind=rid[0], pos=rid[1])

    def __str__(self) -> str:
        if self.kind == "img":
            return f"img ({self.i}, {self.j})"
        if self.kind == "cond" and self.i is not None:
            return f"cond image {self.pos} ({self.i}, {self.j})"
        return f"{self.kind} {self.pos}"


@dataclass(kw_only=True)
class RowDrift:
    """Row-level localisation (both runs hold L2 row digests of equal count)."""

    n_rows: int
    n_differ: int
    first: list[RowRef]  # the first few differing rows, in row order


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
      mask or SDE noise that ``DiffReport.input_differences`` names, ``input_note`` all its
      lines joined by ``; ``): the record consumed them and is the first where they show (e.g.
      ``txt_in_rmsnorm_linear`` for a prompt). A
      record of an early stage of a chain or edit run (text encoder, VAE encode: step −1) reads
      no replay input — that stage makes them — but the prompts and condition images: it is
      ``"inputs"`` only when those differ (``drifttool.diff.stages``), else ``"record"``.
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
    blocks: int | None = None
    """The number of blocks of the record's component where run A's manifest records it
    (``schema.model_blocks``: the MMDiT's), so that a record after the last block is said so
    (``after block 1``); ``None`` otherwise."""

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
            "inputs": (f"the replay inputs differ ({self.input_note})" if self.input_note and self.step < 0 else
                       f"the replay inputs differ ({self.input_note}); x_t of step {self.step} "
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
        (owning rank 0)``; a component other than the MMDiT is named first. A record made before
        the first step (step −1: the sigma table) is ``before step 0``, one made before the first
        block (block −1: the input projections) ``before block 0``, one after the last block (the
        final norm, the output projection) ``after block <n-1>``; a branch or stream
        ``none`` and the sample of a record of no one sample (−1) are left out."""
        comp = "" if self.component == DEFAULT_COMPONENT else f"{self.component} "
        step = "before step 0" if self.step < 0 else f"step {self.step}"
        branch = f" {self.branch}" if names_one(self.branch) else ""
        sample = "" if self.sample < 0 else f" sample {self.sample}"
        if self.kind == "step":
            return f"{comp}{self.phase} {step}{branch} {self.op}{sample} ({self._rank_note()})"
        out = "" if self.index == 0 else f" out{self.index}"
        role = "" if self.role == "output" else f" {self.role}"
        block = block_words(self.block, self.blocks)
        stream = f" {self.stream}" if names_one(self.stream) else ""
        return (f"{comp}{self.phase} {step}{branch} {block}{stream} "
                f"{self.op}#{self.call}{out}{role}{sample} ({self._rank_note()})")
