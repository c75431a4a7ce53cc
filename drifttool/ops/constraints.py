"""Declared constraints of an operator implementation, checked by dispatch on every call.

    >>> @implements("qk_rmsnorm", "strict", device="cpu", kernel="tree_rmsnorm",
    ...             constraints=(dtypes((torch.float32, torch.bfloat16), "x", "gain"),))

A constraint is a named predicate over one call's arguments, bound to the implementation's
signature (``{parameter name: value}``, defaults applied). It returns ``None`` when the call is
supported and otherwise a reason string; dispatch names the failed constraint and its reason
when it fails closed (``drifttool.ops.registry``). Every implementation carries the device
constraint of the device it is registered for (``on_device``), added by ``implements``.

Tensor arguments are the top-level ``torch.Tensor`` values of the call. A 0-dim CPU tensor next to
tensors of another device counts as a scalar (as torch's own operators treat it), e.g. a sigma
from the CPU sigma table passed with CUDA latents.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch

from drifttool.errors import UnsupportedConfigError

Args = Mapping[str, Any]
"""One call's arguments by parameter name (``inspect.BoundArguments.arguments``, defaults applied)."""


@dataclass(frozen=True)
class Constraint:
    """A named predicate: ``test(args)`` returns ``None`` (supported) or why not.

    Attributes:
        name: what is required, in a few words (e.g. ``"device cpu"``); shown in errors and docs.
        test: the predicate over the call's bound arguments.
        params: the parameter names ``test`` reads; ``implements`` checks that the
            implementation has them (a misspelt name would otherwise pass silently).
    """

    name: str
    test: Callable[[Args], str | None]
    params: tuple[str, ...] = ()

    def __call__(self, args: Args) -> str | None:
        return self.test(args)


def tensors(values: Any) -> Iterator[torch.Tensor]:
    """The top-level tensors among ``values`` (an iterable of argument values)."""
    return (v for v in values if isinstance(v, torch.Tensor))


def devices(values: Any) -> set[str]:
    """Device types (``"cpu"``, ``"cuda"``) of the tensors among ``values``; 0-dim CPU tensors
    count only when no other device is present (they are scalars to torch)."""
    found: set[str] = set()
    cpu_scalar = False
    for v in values:  # one pass: dispatch asks this of every operator call, twice
        if isinstance(v, torch.Tensor):
            kind = v.device.type
            if kind == "cpu" and v.dim() == 0:
                cpu_scalar = True
            else:
                found.add(kind)
    if cpu_scalar and not found:
        found.add("cpu")
    return found


def on_device(kind: str) -> Constraint:
    """Every tensor argument lives on device type ``kind`` (0-dim CPU scalars excepted)."""

    def test(args: Args) -> str | None:
        other = devices(args.values()) - {kind}
        return None if not other else f"tensor arguments on {', '.join(sorted(other))}"

    return Constraint(f"device {kind}", test)


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def dtypes(allowed: tuple[torch.dtype, ...], *names: str) -> Constraint:
    """The tensors named ``names`` (``None`` allowed) have a dtype in ``allowed``.

    Without ``names``: every floating-point tensor argument.
    """
    label = "|".join(_dtype_name(d) for d in allowed)
    where = f" of ({', '.join(names)})" if names else ""

    def test(args: Args) -> str | None:
        if names:
            picked = [(n, args.get(n)) for n in names]
        else:
            picked = [(n, v) for n, v in args.items()
                      if isinstance(v, torch.Tensor) and v.is_floating_point()]
        for n, t in picked:
            if isinstance(t, torch.Tensor) and t.dtype not in allowed:
                return f"{n} has dtype {_dtype_name(t.dtype)}, supported dtypes ({', '.join(map(_dtype_name, allowed))})"
        return None

    return Constraint(f"dtypes {label}{where}", test, names)


def key_mask_fits(ref: str, *, seq_axis: int = 1) -> Constraint:
    """``key_mask`` is ``None`` or a bool ``[B, S]`` tensor, B = ``args[ref].shape[0]`` and
    S = ``args[ref].shape[seq_axis]`` (the joint [text, image] key axis)."""

    def test(args: Args) -> str | None:
        mask, t = args.get("key_mask"), args[ref]
        if mask is None:
            return None
        want = (t.shape[0], t.shape[seq_axis])
        if mask.dtype != torch.bool:
            return f"key_mask must be bool, got {_dtype_name(mask.dtype)}"
        if tuple(mask.shape) != want:
            return f"key_mask must be [B, S] = {list(want)}, got {list(mask.shape)}"
        return None

    return Constraint(f"key_mask [B, S] bool of {ref}", test, ("key_mask", ref))


def text_len_fits(ref: str, *, seq_axis: int = 1) -> Constraint:
    """``text_len`` (the padded text length: where image keys start in the joint [text, image]
    sequence; strict contract v2 blocks text and image keys separately) is ``None`` or an int in
    ``[0, S]``, S = ``args[ref].shape[seq_axis]``."""

    def test(args: Args) -> str | None:
        n, s = args.get("text_len"), args[ref].shape[seq_axis]
        if n is None:
            return None
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= s:
            return f"text_len must be an int in [0, {s}], got {n!r}"
        return None

    return Constraint(f"text_len in [0, S] of {ref}", test, ("text_len", ref))


def require_dtype(name: str, what: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    """Refuse a tensor argument ``what`` of operator ``name`` whose dtype the strict kernel does
    not take (checks a kernel makes itself, inside one call, beside its declared constraints).

    Raises:
        UnsupportedConfigError: naming the operator, the argument, its dtype and ``allowed``.
    """
    if t.dtype not in allowed:
        raise UnsupportedConfigError(f"{name}: {what} has dtype {t.dtype}, strict supports {tuple(allowed)}")
