"""Operator registry and dispatch: every named RFC operator call goes through ``call``.

The registry holds the declared operators (``OpSpec``) and their registered implementations
(``Impl``; both defined in ``drifttool.ops.declaration``).

    >>> out = call(rt, "mlp_down_gemm", h, w, b, stream="img", layout="BS.")

Registration. Implementations register per (operator, backend family, device type) with a
decorator, the way diffusers' ``attention_dispatch.py`` registers attention backends, each with
its **declared constraints** (``drifttool.ops.constraints``: device, dtypes, geometry):

    >>> @implements("qk_rmsnorm", "strict", device="cpu", kernel="tree_rmsnorm",
    ...             constraints=(dtypes(FLOATS, "x", "gain"),))

Families are open: ``"strict"`` and ``"production"`` are registered by ``drifttool.ops``; another
module may register e.g. a strict CUDA family (``implements(op, "strict", device="cuda", ...)``)
without touching the model or this file. Several implementations of one (operator, family,
device) are tried in registration order.

Resolution of one call (``resolve``):

1. the device type comes from the call's tensors (``constraints.devices``): all tensor arguments
   share one device, else ``UnsupportedConfigError``; a call without tensors runs on ``"cpu"``;
2. the runtime requests a family (``Runtime.family``, by default the mode's ``Mode.family``); the first registered implementation of
   that family for that device whose constraints all pass is used;
3. none passes: the mode's fallback family (``Mode.fallback``: ``audit`` → ``production``) is
   tried the same way and the fallback is recorded in the trace with its reason; without a
   fallback (``strict``, ``auto``, ``off``) dispatch fails closed with an error naming the
   operator, family, device and the failed constraint.

A probe's variant (``Runtime.variants``) replaces the implementation outright.

Decomposition. An operator may declare a decomposition into finer operators (``OpSpec.
decomposition``: ``joint_attention_fused`` = ``joint_attn_qk_gemm`` → ``joint_attn_softmax`` →
``joint_attn_av_gemm``). An implementation that declares itself byte-equal to it
(``implements(..., decomposable=True)``) is *expanded*: dispatch runs the decomposition's
operators one by one (each resolved, traced and captured under its own name) when the capture
sink wants internal tensors (``Runtime.wants_internals``: level ≥ L2) or a variant replaces
one of them. Otherwise (L0/L1, or a family whose fused kernel is not byte-equal, e.g. production
SDPA) the fused implementation runs; at L2 its trace entry notes that the internals were not
captured. A variant of the fused operator applies only when the fused operator runs (a probe
registers one variant per operator it may meet, e.g. ``joint_attn_softmax`` for strict at L2 and
``joint_attention_fused`` for production).

Trace and capture are separate steps after dispatch: ``_trace`` records the call site (family
requested and run, kernel, device, fallback), ``ops.sink.capture_outputs`` hands the outputs
to the recorder.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch

from drifttool.capture import produced
from drifttool.ops.sink import capture_outputs, capture_table, digests_wanted, internals_from_tables
from drifttool.components import COMPONENTS
from drifttool.errors import UnsupportedConfigError
from drifttool.ops.constraints import Constraint, devices, on_device
from drifttool.ops.declaration import Impl, OpSpec, constraint_message
from drifttool.runtime import Runtime

BUILTIN_FAMILIES = ("strict", "production")
"""The families ``drifttool.ops`` registers; others may be added by any module."""

DEVICES = ("cpu", "cuda")
"""Device types implementations may register for."""


@dataclass(frozen=True)
class Resolution:
    """What dispatch chose for one call: family requested and run, the implementation, the
    device type, and the fallback reason ("" when none)."""

    requested: str
    actual: str
    impl: Impl
    device: str
    reason: str = ""


_SPECS: dict[str, OpSpec] = {}
_IMPLS: dict[tuple[str, str, str], list[Impl]] = {}


def declare(spec: OpSpec) -> OpSpec:
    """Declare an operator (once).

    Raises:
        ValueError: declared twice, or its decomposition names an undeclared operator.
    """
    if spec.component not in COMPONENTS:
        raise ValueError(f"operator {spec.name!r}: unknown component {spec.component!r} "
                         f"(one of {', '.join(COMPONENTS)})")
    if spec.name in _SPECS:
        raise ValueError(f"operator {spec.name!r} declared twice")
    if spec.decomposition is not None:
        missing = [op for op in spec.decomposition.ops if op not in _SPECS]
        if missing:
            raise ValueError(f"operator {spec.name!r}: decomposition names undeclared {missing}")
    _SPECS[spec.name] = spec
    return spec


def implements(
    name: str,
    family: str,
    *,
    kernel: str,
    device: str | tuple[str, ...] = "cpu",
    constraints: tuple[Constraint, ...] = (),
    decomposable: bool = False,
    contract: str | None = None,
    internals: Callable[..., Any] | None = None,
) -> Callable[[Callable], Callable]:
    """Register ``fn`` as the ``family`` implementation of operator ``name`` on ``device``.

    Args:
        name: a declared operator.
        family: backend family, e.g. ``"strict"`` or ``"production"`` (open set).
        kernel: kernel identity written to the trace (no device prefix: the trace records the
            device separately), e.g. ``"tree_rmsnorm"``.
        device: device type(s) ``fn`` runs on; one implementation is registered per device, each
            with the ``constraints.on_device`` constraint first.
        constraints: further declared constraints (dtypes, geometry), checked on every call.
        decomposable: ``fn`` is byte-equal to the operator's declared decomposition.
        contract: the contract id ``fn`` keeps when it is not the operator's (``Impl.contract``).
        internals: the internal outputs' row tables from one run of ``fn``'s arithmetic
            (``Impl.internals``); only with ``decomposable``.

    Raises:
        ValueError: undeclared operator, unknown device, a constraint reading a parameter ``fn``
            lacks, or ``decomposable`` for an operator without a decomposition.
    """
    devs = (device,) if isinstance(device, str) else tuple(device)
    unknown = [d for d in devs if d not in DEVICES]
    if unknown or not devs:
        raise ValueError(f"unknown device type(s) {unknown or devs!r}; expected some of {DEVICES}")

    def deco(fn: Callable) -> Callable:
        if name not in _SPECS:
            raise ValueError(f"operator {name!r} is not declared")
        if decomposable and _SPECS[name].decomposition is None:
            raise ValueError(f"operator {name!r} declares no decomposition to be byte-equal to")
        sig = inspect.signature(fn)
        for c in constraints:
            missing = [p for p in c.params if p not in sig.parameters]
            if missing:
                raise ValueError(f"{name} ({family}): constraint {c.name!r} reads {missing}, "
                                 f"not parameters of {fn.__name__}")
        for d in devs:
            impl = Impl(name, family, d, fn, kernel, (on_device(d), *constraints), decomposable, sig,
                        contract, internals if decomposable else None)
            _IMPLS.setdefault((name, family, d), []).append(impl)
        return fn

    return deco


def spec(name: str) -> OpSpec:
    try:
        return _SPECS[name]
    except KeyError:
        raise UnsupportedConfigError(f"unknown operator {name!r}") from None


def specs(component: str | None = None) -> dict[str, OpSpec]:
    """The declared operators (of ``component``, or all), by RFC name (import ``drifttool.ops``
    first to populate)."""
    return {n: s for n, s in _SPECS.items() if component is None or s.component == component}


def impls(name: str, family: str, device: str = "cpu") -> list[Impl]:
    """The implementations registered for (operator, family, device), in registration order."""
    return list(_IMPLS.get((name, family, device), ()))


def families(name: str | None = None) -> list[str]:
    """Families with at least one implementation (of operator ``name``), in registration order."""
    return list(dict.fromkeys(f for (op, f, _) in _IMPLS if name is None or op == name))


def _first(name: str, family: str, device: str) -> Impl:
    found = _IMPLS.get((name, family, device))
    if not found:
        raise UnsupportedConfigError(f"operator {name!r} has no {family!r} implementation for device {device!r}")
    return found[0]


def implementation(name: str, backend: str, device: str = "cpu") -> Callable[..., Any]:
    """The first registered (``backend`` family, ``device``) implementation, bypassing trace and
    capture but not its declared constraints (for tests and references).

    Raises:
        UnsupportedConfigError: nothing registered; (when called) a declared constraint fails.
    """
    return _first(name, backend, device).checked()


def kernel_id(name: str, backend: str, device: str = "cpu") -> str | None:
    """The kernel identity of the first (``backend`` family, ``device``) implementation of
    ``name`` (None if unregistered)."""
    found = _IMPLS.get((name, backend, device))
    return found[0].kernel if found else None


# ---------------------------------------------------------------------------------------------
# resolution


def call_device(name: str, args: tuple, kwargs: dict[str, Any]) -> str:
    """The device type of a call: that of its tensor arguments (``"cpu"`` without tensors).

    Raises:
        UnsupportedConfigError: tensor arguments on more than one device type.
    """
    found = devices((*args, *kwargs.values()))
    if len(found) > 1:
        raise UnsupportedConfigError(
            f"operator {name!r}: tensor arguments on more than one device ({', '.join(sorted(found))}); "
            "move them to one device first")
    return found.pop() if found else "cpu"


def _select(rt: Runtime, name: str, family: str, device: str, args: tuple,
            kwargs: dict[str, Any]) -> tuple[Impl | None, str]:
    """The first ``family`` implementation on ``device`` whose constraints pass, or why none."""
    if (name, family) in rt.unavailable:
        return None, f"operator {name!r}, family {family!r}, device {device!r}: marked unavailable"
    found = _IMPLS.get((name, family, device))
    if not found:
        return None, f"operator {name!r}: no {family!r} implementation for device {device!r}"
    reasons = []
    for impl in found:
        bad = impl.failed(args, kwargs)
        if bad is None:
            return impl, ""
        reasons.append(constraint_message(impl, *bad))
    return None, "; ".join(reasons)


def resolve(rt: Runtime, name: str, args: tuple, kwargs: dict[str, Any]) -> Resolution:
    """Pick the implementation of one call (module docstring, "Resolution").

    Raises:
        UnsupportedConfigError: mixed devices; or no implementation of the requested family
            passes and the mode has no fallback (or the fallback has none either).
    """
    device = call_device(name, args, kwargs)
    requested = rt.family
    impl, reason = _select(rt, name, requested, device, args, kwargs)
    if impl is not None:
        return Resolution(requested, requested, impl, device)
    fallback = rt.mode.fallback
    if fallback is not None:
        alt, alt_reason = _select(rt, name, fallback, device, args, kwargs)
        if alt is not None:
            return Resolution(requested, fallback, alt, device, reason)
        reason = f"{reason}; fallback: {alt_reason}"
    raise UnsupportedConfigError(
        f"{reason} (mode {rt.mode.value!r} allows {'no fallback' if fallback is None else 'no further fallback'})"
    )


def _variant(rt: Runtime, name: str, args: tuple, kwargs: dict[str, Any]) -> Resolution:
    variant, fn = rt.variants[name]
    actual = f"variant:{variant}"
    impl = Impl(name, actual, call_device(name, args, kwargs), fn, actual, ())
    return Resolution(rt.family, actual, impl, impl.device)


def _wants_decomposition(rt: Runtime, op: OpSpec) -> bool:
    """The capture sink wants ``op``'s internals, or a variant replaces one of its finer ops."""
    dec = op.decomposition
    return dec is not None and (rt.wants_internals() or any(o in rt.variants for o in dec.ops))


