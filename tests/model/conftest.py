"""Shared helpers for tests/model: small random diffusers transformers saved to a temp folder."""

from __future__ import annotations

import logging

import pytest
import torch

# diffusers warns about `accelerate` and `.to(dtype)`; keep the test log quiet.
logging.getLogger("diffusers").setLevel(logging.ERROR)


def make_diffusers_transformer(seed: int = 0, **shape):
    """A random ``QwenImageTransformer2DModel`` (fp32): diffusers' own init, plus non-trivial
    RMSNorm gains (1 + N(0, 0.1²)) so the gain multiply is exercised."""
    from diffusers import QwenImageTransformer2DModel
    from diffusers.utils import logging as dlogging

    dlogging.set_verbosity_error()
    torch.manual_seed(seed)
    m = QwenImageTransformer2DModel(**shape)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.normal_(1.0, 0.1)
    return m.eval()


@pytest.fixture
def diffusers_folder(tmp_path):
    """Factory: ``(model_fp32, folder)`` for a random diffusers transformer saved with
    ``save_pretrained`` (optionally sharded)."""

    def make(seed: int = 0, max_shard_size=None, **shape):
        m = make_diffusers_transformer(seed, **shape)
        folder = tmp_path / f"transformer_{seed}_{len(list(tmp_path.iterdir()))}"
        kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
        m.save_pretrained(folder, **kw)
        return m, folder

    return make
