"""The Qwen2.5-VL language model's forward as named operators (component ``text_encoder``).

    >>> te = TextEncoder(cfg, weights)
    >>> hidden = te(ids, mask, positions, rt)   # [B, L, D]: hidden_states[-1], after the final norm

One call per operator, in transformers' order (``Qwen2_5_VLTextModel.forward``): block −1
``te_embed_tokens`` (then, for a prompt with images, ``te_vision_scatter`` of the vision
embeddings into its ``<|image_pad|>`` rows, as ``Qwen2_5_VLModel.forward``); per decoder layer i (block i) ``te_rmsnorm`` → ``te_qkv_bias_gemm`` →
``te_mrope`` (q, then k) → ``te_causal_attention`` → ``te_attn_out_residual`` → ``te_rmsnorm``
→ ``te_mlp_gate_up_silu`` → ``te_mlp_down_residual``; block ``layers`` the final ``te_rmsnorm``.
The runtime's family decides the arithmetic (strict or production); capture layouts are the
rows' (``drifttool.ops.specs``). The caller sets the identity scope (``encode.encode_prompts``).
"""

from __future__ import annotations

import torch

from drifttool.ops.registry import call
from drifttool.ops.specs import OPERATORS
from drifttool.runtime import Runtime
from drifttool.text_encoder.config import TextEncoderConfig


def _op(rt: Runtime, name: str, *args, **kwargs):
    return call(rt, name, *args, stream="txt", layout=OPERATORS[name].layout, **kwargs)


class TextEncoder:
    """The language model of a Qwen2.5-VL text encoder (no vision tower, no LM head).

    Attributes:
        config: ``TextEncoderConfig``.  weights: the checkpoint's tensors by their names
            (``weights.expected_shapes``).
    """

    def __init__(self, config: TextEncoderConfig, weights: dict[str, torch.Tensor]) -> None:
        self.config = config
        self.weights = weights

    @property
    def dtype(self) -> torch.dtype:
        return self.weights["embed_tokens.weight"].dtype

    def _layer(self, i: int, x: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor,
               rt: Runtime) -> torch.Tensor:
        c, w, p = self.config, self.weights, f"layers.{i}."
        h = _op(rt, "te_rmsnorm", x, w[p + "input_layernorm.weight"], c.rms_norm_eps)
        q, k, v = _op(rt, "te_qkv_bias_gemm", h,
                      w[p + "self_attn.q_proj.weight"], w[p + "self_attn.q_proj.bias"],
                      w[p + "self_attn.k_proj.weight"], w[p + "self_attn.k_proj.bias"],
                      w[p + "self_attn.v_proj.weight"], w[p + "self_attn.v_proj.bias"],
                      c.heads, c.kv_heads)  # [B, L, H, Dh], [B, L, Hkv, Dh] ×2
        q = _op(rt, "te_mrope", q, positions, c.rope_theta, c.mrope_section)
        k = _op(rt, "te_mrope", k, positions, c.rope_theta, c.mrope_section)
        a = _op(rt, "te_causal_attention", q, k, v, mask)  # [B, L, H, Dh]
        x = _op(rt, "te_attn_out_residual", x, a.flatten(2), w[p + "self_attn.o_proj.weight"])  # [B, L, D]
        h = _op(rt, "te_rmsnorm", x, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
        m = _op(rt, "te_mlp_gate_up_silu", h, w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"])
        return _op(rt, "te_mlp_down_residual", x, m, w[p + "mlp.down_proj.weight"])

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor,
                 rt: Runtime, vision: tuple[int, torch.Tensor] | None = None) -> torch.Tensor:
        """Last hidden state (after the final RMSNorm).

        Args:
            ids: [B, L] int64 token ids.  mask: [B, L] 0/1 key validity (right padding), or None.
            positions: [3, B, L] int64 mRoPE positions (text only: ``text_positions``; with
                images: ``te_vision_rope_index``'s).
            rt: the runtime; its scope should name the component ``text_encoder``.
            vision: (the ``<|image_pad|>`` id, the vision embeddings [Nv, D] in token order) of
                prompts with images, or None.
        Returns:
            [B, L, D] in the weights' dtype.
        """
        with rt.scope(block=-1):
            x = _op(rt, "te_embed_tokens", ids, self.weights["embed_tokens.weight"])  # [B, L, D]
            if vision is not None:
                x = _op(rt, "te_vision_scatter", x, ids, *vision)
        for i in range(self.config.layers):
            with rt.scope(block=i):
                x = self._layer(i, x, mask, positions, rt)
        with rt.scope(block=self.config.layers):
            return _op(rt, "te_rmsnorm", x, self.weights["norm.weight"], self.config.rms_norm_eps)


def text_positions(batch: int, length: int) -> torch.Tensor:
    """The mRoPE positions of text-only prompts: 0..L−1 on all three axes, for every row
    [3, B, L] int64 (transformers' default without image tokens; right padding keeps each
    prompt's positions independent of the padding)."""
    return torch.arange(length, dtype=torch.int64).view(1, 1, -1).expand(3, batch, length)
