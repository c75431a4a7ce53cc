"""Capture levels (design.md, "Digests"): part of the artifact's format (the manifest's
``capture_level``), a leaf module the schemas, the runtime and the run settings read.

``L0`` step records only; ``L1`` plus one digest per operator output and sample (a fused
operator's internal ``[B, H, S, S]`` tensors are not materialised for capture); ``L2`` plus row
digests and the fused operators' internals. (L3, full tensors, is not implemented.)

A run at L2 may leave the internals out (the run setting ``internals``, ``--no-internals``): the
joint attention's scores and probabilities are then not recorded, the rest of L2 is. At full
size they are the dearest part of an L2 capture (docs/benchmarks.md); ``drifttool diff
--localize`` captures them for the one drifting step it re-executes.
"""

LEVELS = ("L0", "L1", "L2")
"""The capture levels, coarsest first."""

INTERNALS_FROM = "L2"
"""The lowest capture level at which a fused operator's internal tensors are captured."""


def captures_internals(level: str | None) -> bool:
    """Whether capture at ``level`` takes the fused operators' internal tensors (``INTERNALS_FROM``
    or finer); False for no level or an unknown one."""
    return level in LEVELS and LEVELS.index(level) >= LEVELS.index(INTERNALS_FROM)
