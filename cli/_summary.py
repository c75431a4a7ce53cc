"""The settings rows of the summary tables of ``run``, ``replay`` and ``recompute``, from one key
list, so that each command shows a rollout's settings alike, and the row and warning that say
whether a GPU run's forwards replayed CUDA graphs:

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


def shown(value: Any) -> str:
    """A summary table's cell: ``yes``/``no`` for a flag, a list's items joined by ``, ``
    (``samples 0, 1``, ``img_grid 4, 6``), anything else as ``str`` gives it (not Python's
    ``True`` or ``[0, 1]``)."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (list, tuple)):
        return ", ".join(shown(v) for v in value)
    return str(value)


def settings_rows(record: Mapping[str, Any], *, skip: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """(key, value) rows of ``record`` for the keys of ``SETTINGS_KEYS`` it holds, but ``skip``
    (those the table shows from another source)."""
    return [(k, shown(record[k])) for k in SETTINGS_KEYS
            if record.get(k) is not None and k not in skip]


def graph_rows(summary: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The ``CUDA graphs`` row of a command's summary (``model.graphs.graph_use``): how many graphs
    were captured and how many calls replayed them, or that the capture was refused; no row when
    no graphs were tried (the CPU, a model that is not graphable)."""
    use = summary.get("cuda_graphs")
    if not use:
        return []
    if use["refused"]:
        return [("CUDA graphs", f"refused: ran eagerly ({use['replays']} replayed before)")]
    if not use["captures"] and not use["replays"]:  # a layout's collectives, or one call per signature
        return [("CUDA graphs", "none captured: every call ran eagerly")]
    return [("CUDA graphs", f"{use['captures']} captured, {use['replays']} calls replayed")]


def graph_warning(summary: Mapping[str, Any]) -> str | None:
    """One line for a refused CUDA graph capture: why, and that the run went on eagerly (the same
    bytes, the host's launch overhead back). None otherwise."""
    use = summary.get("cuda_graphs") or {}
    if not use.get("refused"):
        return None
    return (f"CUDA graph capture refused ({use['refused']}); the run went on eagerly: the same bytes, "
            "without the graphs' speed")


def internals_note(given: bool | None, mode: str, capture: str) -> str | None:
    """The note for ``--internals``/``--no-internals`` (``given``; None: not given) where it changes
    nothing: below L2, or in a mode outside the strict family (production attention is one fused
    call that exposes no internals); None where it applies."""
    from drifttool.artifact.levels import captures_internals  # lazy: keeps pyarrow out of `drifttool --help`
    from drifttool.artifact.manifest_schema import STRICT_MODES  # lazy: likewise

    if given is None:
        return None
    if not captures_internals(capture):
        why = f"at capture {capture}: only L2 captures the attention's internals"
    elif mode not in STRICT_MODES:
        why = f"in mode {mode}: production attention exposes no internals"
    else:
        return None
    return f"--{'' if given else 'no-'}internals changes nothing {why}"
