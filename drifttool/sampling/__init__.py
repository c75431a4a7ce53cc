"""drifttool.sampling: the sampler — its settings (``config``), pinned noise (``noise``), replay
inputs (``inputs``, ``input_files``), one denoising step with its CFG branches, SDE step and step
records (``step``), the rollout loop with its sigma table and the training recompute
(``rollout``), and the production presets (``presets``).

It sits below the artifact, the runner and the training side and imports none of them
(tests/test_layering.py): a sampler can be driven by any caller that hands it a ``Runtime``.
"""
