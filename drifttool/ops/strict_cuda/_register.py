"""Registration of the strict CUDA family: ``strict_cuda`` and the constraints every member has.

    >>> @strict_cuda("qk_rmsnorm", "x", "gain", kernel="triton.rmsnorm.seq64")
    ... def qk_rmsnorm(x, gain, eps=1e-6): ...

Each implementation is registered for family ``strict``, device ``cuda``, contract
``qwenimage.<op>.cuda1`` (``CONTRACT_VERSION``), behind these constraints, checked on every call
(dispatch fails closed naming the one that failed):

1. tensors on CUDA (added by ``registry.implements``);
2. ``triton_ready``: Triton importable (the GPU wheels of torch ship it);
3. ``qualified_gpu``: compute capability in ``QUALIFIED_CAPABILITIES`` (the bytes are qualified on
   Hopper, sm_90: H100/H200); another GPU's MMA and special-function units may round differently;
4. ``forward_only``: no tensor argument requires a gradient under grad mode — except for the
   operators with a strict CUDA backward (``trainable=True``: the GEMMs and ``lora_merge``,
   ``strict_cuda.backward``; the row operators, ``strict_cuda.row_backward``;
   ``joint_attention_fused``, ``strict_cuda.attention_backward``; the sampler's,
   ``strict_cuda.sampler``), which take gradients, the gradient ledger's sinks included.
   ``forward_only(why)`` words the refusal for one operator (the attention's decomposition says
   that the fused operator has the backward);
5. the listed tensor arguments in the operator's declared dtypes (FP32 or BF16).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Callable

import torch

import drifttool.ops.specs  # noqa: F401  (the operators registered here are declared there)
from drifttool.ops.constraints import Args, Constraint, dtypes, tensors
from drifttool.ops.registry import implements, spec

CONTRACT_VERSION = "cuda1"
"""The strict CUDA family's contract version; bump when any of its bytes change."""

QUALIFIED_CAPABILITIES = ((9, 0),)
"""CUDA compute capabilities whose strict bytes are qualified (Hopper)."""


def contract_id(op: str) -> str:
    """``qwenimage.<op>.cuda1``: the contract id the strict CUDA implementation of ``op`` keeps."""
    return f"qwenimage.{op}.{CONTRACT_VERSION}"


@functools.cache
def _triton_missing() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (pip install triton, or a CUDA build of torch, which ships it)"
    return None


def _triton_ready(args: Args) -> str | None:
    return _triton_missing()


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _qualified(args: Args) -> str | None:
    for t in tensors(args.values()):
        if t.device.type != "cuda":
            continue
        cap = _capability(t.device.index if t.device.index is not None else torch.cuda.current_device())
        if cap not in QUALIFIED_CAPABILITIES:
            name = torch.cuda.get_device_name(t.device)
            ok = ", ".join(f"sm_{a}{b}" for a, b in QUALIFIED_CAPABILITIES)
            return f"{name} is sm_{cap[0]}{cap[1]}; strict CUDA bytes are qualified on {ok} only"
        return None
    return None


def wants_grad(args: Args) -> bool:
    """Grad mode is on and a tensor argument requires a gradient."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors(args.values()))


def forward_only(why: str = "this operator's strict CUDA kernel is forward only; freeze the weights that "
                             "need no gradient (requires_grad_(False)) or run it under torch.no_grad()"
                 ) -> Constraint:
    """The ``forward only`` constraint, refusing a gradient with ``why`` in its message."""

    def test(args: Args) -> str | None:
        if wants_grad(args):
            return (f"a tensor argument requires a gradient: {why} "
                    "(or use --mode auto on CUDA, or strict on the CPU)")
        return None

    return Constraint("forward only", test)


TRITON_READY = Constraint("Triton importable", _triton_ready)
QUALIFIED_GPU = Constraint("qualified GPU (sm_90)", _qualified)
FORWARD_ONLY = forward_only()


def strict_cuda(op: str, *dtype_args: str, kernel: str, constraints: tuple[Constraint, ...] = (),
                decomposable: bool = False, trainable: bool = False,
                refuse_grad: Constraint = FORWARD_ONLY, internals: Callable | None = None
                ) -> Callable[[Callable], Callable]:
    """Register a strict CUDA implementation of ``op`` (contract ``contract_id(op)``);
    ``dtype_args`` name the tensor arguments whose dtype must be one of the operator's declared
    dtypes (``None`` values allowed). ``kernel`` names the Triton kernel and its fixed
    configuration, e.g. ``"triton.gemm.k64.bm128bn128"``. ``trainable``: ``fn`` has a strict CUDA
    backward (then no ``refuse_grad``, by default ``FORWARD_ONLY``). ``internals``: as
    ``registry.implements``'s.

    Raises:
        ValueError: as ``registry.implements`` (undeclared operator, a constraint reading a
            parameter ``fn`` lacks, ...).
    """
    declared = (dtypes(spec(op).dtypes, *dtype_args),) if dtype_args else ()
    return implements(op, "strict", device="cuda", kernel=kernel, contract=contract_id(op),
                      constraints=(TRITON_READY, QUALIFIED_GPU, *(() if trainable else (refuse_grad,)),
                                   *declared, *constraints),
                      decomposable=decomposable, internals=internals)
