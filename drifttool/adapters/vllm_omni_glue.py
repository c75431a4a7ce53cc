"""What vllm-omni's Qwen-Image transformer computes outside one module's output, recorded for the
capture adapter (``drifttool.adapters.vllm_omni_qwenimage``), and the kernel read-back.

    glue = Glue(rt, transformer)
    with glue.installed(transformer_module()):
        transformer(...)   # fused QKV outputs split and recorded; RoPE recorded per call

- **Fused QKV** (``attn.to_qkv``, ``attn.add_kv_proj``: vLLM ``QKVParallelLinear``, output
  ``(y, bias)``, ``y`` = ``[B, S, (H + 2·Hkv)·Dh]``): split at ``(H·Dh, Hkv·Dh, Hkv·Dh)``, as the
  attention module splits it, into q, k, v ``[B, S, H, Dh]``: one ``qkv_bias_gemm`` record of
  three outputs per stream.
- **QK-norm + RoPE**: ``_qwen_image_qk_norm_rope(q, k, norm_q, norm_k, freqs, rope, eps)`` is a
  module-level function the attention looks up by name at each call; for the block it is
  replaced by a wrapper that calls it unchanged and records its returned query and key as
  ``multi_axis_rope`` (image call, then text call). The wrapper reads back the path it took:
  ``eager`` when the norm modules ran inside it, else ``fused`` (the Triton QK-RMSNorm+RoPE kernel,
  taken when CUDA, bf16 and B·S ≥ the token threshold). The trace entry is declared
  batch-dependent, with the threshold (``VLLM_OMNI_FUSED_QK_NORM_ROPE_MIN_TOKENS``) and this
  call's B·S. On the fused path the norm modules are bypassed: their ``qk_rmsnorm`` sites are
  traced with the fused kernel (no digest: the tensor never exists) and ``accounted()`` names them
  so the adapter's every-tap-fired check accepts them.

``kernel_of(path, module)``: a linear's bound GEMM (``quant_method._gemm_impl``), the attention
layer's backend, implementation class and parallel strategy.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Iterator

import torch

from drifttool.adapters.taps import record
from drifttool.errors import DriftToolError
from drifttool.ops.registry import spec as op_spec
from drifttool.runtime import Runtime

SUPPORTED = ("0.30.",)
"""vllm-omni releases whose Qwen-Image transformer this adapter's table describes."""
_MODULE = "vllm_omni.diffusion.models.qwen_image.qwen_image_transformer"
_FUNC = "_qwen_image_qk_norm_rope"
ENV_MIN_TOKENS = "VLLM_OMNI_FUSED_QK_NORM_ROPE_MIN_TOKENS"


def check_version() -> str:
    """vllm-omni's version, when this adapter supports it.

    Raises:
        DriftToolError: vllm-omni is missing or of another version.
    """
    try:
        from importlib.metadata import PackageNotFoundError, version

        v = version("vllm-omni")
    except PackageNotFoundError:
        raise DriftToolError("the vllm-omni adapter needs vllm-omni installed (0.30.x; see "
                             "docs/adapters.md)") from None
    if not v.startswith(SUPPORTED):
        raise DriftToolError(f"vllm-omni {v} is not supported by the capture adapter "
                             f"(supported: {', '.join(s + 'x' for s in SUPPORTED)})")
    return v


def transformer_module():
    """``vllm_omni...qwen_image_transformer`` (imports vllm; seconds)."""
    try:
        return importlib.import_module(_MODULE)
    except ImportError as e:
        raise DriftToolError(f"the vllm-omni adapter cannot import {_MODULE} ({e})") from None


def _gemm_name(module: torch.nn.Module) -> str | None:
    qm = getattr(module, "quant_method", None)
    if qm is None:
        return None
    g = getattr(qm, "_gemm_impl", None)
    g = getattr(g, "func", g)
    return f"{type(qm).__name__}/{getattr(g, '__name__', type(g).__name__)}"


def _linear(module: torch.nn.Module) -> torch.nn.Module | None:
    """The vLLM linear a tapped module runs last (itself, ``.proj``, or a Sequential's last)."""
    for m in (module, getattr(module, "proj", None), getattr(module, "linear", None)):
        if m is not None and hasattr(m, "quant_method"):
            return m
    if isinstance(module, torch.nn.Sequential) and hasattr(module[-1], "quant_method"):
        return module[-1]
    return None


def attention_kernel(layer: torch.nn.Module) -> str:
    """The vllm-omni ``Attention`` layer's resolved backend, implementation class and parallel
    strategy, e.g. ``TORCH_SDPA/SDPAImpl/NoParallelAttention``."""
    backend = getattr(layer, "attn_backend", None)
    name = backend.get_name() if backend is not None else "unknown"
    impl = getattr(getattr(layer, "attn_impl_cls", None), "__name__", "unknown")
    strategy = type(getattr(layer, "parallel_strategy", None)).__name__
    return f"{name}/{impl}/{strategy}"


