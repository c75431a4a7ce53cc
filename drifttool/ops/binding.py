"""Binding one call's arguments to an implementation's parameters, on every dispatched call.

    >>> binder = Binder(inspect.signature(fn))
    >>> binder.bind((x, w), {"b": None})        # {"x": x, "w": w, "b": None, ...defaults}

Equal to ``sig.bind(*args, **kwargs)`` followed by ``apply_defaults()`` (its ``arguments``: every
parameter, in signature order), at a fraction of the cost: dispatch binds each operator call to
check its constraints, and a strict CUDA forward makes ~1,600 calls, so ``inspect``'s binding was
a visible share of the host time that leaves the GPU waiting. The fast path covers signatures
of positional-or-keyword and keyword-only parameters; any other signature, and any call that
does not fit (too many arguments, an unknown or repeated keyword, a missing one), goes through
``inspect``, so its ``TypeError`` is ``inspect``'s own.
"""

from __future__ import annotations

import inspect
from typing import Any

_FAST_KINDS = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


class Binder:
    """A signature's binding plan (see the module docstring)."""

    __slots__ = ("_sig", "_names", "_known", "_positional", "_defaults", "_fast")

    def __init__(self, sig: inspect.Signature) -> None:
        params = list(sig.parameters.values())
        self._sig = sig
        self._names = tuple(p.name for p in params)
        self._known = frozenset(self._names)
        self._positional = sum(1 for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)
        self._defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
        self._fast = all(p.kind in _FAST_KINDS for p in params) and all(
            p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params[: self._positional])

    def _slow(self, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        bound = self._sig.bind(*args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)

    def bind(self, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        """``{parameter: value}`` of one call, defaults applied, in signature order.

        Raises:
            TypeError: the arguments do not fit the signature (``inspect``'s message).
        """
        if not self._fast or len(args) > self._positional:
            return self._slow(args, kwargs)
        out = dict(zip(self._names, args))
        for k, v in kwargs.items():
            if k in out or k not in self._known:
                return self._slow(args, kwargs)
            out[k] = v
        if len(out) == len(self._names) and not kwargs:
            return out
        for n in self._names[len(args):]:
            if n not in out:
                if n not in self._defaults:
                    return self._slow(args, kwargs)
                out[n] = self._defaults[n]
        return {n: out[n] for n in self._names}