def _expands(rt: Runtime, op: OpSpec, res: Resolution) -> bool:
    """Run ``op``'s decomposition instead of ``res``: the implementation declares itself
    byte-equal to it and the decomposition is wanted."""
    return res.impl.decomposable and _wants_decomposition(rt, op)


def _family_expands(rt: Runtime, op: OpSpec, args: tuple, kwargs: dict[str, Any]) -> bool:
    """The requested family would expand ``op`` here: then the fused operator itself does not
    run, and a variant of it does not apply (as a variant of an operator never called)."""
    if not _wants_decomposition(rt, op):
        return False
    impl, _ = _select(rt, op.name, rt.family, call_device(op.name, args, kwargs), args, kwargs)
    return impl is not None and impl.decomposable


# ---------------------------------------------------------------------------------------------
# the call: dispatch, trace, capture hand-off


def _dispatch(rt: Runtime, op: OpSpec, args: tuple, kwargs: dict[str, Any]) -> Resolution:
    """The probe's variant of ``op`` if it has one and ``op`` itself runs, else ``resolve``."""
    if op.name in rt.variants and not _family_expands(rt, op, args, kwargs):
        return _variant(rt, op.name, args, kwargs)
    return resolve(rt, op.name, args, kwargs)


def _placed(res: Resolution, args: tuple, kwargs: dict[str, Any]) -> str:
    """The device the call ran on, with its index (``"cuda:0"``): that of its first tensor
    argument of the resolved device type; the type alone when it has none (``"cpu"``)."""
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor) and v.device.type == res.device:
            return str(v.device)
    return res.device


