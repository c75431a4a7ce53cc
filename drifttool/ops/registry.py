"""Operator registry and dispatch: every named RFC operator call goes through ``call``.

    >>> out = call(rt, "mlp_down_gemm", h, w, b, stream="img", layout="BS.")

``call`` picks the backend from the runtime mode, fails closed (``strict``) or records a fallback
(``audit``) when that backend is unavailable, records the call site in the operator trace, and
hands each output to the capture recorder with its identity (op name, stream, layout).

Backends register per (operator, backend) with a decorator, the way diffusers'
``attention_dispatch.py`` registers attention backends; constraint checks run on every call and
raise rather than drop an argument.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from drifttool.errors import UnsupportedConfigError
from drifttool.runtime import Mode, Runtime

BACKENDS = ("strict", "production")


@dataclass(frozen=True, kw_only=True)
class OpSpec:
    """Declaration of one RFC operator.

    Attributes:
        name: the RFC row name, e.g. ``"qk_rmsnorm"``.
        contract: arithmetic contract id, ``"qwenimage.<name>.v<k>"``; bump k when bytes change.
        differentiable: whether the operator has a backward (``flow_sigma_table`` does not).
        dtypes: input dtypes the strict backend accepts.
        summary: one line for the docs index.
    """

    name: str
    contract: str
    differentiable: bool
    dtypes: tuple[torch.dtype, ...]
    summary: str


@dataclass(frozen=True)
class _Impl:
    fn: Callable[..., Any]
    kernel: str


_SPECS: dict[str, OpSpec] = {}
_IMPLS: dict[tuple[str, str], _Impl] = {}


def declare(spec: OpSpec) -> OpSpec:
    if spec.name in _SPECS:
        raise ValueError(f"operator {spec.name!r} declared twice")
    _SPECS[spec.name] = spec
    return spec


def implements(name: str, backend: str, *, kernel: str) -> Callable[[Callable], Callable]:
    """Register ``fn`` as the ``backend`` implementation of operator ``name``.

    ``kernel`` is the kernel identity written to the trace (e.g. ``"cpu.tiled_bmm16.k128"``).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}")

    def deco(fn: Callable) -> Callable:
        if name not in _SPECS:
            raise ValueError(f"operator {name!r} is not declared")
        _IMPLS[(name, backend)] = _Impl(fn, kernel)
        return fn

    return deco


def spec(name: str) -> OpSpec:
    try:
        return _SPECS[name]
    except KeyError:
        raise UnsupportedConfigError(f"unknown operator {name!r}") from None


def specs() -> dict[str, OpSpec]:
    """All declared operators, by RFC name (import ``drifttool.ops`` first to populate)."""
    return dict(_SPECS)


def implementation(name: str, backend: str) -> Callable[..., Any]:
    """The raw implementation function, bypassing trace and capture (for tests and references)."""
    try:
        return _IMPLS[(name, backend)].fn
    except KeyError:
        raise UnsupportedConfigError(f"operator {name!r} has no {backend!r} backend") from None


def kernel_id(name: str, backend: str) -> str | None:
    """The kernel identity ``backend`` registers for operator ``name`` (None if unregistered)."""
    impl = _IMPLS.get((name, backend))
    return impl.kernel if impl else None


def _resolve(rt: Runtime, name: str) -> tuple[str, str, _Impl, str]:
    """Return (requested backend, actual backend, impl, fallback reason or "")."""
    requested = rt.mode.backend
    impl = _IMPLS.get((name, requested))
    reason = ""
    if impl is None:
        reason = f"no {requested} backend registered"
    elif (name, requested) in rt.unavailable:
        reason = f"{requested} backend marked unavailable"
    if not reason:
        return requested, requested, impl, ""
    if rt.mode is Mode.AUDIT:
        other = "production"
        fallback = _IMPLS.get((name, other))
        if fallback is not None and (name, other) not in rt.unavailable:
            return requested, other, fallback, reason
    raise UnsupportedConfigError(
        f"operator {name!r}: {reason} and mode {rt.mode.value!r} allows no fallback"
    )


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
        name: RFC operator name.
        stream: ``"img"``, ``"txt"``, ``"joint"`` or ``"none"`` (identity field).
        layout: axis tags of the output (one string per output for tuple outputs); see
            ``drifttool.capture.layout``. ``None`` captures nothing for that call.

    Raises:
        UnsupportedConfigError: the requested backend is missing or marked unavailable and the
            mode allows no fallback (``strict``, ``auto``, ``off``).
    """
    op = spec(name)
    if name in rt.variants:
        variant, fn = rt.variants[name]
        requested, actual, impl, reason = rt.mode.backend, f"variant:{variant}", _Impl(fn, f"variant:{variant}"), ""
    else:
        requested, actual, impl, reason = _resolve(rt, name)
    out = impl.fn(*args, **kwargs)
    rec = rt.recorder
    site = rt.site(name, stream)
    rt.trace.record(
        site=site,
        contract=op.contract,
        requested=requested,
        actual=actual,
        kernel=impl.kernel,
        fallback=bool(reason),
        reason=reason,
        declared=rt.mode is Mode.AUDIT,
    )
    if rec is not None and layout is not None and rt.mode.captures:
        outs = out if isinstance(out, tuple) else (out,)
        layouts = (layout,) if isinstance(layout, str) else tuple(layout)
        for i, (t, lay) in enumerate(zip(outs, layouts)):
            if lay is not None:
                rec.capture(site, t, lay, index=i)
    return out
