"""Capture: identity, canonical layout, digests, the recorder and the operator trace.

``layout`` (per-sample canonical tensors) -> ``digest`` (digest v2 per tensor and row, on the
tensor's device, shard-combinable) ->
``recorder`` (records buffered per step, handed to ``drifttool.artifact.writer``); ``trace`` keeps
the operator trace. Source: design.md, "Identity of a captured tensor" and "Digests".
"""