def _trace(rt: Runtime, site: dict[str, Any], op: OpSpec, res: Resolution, device: str,
           expanded: bool = False) -> None:
    """Record the call site: contract, family requested and run, kernel, device (``_placed``),
    fallback; for a fused operator whose internals the sink wanted, a note saying whether it ran
    as its decomposition (``expanded``) or fused."""
    note = ""
    if expanded:
        note = f"run as its decomposition {'/'.join(op.decomposition.ops)} to capture the internals"
    elif op.decomposition is not None and rt.wants_internals():
        note = (f"internals {'/'.join(op.decomposition.ops)} not captured: {res.actual} declares no "
                "byte-equal decomposition")
    rt.trace.record(
        site=site,
        contract=res.impl.contract or op.contract,
        requested=res.requested,
        actual=res.actual,
        kernel=res.impl.kernel,
        fallback=bool(res.reason),
        reason=res.reason or note,
        declared=rt.mode.fallback is not None,
        device=device,
    )


def _decomposed(rt: Runtime, op: OpSpec, stream: str, layout: Any, args: tuple,
                kwargs: dict[str, Any]) -> Any:
    """Run ``op``'s decomposition; each of its calls is traced and captured as an ``internal``
    record under its own name."""
    dec = op.decomposition
    assert dec is not None

    def step(name: str, *a: Any, **kw: Any) -> Any:
        return _call(rt, spec(name), a, kw, stream, dec.layouts.get(name, layout), "internal")

    return dec.run(step, *args, **kwargs)


