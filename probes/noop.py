"""Whether a probe's one change is a no-op on the baseline's weights and inputs.

    >>> w = NoOpWitness("qk_rmsnorm", QKNormNoGain())      # wraps the variant for one run
    >>> execute(dataclasses.replace(spec, variants={"qk_rmsnorm": ("qk_norm_no_gain", w)}), out)
    >>> w.changed, w.checked                                   # (False, 24): gains all 1.0
    >>> weights_unchanged(checkpoint, swap_stream_qkv)         # False: the weights move

A probe whose change moves no byte proves nothing: its mismatch cannot drift, and an invariant
control whose change is empty controls nothing. Examples: ``qk_norm_no_gain`` on a model whose
Q/K RMSNorm gains are all exactly 1.0 (a freshly initialised diffusers model), a checkpoint
transform that maps the weights onto themselves. The probe matrix reports such a probe as
``NOT APPLICABLE`` with the reason (``probes.runner``), neither a pass nor a finding. The check is
made on the bytes, never on the probe's declaration:

- an operator variant: every call of the variant in the probe run also runs the operator the run
  would have called (the variant's ``base``, else the implementation dispatch picks for the call:
  ``variants.dispatched``, by the call's device) on the same arguments; the change is a no-op when
  every output is byte-equal (dtype, shape and raw bytes, so ±0 and NaN payloads count), at every
  call site of the run. Once one
  call differs no further call is checked.
- a checkpoint transform: the transformed state dict holds the same names with byte-equal
  tensors (``weights_unchanged``).

Probes with their own execution (replay, training recompute, distributed layouts) and ``RunSpec``
field changes are not checked here: their change is not one operator or one state dict.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from drifttool.errors import UnsupportedConfigError
from drifttool.probes.variants import dispatched
from drifttool.probes.weights import load_state


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def same_bytes(a: Any, b: Any) -> bool:
    """Whether two operator outputs are the same bytes: tensors by dtype, shape, device type and
    raw bytes; tuples, lists and dicts element by element; anything else by ``==``."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape or a.device.type != b.device.type:
            return False
        return bool(torch.equal(_raw(a), _raw(b)))
    if isinstance(a, (tuple, list)):
        return (isinstance(b, (tuple, list)) and len(a) == len(b)
                and all(same_bytes(x, y) for x, y in zip(a, b)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_bytes(a[k], b[k]) for k in a)
    return a == b


class NoOpWitness:
    """An operator variant wrapped so that each call is compared with the operator the run would
    have called, on the same arguments (module docstring). Returns the variant's output.

    Attributes:
        op, name: the operator and the variant's name.
        checked: calls compared (every call until the first difference).
        changed: whether some call's output differed from the operator's.
        unchecked: calls that could not be compared (no implementation to compare with).
    """

    def __init__(self, op: str, name: str, variant: Callable[..., Any]) -> None:
        self.op, self.name, self.variant = op, name, variant
        self.rt: Any = None
        self.checked = 0
        self.changed = False
        self.unchecked = 0

    def bind_runtime(self, rt: Any) -> None:
        bind = getattr(self.variant, "bind_runtime", None)
        if callable(bind):
            bind(rt)
        self.rt = rt

    def _reference(self) -> Callable[..., Any] | None:
        base = getattr(self.variant, "base", None)
        if callable(base):
            return base
        if self.rt is None:
            return None
        return dispatched(self.rt, self.op)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.variant(*args, **kwargs)
        if self.changed:
            return out
        ref = self._reference()
        if ref is None:
            self.unchecked += 1
            return out
        try:
            expected = ref(*args, **kwargs)
        except UnsupportedConfigError:  # nothing to compare with: not proven a no-op
            self.unchecked += 1
            return out
        self.checked += 1
        if not same_bytes(out, expected):
            self.changed = True
        return out


def wrap_variants(variants: dict[str, tuple[str, Callable[..., Any]]]
                  ) -> tuple[dict[str, tuple[str, NoOpWitness]], list[NoOpWitness]]:
    """``RunSpec.variants`` with each variant wrapped in a ``NoOpWitness``, and the witnesses."""
    wrapped = {op: (name, NoOpWitness(op, name, fn)) for op, (name, fn) in variants.items()}
    return wrapped, [w for _, w in wrapped.values()]


def variants_noop(witnesses: list[NoOpWitness]) -> str | None:
    """Why the variants changed nothing in their run (the NOT APPLICABLE reason), or None when
    some call changed an output or could not be compared."""
    if not witnesses or any(w.changed or w.unchecked for w in witnesses):
        return None
    parts = [f"{w.name} gives {w.op}'s own output bytes at all {w.checked} call sites"
             if w.checked else f"{w.name} ({w.op}) is never called" for w in witnesses]
    return "no-op on these weights and inputs: " + "; ".join(parts)


def weights_unchanged(source: str | Path, transform: Callable[[dict], dict],
                      dtype: torch.dtype | None = None) -> str | None:
    """Why the checkpoint transform changes nothing (the NOT APPLICABLE reason), or None when
    it moves, adds or removes a tensor. Loads the checkpoint at ``source`` (cast to ``dtype``)."""
    state = load_state(source, dtype)
    out = transform({k: v.clone() for k, v in state.items()})
    if out.keys() != state.keys() or not all(same_bytes(out[k], state[k]) for k in state):
        return None
    return (f"no-op on these weights: the transformed checkpoint holds the same {len(state)} "
            "tensors, byte for byte")