class Glue:
    """The fused-QKV and QK-norm+RoPE records of one instrumented transformer (module docstring)."""

    def __init__(self, rt: Runtime, transformer: torch.nn.Module) -> None:
        self.rt = rt
        self.blocks = list(transformer.transformer_blocks)
        # norm_q module id -> (block, stream, (norm_q path, norm_k path))
        self.norms: dict[int, tuple[int, str, tuple[str, str]]] = {}
        for i, blk in enumerate(self.blocks):
            a = blk.attn
            base = f"transformer_blocks.{i}.attn"
            self.norms[id(a.norm_q)] = (i, "img", (f"{base}.norm_q", f"{base}.norm_k"))
            self.norms[id(a.norm_added_q)] = (i, "txt", (f"{base}.norm_added_q",
                                                        f"{base}.norm_added_k"))
        self.ran: dict[int, int] = {}
        self.bypassed: set[str] = set()
        self.rope_calls = 0
        self._qkv_fired = False

    # -- read-back ------------------------------------------------------------------------------
    def kernel_of(self, path: str, module: torch.nn.Module) -> str:
        if path.endswith(".attn.attn"):
            return f"vllm_omni:{path} [{attention_kernel(module)}]"
        lin = _linear(module)
        gemm = _gemm_name(lin) if lin is not None else None
        return f"vllm_omni:{path}" + (f" [{gemm}]" if gemm else "")

    def accounted(self) -> set[str]:
        return set(self.bypassed)

    # -- installation -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def installed(self, mod: Any) -> Iterator[None]:
        original = getattr(mod, _FUNC, None)
        if original is None:
            raise DriftToolError(f"vllm-omni capture: {_MODULE}.{_FUNC} is gone; this vllm-omni "
                                 "does not compute QK-norm+RoPE where the adapter expects")
        if getattr(original, "_drifttool_capture", False):
            raise DriftToolError("vllm-omni capture: another capture is active on this process")
        wrapper = self._wrapper(mod, original)
        handles = []
        try:
            for i, blk in enumerate(self.blocks):
                a = blk.attn
                for stream, lin in (("img", a.to_qkv), ("txt", a.add_kv_proj)):
                    handles.append(lin.register_forward_hook(self._qkv_hook(i, stream, a, lin)))
                for norm in (a.norm_q, a.norm_added_q):
                    handles.append(norm.register_forward_hook(self._count))
            setattr(mod, _FUNC, wrapper)
            yield
            if self._qkv_fired and self.rope_calls == 0:
                raise DriftToolError(f"vllm-omni capture: {_FUNC} never ran in a forward: RoPE "
                                     "is applied somewhere the adapter does not see")
        finally:
            setattr(mod, _FUNC, original)
            for h in handles:
                h.remove()

    def _count(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        self.ran[id(module)] = self.ran.get(id(module), 0) + 1

    def _qkv_hook(self, block: int, stream: str, attn: torch.nn.Module, lin: torch.nn.Module):
        path = f"transformer_blocks.{block}.attn.{'to_qkv' if stream == 'img' else 'add_kv_proj'}"
        gemm = _gemm_name(lin)
        kernel = f"vllm_omni:{path}" + (f" [{gemm}]" if gemm else "") + " (q, k, v split)"
        heads, kv_heads = lin.num_heads, lin.num_kv_heads
        dh = attn.head_dim

        def hook(module, args, out):
            self._qkv_fired = True
            y = out[0] if isinstance(out, tuple) else out
            q, k, v = y.split([heads * dh, kv_heads * dh, kv_heads * dh], dim=-1)
            parts = tuple(t.unflatten(-1, (-1, dh)) for t in (q, k, v))
            record(self.rt, "qkv_bias_gemm", stream, parts, ("BS..",) * 3, actual="vllm_omni",
                   kernel=kernel, block=block)

        return hook

    def _wrapper(self, mod: Any, original: Any):
        glue = self

        def qk_norm_rope(q, k, norm_q, norm_k, freqs, rope, eps, *args, **kwargs):
            where = glue.norms.get(id(norm_q))
            if where is None:  # another model's attention: not ours to record
                return original(q, k, norm_q, norm_k, freqs, rope, eps, *args, **kwargs)
            before = glue.ran.get(id(norm_q), 0)
            out_q, out_k = original(q, k, norm_q, norm_k, freqs, rope, eps, *args, **kwargs)
            block, stream, norm_paths = where
            eager = glue.ran.get(id(norm_q), 0) > before
            glue.rope_calls += 1
            reason = glue._reason(mod, q, eager)
            path = "eager" if eager else "fused"
            if not eager:  # the norms ran inside the fused kernel: traced, no tensor to digest
                glue.bypassed.update(norm_paths)
                for _ in norm_paths:
                    site = glue.rt.site("qk_rmsnorm", stream, block=block)
                    glue.rt.trace.record(
                        site=site, contract=op_spec("qk_rmsnorm").contract,
                        requested=glue.rt.family, actual="vllm_omni",
                        kernel="vllm_omni:fused_qk_norm_rope (norm inside the fused kernel)",
                        fallback=False, reason=reason, declared=True, device=str(q.device))
            kernel = f"vllm_omni:{_FUNC} [{path}]"
            for t in (out_q, out_k):
                record(glue.rt, "multi_axis_rope", stream, t, "BS..", actual="vllm_omni",
                       kernel=kernel, reason=reason, declared=True, block=block)
            return out_q, out_k

        qk_norm_rope._drifttool_capture = True
        qk_norm_rope.__wrapped__ = original
        return qk_norm_rope

    @staticmethod
    def _reason(mod: Any, q: torch.Tensor, eager: bool) -> str:
        default = getattr(mod, "_FUSED_MIN_TOKENS", 2048)
        threshold = mod.fused_qk_norm_rope_min_tokens(default)
        tokens = int(q.shape[0]) * int(q.shape[1])
        return (f"batch-dependent path: fused Triton QK-RMSNorm+RoPE when CUDA, bf16 and "
                f"B*S >= {threshold} tokens ({ENV_MIN_TOKENS}, default {default}), eager "
                f"otherwise; this call B*S = {tokens}: {'eager' if eager else 'fused'}")
