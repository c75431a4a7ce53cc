"""The Qwen2.5-VL vision tower as named operators (component ``text_encoder``, stream ``img``):
prompt images to the vision embeddings that replace a prompt's ``<|image_pad|>`` rows.

    >>> tower = VisionTower(vcfg, weights)
    >>> vision = tower(torch.cat(all_pixels), grids, rt)   # [Σ N_i / 4, D_out]

The pixels are ``image_input.prepare_image``'s. ``VisionTower`` is ``Qwen2_5_VisionTransformerPretrainedModel.forward`` of transformers 5.x, one
packed call over every image of the encode call, as transformers runs it: block −1
``te_vision_patch_embed`` (patch order) and ``te_vision_rope_table`` (the (row, col) of every
patch); both reordered into window order (``vision_grid.windows``: the merged tokens window by
window); per block i (block i) ``te_vision_rmsnorm`` → ``te_vision_qkv`` → ``te_vision_rope`` →
``te_vision_attention`` (segments: the windows, or whole images in the ``fullatt_block_indexes``
blocks) → ``te_vision_attn_out_residual`` → ``te_vision_rmsnorm`` →
``te_vision_mlp_gate_up_silu`` → ``te_vision_mlp_down_residual``; block ``depth``
``te_vision_merger``, whose rows are put back into patch-token order. The tower's records have
no batch axis (layout ``S``: sample −1, rows in the order the operator saw them).
"""

from __future__ import annotations

import torch

from drifttool.errors import UnsupportedConfigError
from drifttool.ops.registry import call
from drifttool.ops.specs import OPERATORS
from drifttool.runtime import Runtime
from drifttool.text_encoder.vision_config import VisionConfig
from drifttool.text_encoder.vision_grid import Grid, image_seqlens, patch_positions, token_rows, windows


def _op(rt: Runtime, name: str, *args, **kwargs):
    row = OPERATORS[name]
    return call(rt, name, *args, stream=row.streams[0], layout=row.layout, **kwargs)


class VisionTower:
    """The vision tower of a Qwen2.5-VL text encoder.

    Attributes:
        config: ``VisionConfig``.  weights: its tensors by their names (``vision_weights``).
    """

    def __init__(self, config: VisionConfig, weights: dict[str, torch.Tensor]) -> None:
        self.config = config
        self.weights = weights

    @property
    def dtype(self) -> torch.dtype:
        return self.weights["patch_embed.proj.weight"].dtype

    def _block(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu: torch.Tensor,
               rt: Runtime) -> torch.Tensor:
        w, p = self.weights, f"blocks.{i}."
        h = _op(rt, "te_vision_rmsnorm", x, w[p + "norm1.weight"], 1e-6)
        q, k, v = _op(rt, "te_vision_qkv", h, w[p + "attn.qkv.weight"], w[p + "attn.qkv.bias"],
                      self.config.heads)  # [N, H, Dh] ×3
        q, k = _op(rt, "te_vision_rope", q, k, cos, sin)
        a = _op(rt, "te_vision_attention", q, k, v, cu)  # [N, H, Dh]
        x = _op(rt, "te_vision_attn_out_residual", x, a, w[p + "attn.proj.weight"], w[p + "attn.proj.bias"])
        h = _op(rt, "te_vision_rmsnorm", x, w[p + "norm2.weight"], 1e-6)
        m = _op(rt, "te_vision_mlp_gate_up_silu", h, w[p + "mlp.gate_proj.weight"], w[p + "mlp.gate_proj.bias"],
                w[p + "mlp.up_proj.weight"], w[p + "mlp.up_proj.bias"])  # [N, I]
        return _op(rt, "te_vision_mlp_down_residual", x, m, w[p + "mlp.down_proj.weight"], w[p + "mlp.down_proj.bias"])

    def __call__(self, pixels: torch.Tensor, grids: list[Grid], rt: Runtime) -> torch.Tensor:
        """Vision embeddings of the packed images.

        Args:
            pixels: [N, 3·T·P·P] float, every image's patches one after the other (patch order).
            grids: (t, h, w) of each image, in that order.  rt: the runtime; its scope should
                name the component ``text_encoder`` and no image grid.
        Returns:
            [N / m², out_hidden_size] in the weights' dtype: image after image, merged tokens
            row-major (the order of the images' ``<|image_pad|>`` tokens).
        Raises:
            UnsupportedConfigError: pixels that are not the grids' patches, or as the operators.
        """
        c, w, m = self.config, self.weights, self.config.spatial_merge_size
        if pixels.dim() != 2 or pixels.shape[0] != sum(t * h * wd for t, h, wd in grids) or pixels.shape[1] != c.patch_dim:
            raise UnsupportedConfigError(f"vision tower: pixels {list(pixels.shape)} are not the patches of grids "
                                         f"{list(grids)} ({c.patch_dim} values each)")
        order, cu_windows = windows(grids, m, c.window_tokens)
        rows = token_rows(order, m)
        cu_images = image_seqlens(grids, m)
        with rt.scope(block=-1):
            x = _op(rt, "te_vision_patch_embed", pixels, w["patch_embed.proj.weight"])  # [N, E], patch order
            cos, sin = _op(rt, "te_vision_rope_table", patch_positions(grids, m), c.head_dim, c.rope_theta)
        x, cos, sin = x[rows], cos[rows], sin[rows]  # window order
        for i in range(c.depth):
            with rt.scope(block=i):
                x = self._block(i, x, cos, sin, cu_images if i in c.fullatt_blocks else cu_windows, rt)
        with rt.scope(block=c.depth):
            merged = _op(rt, "te_vision_merger", x, w["merger.ln_q.weight"], w["merger.mlp.0.weight"],
                         w["merger.mlp.0.bias"], w["merger.mlp.2.weight"], w["merger.mlp.2.bias"], m * m)
        return merged[torch.argsort(order)]  # [N/m², D_out], patch-token order
