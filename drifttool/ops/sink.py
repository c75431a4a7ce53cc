"""Capture hand-off between dispatch and the recorder: which outputs of a call are captured, and
under which role.

    >>> from drifttool.ops.sink import capture_outputs
    >>> capture_outputs(rt, site, out, "BS.")        # called by ops.registry.call after dispatch

Dispatch (``drifttool.ops.registry``) decides nothing about capture; it hands each call's site and
outputs here. Levels (design.md, "Digests"): at ``L0`` and ``L1`` a fused operator's internal
tensors (the attention's ``[B, H, S, S]`` scores and probabilities) are not materialised for
capture; from ``L2`` on they are wanted (``Runtime.wants_internals``), and a family that
declares its fused implementation byte-equal to the operator's decomposition runs the
decomposition so each internal operator is captured under its own name (role ``internal``).
It sits with dispatch, above the runtime whose mode, recorder and parallel plan it reads; the
recorder it hands to (``drifttool.capture.recorder``) is below both.
"""

from __future__ import annotations

from typing import Any

from drifttool.runtime import Runtime


def capture_outputs(
    rt: Runtime, site: dict[str, Any], out: Any, layout: str | tuple[str | None, ...] | None,
    role: str = "output",
) -> None:
    """Hand the outputs of one call to the recorder, each with its layout.

    Args:
        rt: the runtime (mode, recorder).
        site: ``Runtime.site(op, stream)`` of the call.
        out: a tensor, or a tuple of tensors for a tuple-returning operator.
        layout: axis tags of the output, one string per output for tuple outputs (``None``
            entries are skipped); ``None`` captures nothing for this call.
        role: ``output``, or ``internal`` for a fused operator's internal tensors (the calls of
            its decomposition, captured at L2).
    """
    if layout is None or not rt.mode.captures or rt.recorder is None \
            or getattr(rt.recorder, "level", None) == "L0":
        return
    outs = out if isinstance(out, tuple) else (out,)
    layouts = (layout,) if isinstance(layout, str) else tuple(layout)
    if rt.plan is not None:  # the logical tensors' digests, on the owning rank only
        got = rt.plan.for_capture(rt, site, out, layouts, keep_rows=rt.recorder.level == "L2")
        for i, item in enumerate(got or ()):
            if item is not None:  # digested from every rank's partials, with their checks
                parts, checks = item
                rt.recorder.capture_digested(site, parts, index=i, role=role, ranks=checks)
        return
    for i, (t, lay) in enumerate(zip(outs, layouts)):
        if lay is not None:
            rt.recorder.capture(site, t, lay, index=i, role=role)
