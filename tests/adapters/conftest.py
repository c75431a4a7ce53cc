"""Small random diffusers transformers for the capture adapter tests (skipped without diffusers)."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("diffusers")
logging.getLogger("diffusers").setLevel(logging.ERROR)

SHAPE = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16,
             num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6))


@pytest.fixture(scope="module")
def random_transformer():
    """Factory: a random ``QwenImageTransformer2DModel`` (diffusers' init, non-trivial RMSNorm
    gains) in ``dtype``."""
    from diffusers import QwenImageTransformer2DModel
    from diffusers.utils import logging as dlogging

    dlogging.set_verbosity_error()

    def make(seed: int = 0, dtype: torch.dtype = torch.float32, **shape):
        torch.manual_seed(seed)
        m = QwenImageTransformer2DModel(**{**SHAPE, **shape})
        with torch.no_grad():
            for name, p in m.named_parameters():
                if p.dim() == 1 and "norm" in name:
                    p.normal_(1.0, 0.1)
        return m.to(dtype).eval()

    return make
