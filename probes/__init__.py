"""drifttool.probes: the probe matrix (RFC ``qwenimage_ablation_overlay``).

``spec`` (a probe as data) → ``catalog`` (the declared list) → ``variants`` / ``weights`` /
``controls`` (the one change of each probe) → ``runner`` (baseline + probes, diff, judge) →
``matrix`` (table, Arrow, JSON) and ``plots`` (heatmaps, overlays). ``peer`` runs the matrix
against diffusers' transformer (declarations in ``peer_catalog``).
See ``docs/probes.md``.
"""
