"""The settings rows of the summary tables of ``run``, ``replay`` and ``recompute``, from one key
list, so that each command shows a rollout's settings alike:

    fixture    tiny-t2i        cfg_layout  batched
    dtype      bfloat16        lora_mode   merged      (only with an adapter)

The rows come from a settings record (``settings.RunSettings.record``, or a stored rollout's
manifest ``settings``, the same dict); a key the record lacks (``preset`` without a preset,
``lora_mode`` without an adapter, ``internals`` unless an L2 capture left them out) gives no row.
"""

from __future__ import annotations

from typing import Any, Mapping

SETTINGS_KEYS = ("fixture", "dtype", "cfg_scale", "eta", "seed", "img_grid", "cfg_layout", "preset",
                 "lora_mode", "internals")
"""The settings a summary table shows, in its order."""


def settings_rows(record: Mapping[str, Any], *, skip: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """(key, value) rows of ``record`` for the keys of ``SETTINGS_KEYS`` it holds, but ``skip``
    (those the table shows from another source)."""
    return [(k, str(record[k])) for k in SETTINGS_KEYS
            if record.get(k) is not None and k not in skip]
