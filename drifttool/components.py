"""The models a run is made of (a leaf module: the artifact schema, the operator specs and the
runtime scope share it).

``COMPONENTS`` in program order: the Qwen2.5-VL ``text_encoder`` (RFC Phase B), the ``mmdit``
(the diffusion transformer, its sampler operators included) and the ``vae``
(RFC Phase B). A record's identity, an operator's spec and a trace row name their component, so
another model joins without another schema change.
"""

COMPONENTS = ("text_encoder", "mmdit", "vae")
"""``component`` values in program order."""
DEFAULT_COMPONENT = "mmdit"