def _from_tables(rt: Runtime, op: OpSpec, res: Resolution, stream: str, layout: Any, args: tuple,
                 kwargs: dict[str, Any]) -> Any:
    """``_decomposed``'s trace and records without running the decomposition: the fused
    implementation computes the output and the row tables of the internal outputs
    (``Impl.internals``), never storing those; each finer operator is dispatched (for its trace
    entry) on stand-ins of its inputs and its records are filed from its table
    (``sink.capture_table``), the last one's (the fused output's) from the output itself."""
    got = res.impl.internals(rt.current_scope(), *args, **kwargs)
    if got is None:  # the implementation declines here: the decomposition runs
        return _decomposed(rt, op, stream, layout, args, kwargs)
    out, tables = got
    dec = op.decomposition

    def step(name: str, *a: Any, **kw: Any) -> Any:
        fine = spec(name)
        res_i = _dispatch(rt, fine, a, kw)
        site = rt.site(name, stream)
        _trace(rt, site, fine, res_i, _placed(res_i, a, kw))
        lay = dec.layouts.get(name, layout)
        if name in tables:
            table, like = tables[name]
            if lay is not None and rt.recorder is not None:
                capture_table(rt, site, like, table, lay, "internal")
            return like
        capture_outputs(rt, site, out, lay, "internal")
        return out

    return dec.run(step, *args, **kwargs)


def _wants_grad(args: tuple, kwargs: dict[str, Any]) -> bool:
    """Autograd records this call (a tensor argument requires a gradient)."""
    return torch.is_grad_enabled() and any(isinstance(v, torch.Tensor) and v.requires_grad
                                           for v in (*args, *kwargs.values()))


def _call(rt: Runtime, op: OpSpec, args: tuple, kwargs: dict[str, Any], stream: str,
          layout: Any, role: str) -> Any:
    res = _dispatch(rt, op, args, kwargs)
    expanded = _expands(rt, op, res)
    if expanded:
        # the internals first (their records precede the fused one in program order, so a
        # drift born in the scores is named there), then the fused operator's own record: the
        # records of an L1 run are a subset of the L2 run's
        tables = res.impl.internals is not None and internals_from_tables(rt) and not _wants_grad(args, kwargs)

        def run(*a: Any, **kw: Any) -> Any:
            if tables:  # the fused kernel's own tables of the internals: the same records
                return _from_tables(rt, op, res, stream, layout, a, kw)
            return _decomposed(rt, op, stream, layout, a, kw)
    else:
        run = res.impl.fn
    plan = rt.plan if role == "output" else None  # a decomposition runs inside its fused call's rules
    # its producing kernels may digest what they store; a nested call that is not captured
    # clears an enclosing call's mark for its own kernels
    want = digests_wanted(rt, layout)
    token = produced.producing(want) if want or produced.marked() else None
    try:
        out = run(*args, **kwargs) if plan is None else plan.call(rt, op.name, stream, run, args, kwargs)
    finally:
        if token is not None:
            produced.done(token)
    site = rt.site(op.name, stream)
    _trace(rt, site, op, res, _placed(res, args, kwargs), expanded=expanded)
    capture_outputs(rt, site, out, layout, role)
    return out


def call(
    rt: Runtime,
    name: str,
    *args: Any,
    stream: str = "none",
    layout: str | tuple[str, ...] | None = None,
    **kwargs: Any,
) -> Any:
    """Run operator ``name`` under runtime ``rt``; trace the call site and capture its outputs.

    Args:
        rt: the runtime (mode, recorder, trace).
        name: operator name.
        stream: ``"img"``, ``"txt"``, ``"joint"`` or ``"none"`` (identity field).
        layout: axis tags of the output (one string per output for tuple outputs); see
            ``drifttool.capture.layout``. ``None`` captures nothing for that call.

    Raises:
        UnsupportedConfigError: tensors on several devices, or no implementation of the requested
            family passes its declared constraints (or is marked unavailable) and the mode
            allows no fallback (``strict``, ``auto``, ``off``).
    """
    return _call(rt, spec(name), args, kwargs, stream, layout, "output")
