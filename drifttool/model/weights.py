"""The weight digest that pins a model in the fingerprint (and an adapter in its record).

    >>> weight_digest(model)                       # or a state dict
    'xxh3_128:…'

Kept apart from ``checkpoint`` (which builds an ``MMDiT``) so that ``lora`` can digest adapter
weights without importing the model it adapts.
"""

from __future__ import annotations

import torch
import xxhash


def weight_digest(model: torch.nn.Module | dict[str, torch.Tensor]) -> str:
    """``xxh3_128`` over every tensor in sorted key order: name, dtype, shape, then raw bytes.

    Equal digests ⇔ same names, dtypes, shapes and bytes (to the hash's collision bound); the same
    on every device. Accepts a model or a state dict. Returns ``"xxh3_128:<32 hex>"``.
    """
    state = dict(model.named_parameters()) if isinstance(model, torch.nn.Module) else model
    h = xxhash.xxh3_128()
    for name in sorted(state):
        t = state[name].detach()
        h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{list(t.shape)}\n".encode())
        h.update(t.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())  # no extra copy
    return "xxh3_128:" + h.hexdigest()
