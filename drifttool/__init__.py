"""drifttool: byte-level train-rollout consistency checks for the Qwen-Image MMDiT.

Layout follows the data flow (see docs/architecture.md):
``ops/`` named RFC operators -> ``model/`` strict MMDiT -> ``sampling/`` sigma table, CFG, SDE step
-> ``capture/`` identity and digests -> ``artifact/`` Arrow trajectory files -> ``diff/`` first drift;
above them ``settings`` (typed run settings), ``lifecycle`` (one artifact life cycle), ``runner``
(the rollout job) and ``training/`` (replay, recompute, GRPO, experiments).
"""

__version__ = "0.1.0"
