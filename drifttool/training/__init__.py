"""drifttool.training: the training side, above the sampler.

Re-executing and re-scoring stored rollouts, and the loops that train on them:

- ``stored``: load and verify a rollout artifact (``load_rollout`` → ``StoredRollout``);
- ``options``: what a replay or recompute may override (``RerunOptions``) and the trainer's
  execution layout (``TrainOptions``);
- ``trainer``: the trainer's model (``trainer_model``, ``check_fingerprint``) and its
  micro-batched forward (``micro_batched``);
- ``recompute``: phase ``train`` re-scoring of a stored rollout (``recompute_run``);
- ``replay``: re-execution of a rollout from its replay inputs (``replay_run``);
  ``chain_replay``: of a prompt or edit run, every stage from its pipeline folder;
- ``grpo``: a small Flow-GRPO loop; ``experiment``: rollout/trainer backend combinations.

Imports go one way (docs/architecture.md, tests/test_layering.py): ``training`` imports the
runner, ``lifecycle``, ``settings``, ``artifact`` (reader), ``diff`` and ``sampling``; nothing
below it (``sampling``, ``model``, ``ops``, ``capture``, ``artifact``, ``diff``) imports
``training``.
"""
