"""What declaring an operator and registering an implementation make: ``OpSpec`` (with its
``Decomposition``) and ``Impl``, an implementation behind its declared constraints.

    >>> impl.failed(args, kwargs)     # the first declared constraint this call fails, or None
    >>> impl.checked()(*args)         # fn, raising UnsupportedConfigError where one fails

The tables that hold them, registration and dispatch are ``drifttool.ops.registry``'s.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from drifttool.components import DEFAULT_COMPONENT
from drifttool.errors import UnsupportedConfigError
from drifttool.ops.binding import Binder
from drifttool.ops.constraints import Constraint


@dataclass(frozen=True)
class Decomposition:
    """An operator written as a sequence of finer declared operators.

    Attributes:
        ops: the finer operators, in call order.
        layouts: capture layout of each finer operator's output; an operator not listed gets the
            fused call's layout (the last one, whose output is the fused output).
        run: ``run(step, *args, **kwargs)`` with the fused operator's arguments; ``step(name,
            *args, **kwargs)`` dispatches one finer operator and returns its output.
    """

    ops: tuple[str, ...]
    layouts: dict[str, str]
    run: Callable[..., Any]


@dataclass(frozen=True, kw_only=True)
class OpSpec:
    """Declaration of one operator.

    Attributes:
        name: the RFC row name, e.g. ``"qk_rmsnorm"``.
        contract: arithmetic contract id, ``"qwenimage.<name>.v<k>"``; bump k when bytes change.
        differentiable: whether the operator has a backward (``flow_sigma_table`` does not).
        dtypes: input dtypes the strict family accepts (its implementations declare them as a
            constraint).
        summary: one line for the docs index.
        decomposition: the finer operators this one is equal to, if any (see module docstring).
        component: the model the operator belongs to (``artifact.schema.COMPONENTS``: the
            ``mmdit`` today, its sampler included; the RFC's Phase B declares the Qwen2.5-VL
            ``text_encoder`` and the ``vae`` operators beside it). Records carry the component
            of the scope they were captured in; ``specs(component=...)`` lists one model's.
    """

    name: str
    contract: str
    differentiable: bool
    dtypes: tuple[torch.dtype, ...]
    summary: str
    decomposition: Decomposition | None = None
    component: str = DEFAULT_COMPONENT


@dataclass(frozen=True)
class Impl:
    """One registered implementation.

    Attributes:
        op, family, device: its registry key (device type ``"cpu"`` / ``"cuda"``).
        fn: the function (the operator's call signature).
        kernel: kernel identity written to the trace; the device is recorded separately.
        constraints: declared constraints, the device constraint first.
        decomposable: byte-equal to the operator's declared decomposition, so dispatch may run
            the decomposition instead (to capture the internals).
        contract: the arithmetic contract id this implementation keeps, when it differs from the
            operator's (``OpSpec.contract``): e.g. the strict CUDA family's
            ``"qwenimage.<name>.cuda1"``. ``None``: the operator's. Written to the trace.
        internals: for a decomposable implementation, ``internals(scope, *args, **kwargs)`` runs
            ``fn``'s arithmetic and returns ``(output, {finer operator: row table})``: the row
            tables (``capture.gpu_rows.row_table``'s format) of the decomposition's outputs that
            are not the fused output, which dispatch then files as their records without running
            the decomposition (``ops.registry``); or ``None`` to run the decomposition after all.
    """

    op: str
    family: str
    device: str
    fn: Callable[..., Any]
    kernel: str
    constraints: tuple[Constraint, ...]
    decomposable: bool = False
    signature: inspect.Signature | None = field(default=None, compare=False, repr=False)
    contract: str | None = None
    internals: Callable[..., Any] | None = field(default=None, compare=False, repr=False)

    @functools.cached_property
    def binder(self) -> Binder:
        """How a call's arguments bind to ``fn``'s parameters (made at the first check)."""
        return Binder(self.signature or inspect.signature(self.fn))

    def failed(self, args: tuple, kwargs: dict[str, Any]) -> tuple[Constraint, str] | None:
        """The first constraint this call fails, with its reason; ``None`` if all pass.

        Raises:
            TypeError: the arguments do not fit the implementation's signature.
        """
        bound = self.binder.bind(args, kwargs)
        for c in self.constraints:
            why = c(bound)
            if why is not None:
                return c, why
        return None

    def checked(self) -> Callable[..., Any]:
        """``fn`` behind its declared constraints (raises ``UnsupportedConfigError``)."""

        def run(*args: Any, **kwargs: Any) -> Any:
            bad = self.failed(args, kwargs)
            if bad is not None:
                raise UnsupportedConfigError(constraint_message(self, *bad))
            return self.fn(*args, **kwargs)

        run.__name__ = getattr(self.fn, "__name__", self.op)
        run.__doc__ = self.fn.__doc__
        run.__wrapped__ = self.fn  # type: ignore[attr-defined]
        return run



def constraint_message(impl: Impl, c: Constraint, why: str) -> str:
    """The error of a failed declared constraint: operator, family, device, constraint, reason."""
    return (f"operator {impl.op!r}, family {impl.family!r}, device {impl.device!r}: "
            f"constraint {c.name!r} failed: {why}")

