"""xfuser (xDiT) 0.7.0's Qwen-Image transformer in this process, on the CPU, as one rank: for
capturing it without a GPU.

    >>> cpu_runtime()                  # once per process: imports xfuser, one-rank gloo groups
    >>> cls = transformer_module().xFuserQwenImageTransformerWrapper

xfuser 0.7.0 assumes an accelerator. Three shims let its Qwen-Image transformer run on a CPU build
of torch; none changes the arithmetic of a layer (the layers are diffusers', attention is torch
SDPA as xfuser's ``SDPA`` backend runs it on a GPU):

- **import**: importing ``xfuser`` evaluates ``xfuser.envs.CUDA_VERSION``, whose
  ``get_device_version`` raises without CUDA, ROCm, MUSA, MPS or an NPU. ``torch.version.cuda``
  reads as a placeholder during that import only (``_accelerator_version_for_import``) and is
  restored after it; xfuser reads the device kind nowhere else at import time, and at run time
  it sees the CPU build (device ``cpu``).
- **process groups**: xfuser's ``init_distributed_environment`` and ``initialize_model_parallel``
  ask ``envs.get_torch_distributed_backend`` (which raises on the CPU) only when no backend is
  passed; they are called with ``backend="gloo"``, one rank, every parallel degree 1.
- **runtime state**: ``USP``, the attention entry of xfuser's models, reads the attention backend,
  the FP8-communication state and the head-balancing switch from xfuser's runtime state, which
  xfuser builds from a whole pipeline and engine config. ``RuntimeStateStandIn`` holds those
  fields: backend ``AttentionBackendType.SDPA`` (``F.scaled_dot_product_attention``, torch picking
  the kernel), no FP8 communication, no head balancing.

Refused (``DriftToolError`` / ``UnsupportedConfigError``): an xfuser other than 0.7.0; a parallel
degree above 1 (one process here is one rank; a sharded capture is not supported yet); a process
where xfuser's runtime state or torch.distributed was already set up by something else.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.metadata
import threading
from typing import Any, Iterator

import torch

from drifttool.adapters.single_rank import single_rank_env
from drifttool.errors import DriftToolError, UnsupportedConfigError

SUPPORTED_XFUSER = "0.7.0"
"""The xfuser release whose Qwen-Image wrapper and attention entry the shims and the capture
describe."""

_MODULE = "xfuser.model_executor.models.transformers.transformer_qwen"
_LOCK = threading.Lock()
_STATE: dict[str, Any] = {}


def check_version() -> str:
    """The installed xfuser version, which must be ``SUPPORTED_XFUSER``.

    Raises:
        DriftToolError: xfuser is not installed, or is another version (one line).
    """
    try:
        got = importlib.metadata.version("xfuser")
    except importlib.metadata.PackageNotFoundError:
        raise DriftToolError("the xfuser adapter needs xfuser installed (pip install "
                             f"xfuser=={SUPPORTED_XFUSER}; see docs/adapters.md)") from None
    if got != SUPPORTED_XFUSER:
        raise DriftToolError(f"xfuser {got} is not supported by the capture adapter "
                             f"(supported: {SUPPORTED_XFUSER})")
    return got


@contextlib.contextmanager
def _accelerator_version_for_import() -> Iterator[None]:
    """``torch.version.cuda`` reads ``"0.0"`` inside the block when torch has no accelerator
    build (xfuser's import-time ``CUDA_VERSION``), and is restored on exit."""
    saved = torch.version.cuda
    fake = saved is None and torch.version.hip is None
    if fake:
        torch.version.cuda = "0.0"
    try:
        yield
    finally:
        if fake:
            torch.version.cuda = saved


def transformer_module():
    """xfuser's ``transformer_qwen`` module (``xFuserQwenImageTransformerWrapper``), imported
    under the import shim (module docstring).

    Raises:
        DriftToolError: xfuser missing, of another version, or its import fails.
    """
    check_version()
    with _LOCK:
        if "module" not in _STATE:
            with _accelerator_version_for_import():
                try:
                    _STATE["module"] = importlib.import_module(_MODULE)
                except ImportError as e:
                    raise DriftToolError(f"xfuser {SUPPORTED_XFUSER} cannot be imported ({e}); "
                                         "see docs/adapters.md for its test environment") from None
        return _STATE["module"]


@dataclasses.dataclass
class RuntimeConfigStandIn:
    """The runtime-config fields ``USP`` reads."""

    use_spargeattn_head_balance: bool = False


@dataclasses.dataclass
class RuntimeStateStandIn:
    """The runtime-state fields xfuser's ``USP`` reads (``attention_backend``, ``fp8_comms``,
    ``runtime_config.use_spargeattn_head_balance``), for a process that builds no xfuser
    pipeline. ``attention_backend`` is an ``AttentionBackendType``."""

    attention_backend: Any
    fp8_comms: Any = None
    runtime_config: RuntimeConfigStandIn = dataclasses.field(default_factory=RuntimeConfigStandIn)


DEGREES = ("data_parallel_degree", "classifier_free_guidance_degree", "ulysses_degree",
           "ring_degree", "tensor_parallel_degree", "pipeline_parallel_degree",
           "fully_shard_degree")
"""xfuser's parallel degrees (``initialize_model_parallel``); every one must be 1 here."""


def refuse_parallel(**degrees: int) -> None:
    """Raise unless every given parallel degree (``DEGREES``) is 1.

    Raises:
        UnsupportedConfigError: a degree above 1, or an unknown degree name.
    """
    unknown = sorted(set(degrees) - set(DEGREES))
    if unknown:
        raise UnsupportedConfigError(f"xfuser capture: unknown parallel degree {unknown[0]!r} "
                                     f"(known: {', '.join(DEGREES)})")
    big = {k: v for k, v in degrees.items() if int(v) != 1}
    if big:
        name, value = next(iter(big.items()))
        raise UnsupportedConfigError(f"xfuser capture: {name}={value} is not supported; the "
                                     "capture runs xfuser on one rank (every parallel degree 1)")


def cpu_runtime(**degrees: int) -> RuntimeStateStandIn:
    """Import xfuser under the shim, set up one-rank gloo process groups through xfuser's own
    ``parallel_state`` (every degree 1) and install the runtime-state stand-in; once per process.
    Returns the stand-in.

    Args:
        degrees: xfuser parallel degrees (``DEGREES``); any above 1 is refused.

    Raises:
        UnsupportedConfigError: a parallel degree above 1.
        DriftToolError: xfuser missing or of another version; torch.distributed already
            initialised with more than one rank; xfuser's runtime state already set up (a real
            xfuser pipeline in this process).
    """
    refuse_parallel(**degrees)
    transformer_module()
    with _LOCK:
        if "state" in _STATE:
            return _STATE["state"]
        rs = importlib.import_module("xfuser.core.distributed.runtime_state")
        ps = importlib.import_module("xfuser.core.distributed.parallel_state")
        ab = importlib.import_module("xfuser.core.distributed.attention_backend")
        if rs._RUNTIME is not None:
            raise DriftToolError("xfuser's runtime state is already set up in this process (an "
                                 "xfuser pipeline?); the CPU runtime is for a process without one")
        single_rank_env("xfuser")
        ps.init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                        distributed_init_method="env://", backend="gloo")
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(backend="gloo")
        state = RuntimeStateStandIn(attention_backend=ab.AttentionBackendType.SDPA)
        rs._RUNTIME = state
        _STATE["state"] = state
        return state


def world_sizes() -> dict[str, int]:
    """The parallel world sizes xfuser's parallel state reports (sequence, Ulysses, ring, CFG,
    pipeline, tensor, data)."""
    ps = importlib.import_module("xfuser.core.distributed.parallel_state")
    return {"sequence": ps.get_sequence_parallel_world_size(),
            "ulysses": ps.get_ulysses_parallel_world_size(),
            "ring": ps.get_ring_parallel_world_size(),
            "cfg": ps.get_classifier_free_guidance_world_size(),
            "pipeline": ps.get_pipeline_parallel_world_size(),
            "tensor": ps.get_tensor_model_parallel_world_size(),
            "data": ps.get_data_parallel_world_size()}
