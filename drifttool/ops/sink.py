"""Capture hand-off between a call and the recorder: which outputs of a call are captured, under
which role, and on which rank.

    >>> from drifttool.ops.sink import capture_outputs, record_external
    >>> capture_outputs(rt, site, out, "BS.")        # called by ops.registry.call after dispatch
    >>> record_external(rt, "qk_rmsnorm", "img", q, "BS..", contract="qwenimage.qk_rmsnorm.v2",
    ...                 actual="diffusers", kernel="diffusers:transformer_blocks.3.attn.norm_q",
    ...                 block=3)                     # a runtime adapter's hook (drifttool.adapters)

Dispatch (``drifttool.ops.registry``) decides nothing about capture; it hands each call's site and
outputs here. A tensor another runtime computed (diffusers, vllm-omni, SGLang, seen through forward
hooks) enters through ``record_external``, which writes the same trace entry and digest records a
registry call writes, through the same ``capture_outputs``.

Levels (design.md, "Digests"): at ``L0`` and ``L1`` a fused operator's internal tensors (the
attention's ``[B, H, S, S]`` scores and probabilities) are not materialised for capture; from
``L2`` on they are wanted (``Runtime.wants_internals``), and a family that declares its fused
implementation byte-equal to the operator's decomposition runs the decomposition so each
internal operator is captured under its own name (role ``internal``).
It sits with dispatch, above the runtime whose mode, recorder and parallel plan it reads; the
recorder it hands to (``drifttool.capture.recorder``) is below both.
"""

from __future__ import annotations

import contextlib
from typing import Any

from drifttool.capture.digest_rows import pending_rows
from drifttool.capture.layout import table_parts
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


def internals_from_tables(rt: Runtime) -> bool:
    """Whether a fused operator's internal outputs may be filed from row tables its kernel wrote
    (``Impl.internals``): capture at L2 into a recorder that files digests made elsewhere, no
    parallel plan, no probe variants (a variant of a finer operator needs it to run)."""
    rec = rt.recorder
    return (rt.mode.captures and rec is not None and getattr(rec, "level", None) == "L2" and rt.plan is None
            and not rt.variants and callable(getattr(rec, "capture_digested", None)))


def capture_table(rt: Runtime, site: dict[str, Any], like: Any, table: Any, layout: str,
                  role: str = "output") -> None:
    """File the records of an output that was never stored, from the row table the kernel that
    computed it wrote (``layout.table_parts``: its canonical parts as row ranges; ``like``: a
    tensor of its shape and dtype, e.g. a zero-stride stand-in)."""
    keep = rt.recorder.level == "L2"
    parts = [(p, pending_rows(table, like.dtype, p.shape, p.ranges, keep_rows=keep and p.row_axis is not None))
             for p in table_parts(site, tuple(like.shape), layout)]
    rt.recorder.capture_digested(site, parts, index=0, role=role)


def digests_wanted(rt: Runtime, layout: Any) -> bool:
    """Whether ``capture_outputs`` will digest this call's outputs on this rank as they lie (a
    capturing recorder above L0 and no parallel plan): its producing kernels may then write the
    digests' row tables themselves (``capture.produced``)."""
    return (layout is not None and rt.mode.captures and rt.recorder is not None and rt.plan is None
            and getattr(rt.recorder, "level", None) != "L0")


def record_external(
    rt: Runtime, op: str, stream: str, out: Any, layout: str | tuple[str | None, ...], *,
    contract: str, actual: str, kernel: str, reason: str = "", declared: bool = False,
    **fields: Any,
) -> dict[str, Any]:
    """Record one call of operator ``op`` that ran outside drifttool's operator registry, as
    ``ops.registry.call`` records its own: one call of the site in the operator trace
    (``OperatorTrace.record``: requested family ``rt.family``, backend ``actual``, no fallback)
    and the outputs handed to ``capture_outputs`` (digest records at the runtime's capture
    level; under a parallel plan, ``rt.plan`` decides what this rank records, a collective:
    every rank records the same calls in the same order).

    Args:
        rt: the runtime (scope, trace, recorder, plan).
        op: the RFC operator name. stream: ``img``, ``txt``, ``joint`` or ``none``.
        out: the call's output tensor, or a tuple of them. layout: as ``capture_outputs``.
        contract: the operator's arithmetic contract id (``ops.registry.spec(op).contract``).
        actual: the runtime that computed it (e.g. ``"diffusers"``). kernel: its kernel
            identity for the trace (e.g. the module path).
        reason, declared: the trace entry's ``reason`` and ``declared`` (a path the runtime
            chose by a rule it declares, e.g. a fused kernel above a token threshold).
        fields: identity fields of this call alone (``Runtime.site``), e.g. ``block=3``; under a
            parallel plan they are in scope while the plan decides.

    Returns:
        the call's site (``Runtime.site``).
    """
    site = rt.site(op, stream, **fields)
    first = out[0] if isinstance(out, tuple) else out
    rt.trace.record(site=site, contract=contract, requested=rt.family, actual=actual,
                    kernel=kernel, fallback=False, reason=reason, declared=declared,
                    device=str(first.device))
    with rt.scope(**fields) if rt.plan is not None and fields else contextlib.nullcontext():
        capture_outputs(rt, site, out, layout)
    return site
