"""Replay inputs that a chain or edit run made itself, and what those stages read.

    >>> made_inputs(run.manifest)                # a prompt run (``drifttool run --prompt``)
    {'txt': 'text_encoder', 'txt_mask': 'text_encoder', 'neg_txt': 'text_encoder', ...}
    >>> stage_sources(run_a.manifest, run_b.manifest)
    ["chain.prompts: ['a cube'] != ['a ball']"]

A prompt run (manifest ``chain``) encodes its prompts before the artifact opens: the text encoder's
output embeddings and masks are the trajectory's replay inputs ``txt``, ``txt_mask``, ``neg_txt``,
``neg_mask`` (``drifttool.chain``). An edit run (manifest ``edit``) makes its condition latents
``cond`` (VAE encode) and, when it encoded prompts, the same prompt inputs
(``drifttool.chain_edit``). Those stages run at step −1 under their own component, before the
trajectory, and their records are in the artifact: a drift inside them is born in a record, not in
the replay inputs. What those stages read is in the manifest: the prompts, the negative prompts and
the condition images (their SHA-256) — ``stage_sources`` compares them.
"""

from __future__ import annotations

import json
from typing import Any

from drifttool.artifact.schema import DEFAULT_COMPONENT

PROMPT_INPUTS = ("txt", "txt_mask", "neg_txt", "neg_mask")
"""Replay inputs the text encoder makes in a run that encoded its prompts."""

CONDITION_INPUTS = ("cond", "cond_grids")
"""Replay inputs the VAE encode makes in an edit run."""

STAGE_WORDS = {"text_encoder": "the text encoder's output", "vae": "the VAE encode's output"}
"""An early stage's made input, in words."""


def stage_section(manifest: dict) -> tuple[str, dict] | None:
    """(``chain`` or ``edit``, that manifest section) of a run with stages around its trajectory,
    else None."""
    for key in ("chain", "edit"):
        rec = manifest.get(key)
        if isinstance(rec, dict):
            return key, rec
    return None


def made_inputs(manifest: dict) -> dict[str, str]:
    """``{replay input key: component that made it}`` for a run whose early stages made inputs
    (module docstring); empty for a run given its inputs (fixture, files)."""
    found = stage_section(manifest)
    if found is None:
        return {}
    key, rec = found
    out = {k: "text_encoder" for k in PROMPT_INPUTS} if rec.get("prompts") is not None else {}
    if key == "edit":
        out.update({k: "vae" for k in CONDITION_INPUTS})
    return out


def made_by_both(ma: dict, mb: dict) -> dict[str, str]:
    """The replay inputs that both runs' early stages made, each by the same component."""
    a, b = made_inputs(ma), made_inputs(mb)
    return {k: c for k, c in a.items() if b.get(k) == c}


def input_key(line: str) -> str:
    """The replay input an ``input_differences`` line names (``inputs.txt: ...`` → ``txt``)."""
    return line.split(":", 1)[0].removeprefix("inputs.")


def _images(rec: dict) -> Any:
    return [i.get("sha256") for i in rec.get("condition_images") or []] or None


def stage_sources(ma: dict, mb: dict) -> list[str] | None:
    """What the early stages of two chain or edit runs read, where it differs: prompts, negative
    prompts, condition images (SHA-256), one line each (``section.field: a != b``); empty when
    all agree; None when a run records none of it (neither a chain nor an edit run)."""
    fa, fb = stage_section(ma), stage_section(mb)
    if fa is None or fb is None:
        return None
    (ka, ra), (_, rb) = fa, fb
    out = []
    for field, get in (("prompts", lambda r: r.get("prompts")),
                       ("negative_prompts", lambda r: r.get("negative_prompts")),
                       ("condition_images", _images)):
        va, vb = get(ra), get(rb)
        if va != vb:
            out.append(f"{ka}.{field}: {shown_value(va)} != {shown_value(vb)}")
    return out


MISSING = object()
"""A key one side's manifest lacks (``shown_value`` shows it as ``<missing>``)."""
MAX_VALUE = 1000
"""Characters of a value a context line shows whole; a longer one (a long list) shows its first
``MAX_VALUE`` and says how many characters it has."""


def shown_value(v: Any) -> str:
    """A manifest value in a context line as the manifest writes it (JSON: ``null``, ``"text"``,
    ``[1, 2]``), ``<missing>`` for ``MISSING``; whole up to ``MAX_VALUE`` characters (a
    description such as ``fingerprint.inputs.rope_tables`` is read to its end)."""
    s = "<missing>" if v is MISSING else json.dumps(v, ensure_ascii=False, default=str)
    return s if len(s) <= MAX_VALUE else f"{s[:MAX_VALUE]}… ({len(s)} characters)"


def is_early_stage(component: str, step: int) -> bool:
    """Whether a record of ``component`` at ``step`` belongs to an early stage (text encoder, VAE
    encode: step −1, not the transformer), which reads no replay input of the artifact."""
    return component != DEFAULT_COMPONENT and step < 0
