"""Capture: identity, canonical layout, digests, the recorder and the operator trace.

``layout`` (per-sample canonical tensors) -> ``digest`` (xxh3_64 per tensor and row) ->
``recorder`` (records buffered per step, handed to ``drifttool.artifact.writer``); ``trace`` keeps
the operator trace. Source: design.md, "Identity of a captured tensor" and "Digests".
"""
