"""drifttool.training: the training side, above the sampler.

Re-executing and re-scoring stored rollouts, and the loops that train on them:

- ``stored``: load and verify a rollout artifact (``load_rollout`` → ``StoredRollout``);
- ``options``: what a replay or recompute may override (``RerunOptions``) and the trainer's
  execution layout (``TrainOptions``);
- ``trainer``: the trainer's model (``trainer_model``, ``check_fingerprint``) and its
  micro-batched forward (``micro_batched``);
- ``recompute``: phase ``train`` re-scoring of a stored rollout (``recompute_run``);
- ``replay``: re-execution of a rollout from its replay inputs (``replay_run``);
- ``grpo``: a small Flow-GRPO loop; ``experiment``: rollout/trainer backend combinations.

Imports go one way: ``training`` → ``runner``/``lifecycle``/``settings`` → ``artifact``,
``capture``, ``diff`` → ``sampling`` → ``model`` → ``ops`` (docs/architecture.md);
``sampling`` imports nothing of this package.
"""
