"""The diff result as data: verdict, first drift (``drifttool.diff.location``), per-step drift.
``to_json`` for machines.

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

from drifttool.artifact.schema import DEFAULT_COMPONENT, names_one, short_site
from drifttool.diff.location import FirstDrift
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


LEVEL_COVERS = {"L0": "step boundaries only",
                "L1": "step records and operator outputs, without row digests",
                "L2": "step records, operator outputs and their row digests"}
"""What a verdict at each common capture level covers (``DiffReport.covers``)."""


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
    component: str = DEFAULT_COMPONENT
    blocks: int | None = None
    """The number of blocks of ``component`` where run A's manifest records it
    (``schema.model_blocks``): a record after the last block is said so (``after b1``)."""

    def __str__(self) -> str:
        """``cond b0 img qk_rmsnorm#1 s0``: a branch or stream ``none`` and the sample of no one
        sample (−1) left out, as ``FirstDrift.where`` leaves them out."""
        branch = [self.branch] if names_one(self.branch) else []
        sample = [] if self.sample < 0 else [f"s{self.sample}"]
        return " ".join([*branch, short_site(self.block, self.stream, self.op, self.call, self.blocks),
                         *sample])


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
    """Records compared in one table (``ops`` or ``steps``): ``a`` and ``b`` records in each
    run; ``matched`` pairs of records with the same identity in both (equal or not), of which
    ``differ`` have different digests; ``only_a`` and ``only_b`` records without a partner."""

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
        are all within it exits 0, and a pair the profile cannot judge (records in one run only,
        differing replay inputs) exits 1 even when its common records are identical. A semantic
        mismatch (the runs are different programs) exits 1 whatever the bytes say, tolerance or
        not; incomparable and inconclusive (an incomplete run) stay 3."""
        if self.verdict in (Verdict.IDENTICAL, Verdict.DRIFT) and (
                (self.semantic is not None and self.semantic.mismatch)
                or (self.tolerance is not None and not self.tolerance.ok)):
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
