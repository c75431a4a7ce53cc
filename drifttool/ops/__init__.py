"""The named operators: declarations (``specs``), backend families, and dispatch (``registry``).

Importing this package declares every operator and registers the built-in families, in this
explicit order (nothing else registers as a side effect of an import elsewhere):

1. ``specs`` — the RFC WS1 operators (one declaration table, ``specs.OPERATORS``); ``scheduler`` —
   the strict/production implementations of the three sampler operators; ``lora`` —
   ``lora_merge`` and its implementations;
2. ``strict`` — the strict family on device ``cpu``; ``strict_cuda`` — the strict family on device
   ``cuda`` (Triton, imported only when a call runs);
3. ``production`` — the production family on devices ``cpu`` and ``cuda``;
4. ``text_encoder`` — the Qwen2.5-VL text encoder's operators, both families.
5. ``vae`` — the VAE's operators (Phase B), strict on ``cpu`` and production on ``cpu`` and
   ``cuda``.

Another family registers from its own module with ``registry.implements(op, family, device=...,
constraints=...)``; neither the model nor the registry changes.
"""

from drifttool.ops import specs  # noqa: F401  (declarations first)
from drifttool.ops import lora, scheduler  # noqa: F401  (declare and implement their operators)
from drifttool.ops import strict  # noqa: F401  (strict family, cpu)
from drifttool.ops import strict_cuda  # noqa: F401  (strict family, cuda)
from drifttool.ops import production  # noqa: F401  (production family, cpu and cuda)
from drifttool.ops import text_encoder  # noqa: F401  (the text encoder's operators, both families)
from drifttool.ops import vae  # noqa: F401  (the VAE's operators, both families)
from drifttool.ops.registry import call, implementation, spec  # noqa: F401
from drifttool.ops.registry import specs as all_specs  # noqa: F401
