"""drifttool's strict joint attention bound into vllm-omni's Qwen-Image transformer, in place of
each ``Attention`` layer's implementation.

    >>> with bind_strict_attention(transformer, od_config) as binding:   # after loading
    ...     transformer(...)          # every attn.attn runs strict joint_attention_fused

vllm-omni's ``Attention`` layer (``vllm_omni/diffusion/attention/layer.py``) resolves a backend
at construction and holds its implementation in ``layer.attention``; after the parallel
strategy's input preparation its ``forward`` calls ``layer.attention.forward(query, key, value,
attn_metadata)`` (or, for fp32 under an automatically chosen CUDA FlashAttention,
``layer.sdpa_fallback.forward``). Binding replaces both with a ``StrictAttentionImpl`` (and
``layer.attn_impl_cls``, which the capture reads back as ``<backend>/StrictAttentionImpl/
<strategy>``). Its ``forward`` runs the registry's ``strict`` ``joint_attention_fused`` on the
input's device with:

- ``q, k, v``: the joint ``[B, L + N, H, Dh]`` tensors the Qwen-Image attention concatenates
  (text first, then image);
- ``key_mask``: ``attn_metadata.attn_mask`` (``[B, L + N]``, text mask then ones), boolean or 0/1;
- ``text_len``: ``L``, read from the ``encoder_hidden_states`` the enclosing
  ``QwenImageCrossAttention`` receives (a forward pre-hook on ``attn``), since the joint
  tensors do not say where the image keys start.

The scale is the operator's (``1/sqrt(Dh)``): a layer built with another ``softmax_scale``, a
causal layer, grouped K/V heads or a parallel strategy other than ``NoParallelAttention`` is
refused; so is, per call, sequence-parallel metadata (``joint_query`` set) or an additive float
mask. The configuration is checked as for the GEMMs (``vllm_omni_strict.refusal``).

Raises: ``UnsupportedConfigError`` in one line (binding or call).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

import drifttool.ops  # noqa: F401  (declares the operators and registers the strict family)
from drifttool.adapters.vllm_omni_strict import bindable
from drifttool.errors import UnsupportedConfigError
from drifttool.ops.registry import implementation


class StrictAttentionImpl:
    """A vllm-omni attention implementation running strict ``joint_attention_fused`` (module
    docstring); ``text_len`` is set before each call by the binding's pre-hook."""

    def __init__(self, path: str, replaced: Any) -> None:
        self.path = path
        self.replaced = replaced
        self.text_len: int | None = None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attn_metadata: Any = None) -> torch.Tensor:
        """``query``/``key``/``value`` [B, L + N, H, Dh] → [B, L + N, H, Dh] in ``value``'s dtype.

        Raises:
            UnsupportedConfigError: no text length was set, sequence-parallel metadata, a float
                mask, or what the strict operator refuses (dtype, device, mask shape).
        """

        if self.text_len is None:
            raise UnsupportedConfigError(f"strict attention at {self.path}: called outside the "
                                         "Qwen-Image attention module (no text length)")
        mask = getattr(attn_metadata, "attn_mask", None)
        if getattr(attn_metadata, "joint_query", None) is not None:
            raise UnsupportedConfigError(f"strict attention at {self.path}: sequence-parallel "
                                         "joint metadata is not bound")
        if mask is not None and mask.dtype != torch.bool:
            if mask.is_floating_point():
                raise UnsupportedConfigError(f"strict attention at {self.path}: an additive "
                                             f"{mask.dtype} mask is not a key mask")
            mask = mask != 0
        fn = implementation("joint_attention_fused", "strict", query.device.type)
        return fn(query, key, value, mask, text_len=self.text_len)

    __call__ = forward


@dataclass
class AttentionBinding:
    """The attention layers of one transformer bound by ``bind_strict_attention``."""

    bound: list[str] = field(default_factory=list)
    """module paths of the bound ``Attention`` layers."""
    _undo: list[Any] = field(default_factory=list, repr=False)

    def restore(self) -> None:
        """Put back the implementations and remove the pre-hooks (idempotent)."""
        while self._undo:
            self._undo.pop()()

    def __enter__(self) -> "AttentionBinding":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.restore()


def _text_len_hook(impl: StrictAttentionImpl):
    def hook(module, args, kwargs):
        ehs = kwargs.get("encoder_hidden_states", args[1] if len(args) > 1 else None)
        impl.text_len = None if ehs is None else int(ehs.shape[1])

    return hook


def bind_strict_attention(transformer: torch.nn.Module, od_config: Any) -> AttentionBinding:
    """Bind strict ``joint_attention_fused`` to every block's ``attn.attn`` (module docstring).

    Raises:
        DriftToolError, UnsupportedConfigError: as ``vllm_omni_strict.bindable`` (the
            ``VllmOmniQwenImage`` wrapper is unwrapped).
        UnsupportedConfigError: a layer already bound, with another
            scale, causal, with grouped K/V heads or a parallel strategy.
    """
    transformer = bindable(transformer, od_config)
    plan = []
    for i, blk in enumerate(transformer.transformer_blocks):
        path = f"transformer_blocks.{i}.attn.attn"
        layer = blk.attn.attn
        impl = layer.attention
        strategy = type(getattr(layer, "parallel_strategy", None)).__name__
        if isinstance(impl, StrictAttentionImpl):
            raise UnsupportedConfigError(f"strict attention: {path} is already bound")
        problems = []
        if getattr(impl, "causal", False):
            problems.append("causal")
        scale = getattr(impl, "softmax_scale", None)
        if scale is not None and scale != 1.0 / (layer.head_size ** 0.5):
            problems.append(f"softmax_scale={scale} (not 1/sqrt({layer.head_size}))")
        if layer.num_kv_heads != layer.num_heads:
            problems.append(f"grouped K/V heads ({layer.num_heads} query, {layer.num_kv_heads} key/value)")
        if strategy != "NoParallelAttention":
            problems.append(f"parallel strategy {strategy}")
        if problems:
            raise UnsupportedConfigError(f"strict attention refuses {path}: {', '.join(problems)}")
        plan.append((path, blk.attn, layer))
    binding = AttentionBinding()
    for path, outer, layer in plan:  # nothing is replaced until every layer is accepted
        impl = StrictAttentionImpl(path, layer.attention)
        saved = (layer.attention, layer.attn_impl_cls, getattr(layer, "sdpa_fallback", None))
        handle = outer.register_forward_pre_hook(_text_len_hook(impl), with_kwargs=True)
        layer.attention, layer.attn_impl_cls = impl, StrictAttentionImpl
        if saved[2] is not None:
            layer.sdpa_fallback = impl

        def undo(layer=layer, saved=saved, handle=handle):
            layer.attention, layer.attn_impl_cls = saved[0], saved[1]
            if saved[2] is not None:
                layer.sdpa_fallback = saved[2]
            handle.remove()

        binding._undo.append(undo)
        binding.bound.append(path)
    return binding
