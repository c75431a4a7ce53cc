"""drifttool: byte-level train-rollout consistency checks for the Qwen-Image MMDiT.

Layout follows the data flow (see docs/architecture.md):
``ops/`` named RFC operators -> ``model/`` strict MMDiT -> ``sampling/`` sigma table, CFG, SDE step
-> ``capture/`` identity and digests -> ``artifact/`` Arrow trajectory files -> ``diff/`` first drift.
"""

__version__ = "0.1.0"
