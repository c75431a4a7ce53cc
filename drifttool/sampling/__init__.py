"""drifttool.sampling: the sampler — pinned noise (``noise``), replay inputs (``inputs``), the
rollout loop with its sigma table, CFG and SDE step, and the step recompute (``rollout``).

It sits below the artifact, the runner and the training side and imports none of them
(tests/test_layering.py): a sampler can be driven by any caller that hands it a ``Runtime``.
"""
