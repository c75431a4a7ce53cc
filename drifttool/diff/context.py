"""What stands around the records: fields that forbid alignment, and differences worth listing.

    >>> incomparable(run_a.manifest, run_b.manifest)
    ['fingerprint.arch.num_layers: 2 != 60']
    >>> context(run_a, run_b)
    ['fingerprint.runtime.mode: "strict" != "auto"',
     'inputs.noise: differs (dtype, shape or bytes)',
     'trace b0 img qk_rmsnorm#0: requested strict->production, actual strict->production', ...]

Incomparable (design.md, "Diff"): schema versions differ, ``fingerprint["arch"]`` (the
architecture's shape fields) differs, or a capture level is missing/unknown. Everything else —
the rest of the fingerprint, capture levels, replay inputs, the operator trace — is context: listed
first in the report, and the runs are still diffed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

import numpy as np

from drifttool.artifact import compute as ac
from drifttool.artifact import schema as S
from drifttool.artifact.raw import RawTensor
from drifttool.artifact.reader import Run
from drifttool.diff.stages import MISSING as _MISSING
from drifttool.diff.stages import STAGE_WORDS, input_key, made_by_both, shown_value, stage_sources

MAX_LISTED = 20  # context lines per kind (fingerprint, inputs)
MAX_TRACE = 6  # trace sites listed (a mode change makes every site differ)


def _flatten(d: Any, prefix: str) -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}.{k}"))
    return out




def dict_differences(a: Any, b: Any, prefix: str) -> list[str]:
    """``"key: a != b"`` for every differing leaf of two nested dicts (dotted keys)."""
    fa, fb = _flatten(a, prefix), _flatten(b, prefix)
    out = []
    for k in sorted(set(fa) | set(fb)):
        va, vb = fa.get(k, _MISSING), fb.get(k, _MISSING)
        if va is _MISSING or vb is _MISSING or va != vb:
            out.append(f"{k}: {shown_value(va)} != {shown_value(vb)}")
    return out


def incomparable(ma: dict, mb: dict) -> list[str]:
    """Why manifests ``ma`` and ``mb`` cannot be aligned (empty list: they can)."""
    out = []
    if ma["schema_version"] != mb["schema_version"] and not (
            {ma["schema_version"], mb["schema_version"]} <= S.ALIGNABLE_SCHEMA_VERSIONS):
        out.append(f"schema_version: {ma['schema_version']} != {mb['schema_version']}")
    fa, fb = ma.get("fingerprint") or {}, mb.get("fingerprint") or {}
    out += dict_differences(fa.get("arch", {}), fb.get("arch", {}), "fingerprint.arch")
    for side, m in (("A", ma), ("B", mb)):
        if (m.get("settings") or {}).get("mode") == "off":
            out.append(f"run {side} was made with --mode off, which captures nothing to compare")
        elif m.get("capture_level") not in S.LEVELS:
            out.append(f"capture_level of run {side}: {m.get('capture_level')!r} is not one of "
                       f"{S.LEVELS}")
    return out


def context(run_a: Run, run_b: Run, inputs: list[str], *, internals_aside: bool = False) -> list[str]:
    """Differences outside the records: fingerprint (not ``arch``), capture level, the replay
    ``inputs`` that differ (``input_differences``), trace. With ``internals_aside`` (the diff
    leaves the fused attention's internal records aside: ``compare.internals_of``), the trace
    sites of those internal operators that only one run holds are left out too.

    Raises:
        ArtifactError: unreadable inputs or trace.
    """
    ma, mb = run_a.manifest, run_b.manifest
    fa, fb = ma.get("fingerprint") or {}, mb.get("fingerprint") or {}
    out = dict_differences({k: v for k, v in fa.items() if k != "arch"},
                           {k: v for k, v in fb.items() if k != "arch"}, "fingerprint")
    if ma["capture_level"] != mb["capture_level"]:
        out.append(f"capture_level: {ma['capture_level']} != {mb['capture_level']}")
    inputs = inputs + prompt_layouts(run_a, run_b)
    aside = {*internal_ops(run_a), *internal_ops(run_b)} if internals_aside else set()
    return out + (stage_sources(ma, mb) or []) + inputs + _trace_differences(run_a, run_b, aside)


def internal_ops(run: Run) -> dict[str, int]:
    """How many op records of role ``internal`` (the fused attention's decomposition at L2)
    ``run`` holds, per operator."""
    t = run.ops_table()
    if "role" not in t.column_names:
        return {}
    ops = ac.filter(t["op"], ac.call("equal", t["role"], "internal")).to_pylist()
    return dict(Counter(ops))


def shown_context(lines: list[str]) -> list[str]:
    """``context``'s lines as a person reads them: at most ``MAX_LISTED`` fingerprint and
    ``MAX_LISTED`` input lines, ``MAX_TRACE`` trace lines, each kind's last line saying how many
    were left out (the report's data keeps every line)."""
    kinds: dict[str, list[str]] = {"other": [], "inputs": [], "trace": []}
    for line in lines:
        kind = "trace" if line.startswith("trace ") else "inputs" if line.startswith("inputs.") else "other"
        kinds[kind].append(line)
    return (_capped(kinds["other"], MAX_LISTED) + _capped(kinds["inputs"], MAX_LISTED)
            + _capped(kinds["trace"], MAX_TRACE))


_SAMPLE_AXIS = {"x0": 0, "noise": 1, "txt": 0, "txt_mask": 0, "neg_txt": 0, "neg_mask": 0}


_MASKS = {"txt": "txt_mask", "neg_txt": "neg_mask"}  # prompt -> its [B, L] key mask (None: all valid)


def _row(t: dict[str, RawTensor], sid: int) -> int:
    """Batch row of logical sample ``sid`` in replay inputs ``t``."""
    return t["sample_ids"].array.tolist().index(sid)


def _common_samples(ia: dict[str, RawTensor], ib: dict[str, RawTensor]) -> list[int] | None:
    """Logical samples both runs hold; None when either run's inputs name no samples."""
    if "sample_ids" not in ia or "sample_ids" not in ib:
        return None
    return sorted(set(ia["sample_ids"].array.tolist()) & set(ib["sample_ids"].array.tolist()))


def _per_sample(t: dict[str, RawTensor], key: str, sid: int) -> RawTensor:
    """Sample ``sid``'s slice of replay input ``key``; a prompt keeps only the rows its mask
    marks valid, wherever the padding is (left, right, or none)."""
    x = np.take(t[key].array, _row(t, sid), axis=_SAMPLE_AXIS[key])
    mask = _MASKS.get(key)
    if mask in t:
        x = x[t[mask].array[_row(t, sid)].astype(bool)]
    return replace(t[key], array=x)


def _valid_rows(t: dict[str, RawTensor], key: str, sid: int) -> tuple[int, int, int]:
    """(first valid row, one past the last, padded length) of sample ``sid``'s prompt ``key``."""
    width = t[key].array.shape[1]
    if _MASKS[key] not in t:
        return 0, width, width
    valid = np.flatnonzero(t[_MASKS[key]].array[_row(t, sid)])
    return (int(valid[0]), int(valid[-1]) + 1, width) if valid.size else (0, 0, width)


def input_differences(run_a: Run, run_b: Run) -> list[str]:
    """The replay inputs that differ, or that one run lacks, as logical per-sample inputs: for
    every common sample its x0, its SDE noise and its prompts' valid rows (padding and masks
    removed: the prompt layout is an execution layout, named by ``prompt_layouts``); other
    inputs (``img_grid``) whole. Samples held by one run only are not inputs to compare. Inputs
    that name no samples are compared whole, masks included. An input both runs made in an early
    stage (the text encoder's embeddings of a prompt run: ``drifttool.diff.stages``) says so
    (``inputs.txt: differs for common samples [0] — the text encoder's output in both runs``)."""
    ia, ib = run_a.raw_inputs(), run_b.raw_inputs()
    if bool(ia) != bool(ib):
        return [f"inputs.safetensors: only in run {'A' if ia else 'B'}"]
    common = _common_samples(ia, ib)
    logical = set() if common is None else {"sample_ids", *_MASKS.values()}
    out = []
    for k in sorted((set(ia) | set(ib)) - logical):
        if (k in ia) != (k in ib):
            out.append(f"inputs.{k}: only in run {'A' if k in ia else 'B'}")
        elif common is None or k not in _SAMPLE_AXIS:
            if ia[k].digest() != ib[k].digest():
                out.append(f"inputs.{k}: differs (dtype, shape or bytes)")
        else:
            bad = [sid for sid in common if _per_sample(ia, k, sid).digest() != _per_sample(ib, k, sid).digest()]
            if bad:
                shown = ", ".join(map(str, bad[:8])) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
                out.append(f"inputs.{k}: differs for common sample{'s' if len(bad) > 1 else ''} {shown}")
    made = made_by_both(run_a.manifest, run_b.manifest)
    return [f"{line} — {STAGE_WORDS[made[input_key(line)]]} in both runs"
            if input_key(line) in made and ": differs" in line else line for line in out]


def prompt_layouts(run_a: Run, run_b: Run) -> list[str]:
    """Common samples whose prompt sits at other rows of the padded batch (left padding, or
    another padded length): context only, not an input difference (strict text RoPE counts
    positions from row 0, so left padding moves it: diffusers 0.42.1). Prompts of another length
    (another prompt, another tokenizer) are said to be that, not moved rows."""
    ia, ib = run_a.raw_inputs(), run_b.raw_inputs()
    common = _common_samples(ia, ib)
    out = []
    for k in ("txt", "neg_txt") if common is not None else ():
        if k in ia and k in ib:
            spans = {sid: (_valid_rows(ia, k, sid), _valid_rows(ib, k, sid)) for sid in common}
            longer = {sid: ab for sid, ab in spans.items() if ab[0][1] - ab[0][0] != ab[1][1] - ab[1][0]}
            moved = {sid: ab for sid, ab in spans.items() if ab[0][:2] != ab[1][:2] and sid not in longer}
            if longer:
                sid, ((a0, a1, _), (b0, b1, _)) = next(iter(longer.items()))
                out.append(f"inputs.{k}: the prompts' lengths differ for common samples "
                           f"{sorted(longer)} (sample {sid}: {a1 - a0} vs {b1 - b0} tokens)")
            if moved:
                sid, ((a0, a1, la), (b0, b1, lb)) = next(iter(moved.items()))
                out.append(f"inputs.{k}: prompt rows moved for common samples {sorted(moved)} "
                           f"(sample {sid}: rows [{a0}, {a1}) of {la} vs [{b0}, {b1}) of {lb})")
    return out


def _capped(lines: list[str], n: int) -> list[str]:
    """At most ``n`` lines, the last one saying how many were left out."""
    return lines if len(lines) <= n else lines[: n - 1] + [f"... and {len(lines) - n + 1} more"]


def _trace_differences(run_a: Run, run_b: Run, aside: set[str] = frozenset()) -> list[str]:
    """One line per operator call site whose trace entry differs (backend, kernel, contract,
    device type). A site's entries of all ranks are merged (ranks are no part of a site's
    identity, as of a record's): each field lists its distinct values; a device is compared by
    type (``cuda:1`` on rank 1 is ``cuda`` as ``cuda:0`` on rank 0). A site of an operator in
    ``aside`` that only one run holds is not listed. Sites are listed in program order (blocks
    before, in and after the model, then the sampler), run A's first."""
    keep = ("requested", "actual", "kernel", "contract", "fallback", "device")
    order: dict[str, tuple] = {}

    def sites(run: Run) -> dict[str, dict]:
        out: dict[str, dict[str, set]] = {}
        blocks = lambda comp: S.model_blocks(run.manifest, comp)  # noqa: E731 - after the last block
        for r in run.trace_rows():
            comp = r.get("component") or S.DEFAULT_COMPONENT
            name = "" if comp == S.DEFAULT_COMPONENT else f"{comp} "
            key = f"{name}{S.short_site(r['block'], r['stream'], r['op'], r['call'], blocks(comp))}"
            site = out.setdefault(key, {k: set() for k in keep})
            block = 1 << 30 if r["block"] == S.SAMPLER_BLOCK else r["block"]  # the sampler last
            order.setdefault(key, (name, block, r["stream"], r["op"], r["call"]))
            for k in keep:
                v = r[k]
                site[k].add(str(v).split(":", 1)[0] if k == "device" and v is not None else v)
        return {s: {k: "/".join(sorted(map(str, v))) for k, v in f.items()} for s, f in out.items()}

    ta, tb = sites(run_a), sites(run_b)
    out = []
    for site in sorted(set(ta) | set(tb), key=lambda k: (k not in ta, order[k], k)):
        if site not in ta or site not in tb:
            if site.rsplit(" ", 1)[-1].split("#")[0] not in aside:
                out.append(f"trace {site}: only in run {'A' if site in ta else 'B'}")
        elif ta[site] != tb[site]:
            diffs = [f"{k} {ta[site][k]}->{tb[site][k]}" for k in keep
                     if ta[site][k] != tb[site][k]]
            out.append(f"trace {site}: " + ", ".join(diffs))
    return out
