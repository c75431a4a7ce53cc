"""Variants for the suspects users report: LoRA merge dtype, RoPE table device, text mask, attention
kernel. Each has the signature of the operator it replaces (``drifttool.probes.variants.Variant``)
and makes one change; ``drifttool.probes.suspects`` declares the probes that use them.

    >>> v = LoraMergeBf16()
    >>> execute(RunSpec(lora="runs/lora", variants={v.op: v.entry()}), "runs/lora_merge_bf16")
    # trace: lora_merge actual="variant:lora_merge_bf16"

=======================  ======================  ==================================================
variant                  operator                the change
=======================  ======================  ==================================================
lora_merge_bf16          lora_merge              W' = bf16(bf16(W) + bf16(scale·B·A)): the merge
                                                 carried out in bf16 (diffusers' ``fuse_lora`` of
                                                 factors held in the model dtype) instead of fp32
rope_tables_on_device    multi_axis_rope         the RoPE table rebuilt from its integer positions
                                                 on the device of the activations, not built on the
                                                 CPU and moved there (the same table on the CPU)
text_mask_all_ones       joint_attn_softmax,     an all-ones key mask where the model passes
                         joint_attn_av_gemm,     ``None`` (no prompt padded); a given mask is kept
                         joint_attention_fused
attention_kernel_math    joint_attention_fused   production attention forced to SDPA's MATH kernel
                                                 (``sdpa_kernel([MATH])``) instead of torch's choice
=======================  ======================  ==================================================
"""

from __future__ import annotations

import torch

from drifttool.errors import UnsupportedConfigError
from drifttool.model.rope import BACKEND_TABLES, image_positions, rope_table, text_positions
from drifttool.probes.variants import Variant


class LoraMergeBf16(Variant):
    """The adapted weight merged in bf16: the delta ``scale·B·A`` as the run's own ``lora_merge``
    computes it (strict: tree GEMM in fp32; production: peft's matmul in fp32), rounded to bf16,
    added to bf16(W) in bf16 (one rounding), returned in the dtype the operator returns (fp32 for
    strict, W's for production). w [out, in], a [r, in], b [out, r] → W' [out, in]."""

    op = "lora_merge"
    name = "lora_merge_bf16"

    def __call__(self, w, a, b, scale):
        delta = self.base(torch.zeros_like(w, dtype=torch.float32), a, b, scale)  # [out, in] fp32
        out_dtype = self.base(w[:1], a, b[:1], scale).dtype  # the operator's own output dtype
        merged = w.to(torch.bfloat16) + delta.to(torch.bfloat16)  # bf16 + bf16 → bf16
        return merged.to(out_dtype)


class RopeTablesOnDevice(Variant):
    """The RoPE table rebuilt on the activations' device from its integer positions (the run's
    table algorithm, ``model.rope.BACKEND_TABLES``), instead of the table the model built on the
    CPU and moved (``model.rope.rope_tables``). The call's table is identified on the CPU: the
    image or the text table of this grid and length whose bytes it holds.

    Args:
        axes_dims, theta: the model's RoPE axis sizes and base (``config.axes_dims_rope``,
            ``rope_theta``).

    Raises:
        UnsupportedConfigError: the table is neither the image nor the text table of the call
            (another variant changed it, or the model's RoPE is not ``axes_dims``/``theta``).
    """

    op = "multi_axis_rope"
    name = "rope_tables_on_device"

    def __init__(self, axes_dims: tuple[int, ...], theta: float = 10000) -> None:
        super().__init__()
        self.axes, self.theta = tuple(int(a) for a in axes_dims), theta
        self.applied = 0  # calls whose table was rebuilt

    def __call__(self, x, freqs):
        h, w = self.scope()["img_grid"]
        L = freqs.shape[0]
        algorithm = BACKEND_TABLES[self.rt.family]
        for pos in (image_positions(h, w), text_positions(h, w, L)):
            if pos.shape[0] == L and torch.equal(freqs.cpu(), rope_table(pos, self.axes, self.theta,
                                                                         algorithm=algorithm)):
                self.applied += 1
                return self.base(x, rope_table(pos.to(x.device), self.axes, self.theta,
                                               algorithm=algorithm))
        raise UnsupportedConfigError(
            f"{self.name}: the table {tuple(freqs.shape)} is neither the image nor the text RoPE "
            f"table of grid {h}x{w} (axes {list(self.axes)}, theta {self.theta})")




class TextMaskAllOnes(Variant):
    """Attention handed an all-ones key mask ``[B, S]`` (every text and image key valid) where the
    model passes ``None`` (a batch that pads no prompt), as a pipeline that always builds the
    mask does. A given mask is kept. Register the same class for ``joint_attn_softmax`` and
    ``joint_attn_av_gemm`` (strict) and ``joint_attention_fused`` (production)."""

    name = "text_mask_all_ones"
    _MASK_ARG = {"joint_attn_softmax": 1, "joint_attn_av_gemm": 2, "joint_attention_fused": 3}

    def __init__(self, op: str = "joint_attn_softmax") -> None:
        super().__init__()
        self.op = op
        self.applied = 0  # calls given an all-ones mask instead of None

    def __call__(self, *args, **kwargs):
        n = self._MASK_ARG[self.op]
        mask = kwargs.get("key_mask", args[n] if len(args) > n else None)
        if mask is not None:
            return self.base(*args, **kwargs)
        first = args[0]  # scores [B, H, S, S] | probs [B, H, S, S] | q [B, S, H, Dh]
        B, S = first.shape[0], (first.shape[1] if self.op == "joint_attention_fused" else first.shape[-1])
        ones = torch.ones(B, S, dtype=torch.bool, device=first.device)
        self.applied += 1
        kwargs.pop("key_mask", None)
        return self.base(*args[:n], ones, *args[n + 1:], **kwargs)


class AttentionKernelMath(Variant):
    """Production attention forced to SDPA's MATH kernel (``sdpa_kernel([SDPBackend.MATH])``
    around the production ``joint_attention_fused``) instead of the kernel torch selects (FLASH
    on the CPU, cuDNN or flash on an H200); q, k, v ``[B, S, H, Dh]`` → ``[B, S, H, Dh]``."""

    op = "joint_attention_fused"
    name = "attention_kernel_math"

    def __call__(self, *args, **kwargs):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.MATH]):
            return self.base(*args, **kwargs)
