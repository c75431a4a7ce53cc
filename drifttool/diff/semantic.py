"""The semantic pre-check: are two runs the same *program* before any byte is compared?

    >>> check = semantic_check(run_a, run_b, input_differences(run_a, run_b))
    >>> check.verdict, [str(d) for d in check.differences]
    ('mismatch', ['schedule: 14 vs 15 steps (sigma tables of 15 vs 16 points)'])

Two runs that sample with another schedule, CFG scale, timestep encoding, SDE window, noise,
LoRA adapter or weights (the transformer's, or a prompt run's text encoder or VAE) are different
programs: their records drift, but a numeric diff would call it "drift at flow_sigma_table" or
"the replay inputs differ" and leave the user to work out that the runs were never meant to agree.
This check reads the manifests and the operator traces only (no record) and names each
**program** difference, in this order:

=====================  =========================================================================
field                  compared from
=====================  =========================================================================
schedule               ``fingerprint.scheduler.num_steps`` and ``sigma_table`` (point count, then
                       values)
shift                  ``fingerprint.scheduler.image_seq_len`` (the dynamic shift's token count,
                       ``mu``'s input; ``None`` = the grid's h·w)
timestep encoding      ``fingerprint.scheduler.timestep_policy`` (the model timestep's value and
                       dtype)
CFG                    on/off (scale > 1 and a negative prompt in the replay inputs) and
                       ``fingerprint.cfg.cfg_scale`` when on
SDE                    ``fingerprint.sde.eta``; ``sde_window`` (``None`` = every step but the last)
noise                  provenance (``settings.seed``, ``replay.noise``: generator, seed derivation)
                       when the noise bytes (x0 or SDE noise) differ
LoRA                   presence, ``lora.digest``, ``lora.scale``, ``lora.mode``
weights                ``fingerprint.weights``, when the weight dtype and LoRA mode agree (both
                       change the digest of the weights a forward runs on)
text encoder weights   ``chain.text_encoder_weights`` (or ``edit.``) of two prompt or edit runs,
                       when the weight dtype agrees
VAE weights            ``chain.vae_weights`` (or ``edit.``), likewise
attention backend      the trace's attention call sites requested alike on one device type: the
                       actual backend, a fallback, or the kernel differs
=====================  =========================================================================

Everything else is an **execution** field and is not a semantic mismatch: runtime mode and
backend family (strict vs auto compares them on purpose), CFG layout (batched vs sequential),
parallel layout and ranks, device, capture level, model and latent dtypes, RoPE table algorithm,
replay of a stored run, a training recompute against its rollout, operator variants (a probe's one
change), prompt padding. A field one run does not record (a diffusers pipeline capture has no
drifttool seed) is listed in ``unrecorded``, never guessed. Prompt runs and edit runs record
their prompts (``chain.prompts``, ``edit.prompts``; compared by the diff as what the text encoder
read, ``drifttool.diff.stages``); the prompt embeddings' bytes are compared as replay inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from drifttool.artifact import schema as S
from drifttool.artifact.reader import Run
from drifttool.diff.stages import stage_section

ATTENTION_OPS = ("joint_attention_fused", "joint_attn_qk_gemm", "joint_attn_softmax",
                 "joint_attn_av_gemm")
"""The operators whose trace entries the attention-backend check reads."""


@dataclass(kw_only=True)
class ProgramDifference:
    """One program field that differs. ``field``: its name in the table above; ``a``/``b``: the
    values compared (JSON-ready); ``detail``: one line in words; ``keys``: the manifest keys (or
    ``trace``) it was read from."""

    field: str
    a: Any
    b: Any
    detail: str
    keys: list[str]

    def __str__(self) -> str:
        return f"{self.field}: {self.detail}"


@dataclass(kw_only=True)
class SemanticCheck:
    """Result of ``semantic_check``: ``verdict`` ``"match"`` or ``"mismatch"``; ``differences``
    in the table's order (the first is the first finding); ``unrecorded``: program fields one run
    does not record, in words."""

    verdict: str
    differences: list[ProgramDifference] = field(default_factory=list)
    unrecorded: list[str] = field(default_factory=list)

    @property
    def mismatch(self) -> bool:
        return self.verdict == "mismatch"

    def words(self) -> str:
        """One line, e.g. ``the runs are different programs: 2 differences, first schedule``."""
        if not self.mismatch:
            return "the runs are the same program"
        n = len(self.differences)
        return (f"the runs are different programs: {n} difference{'s' if n > 1 else ''}, first "
                f"{self.differences[0]}")


def _get(m: dict, *path: str) -> Any:
    for k in path:
        if not isinstance(m, dict):
            return None
        m = m.get(k)
    return m


def _schedule(fa: dict, fb: dict) -> ProgramDifference | None:
    na, nb = _get(fa, "scheduler", "num_steps"), _get(fb, "scheduler", "num_steps")
    ta, tb = _get(fa, "scheduler", "sigma_table"), _get(fb, "scheduler", "sigma_table")
    keys = ["fingerprint.scheduler.num_steps", "fingerprint.scheduler.sigma_table"]
    if ta is None or tb is None:
        return None
    if na != nb or len(ta) != len(tb):
        return ProgramDifference(field="schedule", a={"steps": na, "points": len(ta)},
                                 b={"steps": nb, "points": len(tb)}, keys=keys,
                                 detail=f"{na} vs {nb} steps (sigma tables of {len(ta)} vs "
                                        f"{len(tb)} points)")
    bad = [i for i, (x, y) in enumerate(zip(ta, tb)) if x != y]
    if not bad:
        return None
    i = bad[0]
    return ProgramDifference(field="schedule", a=ta, b=tb, keys=keys,
                             detail=f"sigma tables of {len(ta)} points differ at {len(bad)} "
                                    f"point{'s' if len(bad) > 1 else ''}, first {i}: "
                                    f"{ta[i]!r} vs {tb[i]!r}")


def _seq_len(f: dict) -> int | None:
    n = _get(f, "scheduler", "image_seq_len")
    grid = _get(f, "arch", "img_grid")
    return n if n is not None or not grid else int(grid[0]) * int(grid[1])


def _plain(name: str, key: str, a: Any, b: Any, words: str) -> ProgramDifference | None:
    if a is None or b is None or a == b:
        return None
    return ProgramDifference(field=name, a=a, b=b, keys=[key], detail=f"{words} {a!r} vs {b!r}")


def _cfg_on(m: dict) -> bool:
    scale = _get(m, "fingerprint", "cfg", "cfg_scale")
    neg = "neg_txt" in (_get(m, "replay", "input_digests") or {})
    return scale is not None and scale > 1 and neg


def _cfg(ma: dict, mb: dict) -> ProgramDifference | None:
    sa, sb = _get(ma, "fingerprint", "cfg", "cfg_scale"), _get(mb, "fingerprint", "cfg", "cfg_scale")
    if sa is None or sb is None:
        return None
    on_a, on_b = _cfg_on(ma), _cfg_on(mb)
    keys = ["fingerprint.cfg.cfg_scale", "replay.input_digests.neg_txt"]

    def say(on: bool, s: float) -> str:
        return f"on (scale {s})" if on else "off"

    if on_a != on_b:
        return ProgramDifference(field="CFG", a={"on": on_a, "scale": sa},
                                 b={"on": on_b, "scale": sb}, keys=keys,
                                 detail=f"{say(on_a, sa)} vs {say(on_b, sb)}")
    if on_a and sa != sb:
        return ProgramDifference(field="CFG", a={"on": True, "scale": sa},
                                 b={"on": True, "scale": sb}, keys=keys,
                                 detail=f"scale {sa} vs {sb}")
    return None


def _sde(fa: dict, fb: dict) -> list[ProgramDifference]:
    out = []
    ea, eb = _get(fa, "sde", "eta"), _get(fb, "sde", "eta")
    d = _plain("SDE", "fingerprint.sde.eta", ea, eb, "eta")
    if d is not None:
        out.append(d)
    wa, wb = _get(fa, "sde", "sde_window"), _get(fb, "sde", "sde_window")
    if (wa is not None or wb is not None) and wa != wb and (ea or eb):
        na, nb = _get(fa, "scheduler", "num_steps"), _get(fb, "scheduler", "num_steps")
        ra = wa if wa is not None else [0, (na or 1) - 1]
        rb = wb if wb is not None else [0, (nb or 1) - 1]
        if list(ra) != list(rb):
            out.append(ProgramDifference(field="SDE", a=ra, b=rb, keys=["fingerprint.sde.sde_window"],
                                         detail=f"window [{ra[0]}, {ra[1]}) vs [{rb[0]}, {rb[1]})"))
    return out


_PROVENANCE = ("generator", "seed_derivation")


def _provenance(m: dict) -> dict[str, Any] | None:
    """Seed and generator of a run's noise, or None when it records neither."""
    noise = _get(m, "replay", "noise") or {}
    seed = _get(m, "settings", "seed")
    seed = noise.get("seed", seed) if seed is None else seed
    out = {"seed": seed, **{k: noise.get(k) for k in _PROVENANCE}}
    return None if seed is None and noise.get("generator") is None else out


def _noise(ma: dict, mb: dict, inputs: list[str]) -> tuple[ProgramDifference | None, list[str]]:
    differ = [k for k in ("x0", "noise") if any(d.startswith(f"inputs.{k}:") for d in inputs)]
    if not differ:
        return None, []
    pa_, pb = _provenance(ma), _provenance(mb)
    keys = ["settings.seed", "replay.noise"]
    what = " and ".join({"x0": "x0", "noise": "SDE noise"}[k] for k in differ)
    if pa_ is None or pb is None:
        side = "A" if pa_ is None else "B"
        return None, [f"noise: {what} differ and run {side} records no seed or generator"]
    if pa_ == pb:
        return None, []  # same provenance: the bytes differ through another field (steps, grid)
    parts = [f"{k} {pa_[k]!r} vs {pb[k]!r}" for k in pa_ if pa_[k] != pb[k]]
    return ProgramDifference(field="noise", a=pa_, b=pb, keys=keys,
                             detail=f"{what} differ: " + ", ".join(parts)), []


def _lora(ma: dict, mb: dict) -> ProgramDifference | None:
    la, lb = ma.get("lora"), mb.get("lora")
    if la is None and lb is None:
        return None
    if (la is None) != (lb is None):
        return ProgramDifference(field="LoRA", a=la is not None, b=lb is not None, keys=["lora"],
                                 detail=f"an adapter in run {'A' if la else 'B'} only")
    fields = {"digest": "digest", "scale": "scale", "mode": "mode"}
    va = {k: la.get(k) for k in fields}
    vb = {k: lb.get(k) for k in fields}
    va["mode"] = va["mode"] or _get(ma, "settings", "lora_mode")
    vb["mode"] = vb["mode"] or _get(mb, "settings", "lora_mode")
    parts = [f"{k} {va[k]!r} vs {vb[k]!r}" for k in fields if va[k] != vb[k]]
    if not parts:
        return None
    return ProgramDifference(field="LoRA", a=va, b=vb, keys=[f"lora.{k}" for k in fields],
                             detail=", ".join(parts))


def _weights(ma: dict, mb: dict) -> ProgramDifference | None:
    fa, fb = ma.get("fingerprint") or {}, mb.get("fingerprint") or {}
    same_dtype = _get(fa, "dtype_policy", "weights") == _get(fb, "dtype_policy", "weights")
    same_mode = _get(ma, "lora", "mode") == _get(mb, "lora", "mode")
    if not (same_dtype and same_mode):
        return None
    wa, wb = fa.get("weights"), fb.get("weights")
    return _plain("weights", "fingerprint.weights", wa, wb, "digest")


STAGE_WEIGHTS = (("text encoder weights", "text_encoder_weights"), ("VAE weights", "vae_weights"))
"""(field, manifest key) of the weight digests a chain or edit run records for its stages."""


def _stage_weights(ma: dict, mb: dict) -> list[ProgramDifference]:
    """The text encoder's and the VAE's weight digests of two chain or edit runs (their ``chain``
    or ``edit`` section), compared as ``fingerprint.weights`` is: when the weight dtype agrees
    (the stages load their weights in it) and both runs record the digest."""
    if _get(ma, "fingerprint", "dtype_policy", "weights") != _get(mb, "fingerprint", "dtype_policy",
                                                                  "weights"):
        return []
    sa, sb = stage_section(ma), stage_section(mb)
    if sa is None or sb is None:
        return []
    out = []
    for name, key in STAGE_WEIGHTS:
        d = _plain(name, f"{sa[0]}.{key}", sa[1].get(key), sb[1].get(key), "digest")
        if d is not None:
            d.keys = sorted({f"{sa[0]}.{key}", f"{sb[0]}.{key}"})
            out.append(d)
    return out


def _attention_sites(run: Run) -> dict[str, dict[str, str]]:
    """Attention call sites of a run's trace: ``{site: {field: values joined by '/'}}`` with the
    ranks' entries merged and devices compared by type, as ``context`` lists trace lines."""
    keep = ("requested", "actual", "kernel", "fallback", "reason", "device")
    out: dict[str, dict[str, set]] = {}
    for r in run.trace_rows():
        if r["op"] not in ATTENTION_OPS:
            continue
        comp = r.get("component") or S.DEFAULT_COMPONENT
        site = f"{'' if comp == S.DEFAULT_COMPONENT else comp + ' '}{S.short_site(r['block'], r['stream'], r['op'], r['call'])}"
        entry = out.setdefault(site, {k: set() for k in keep})
        for k in keep:
            v = r.get(k)
            entry[k].add(str(v).split(":", 1)[0] if k == "device" and v is not None else str(v))
    return {s: {k: "/".join(sorted(v)) for k, v in e.items()} for s, e in out.items()}


def _attention(run_a: Run, run_b: Run) -> ProgramDifference | None:
    """Attention sites that both runs requested alike on one device type but that ran another
    backend, fell back in one run only, or ran another kernel."""
    sa, sb = _attention_sites(run_a), _attention_sites(run_b)
    differ = []
    for site in sorted(set(sa) & set(sb)):
        a, b = sa[site], sb[site]
        if a["requested"] != b["requested"] or a["device"] != b["device"]:
            continue  # another family or device on purpose (strict vs auto, CPU vs CUDA)
        which = [k for k in ("actual", "fallback", "kernel") if a[k] != b[k]]
        if which:
            differ.append((site, which, a, b))
    if not differ:
        return None
    site, which, a, b = differ[0]
    words = ", ".join(f"{k} {a[k]} vs {b[k]}" for k in which)
    why = next((x["reason"] for x in (a, b) if x["fallback"] == "True" and x["reason"]), "")
    detail = (f"requested {a['requested']} in both, {words} at {len(differ)} site"
              f"{'s' if len(differ) > 1 else ''} (first {site})" + (f"; fallback: {why}" if why else ""))
    return ProgramDifference(field="attention backend", keys=["trace"], detail=detail,
                             a={k: a[k] for k in ("requested", *which)},
                             b={k: b[k] for k in ("requested", *which)})


def semantic_check(run_a: Run, run_b: Run, inputs: list[str]) -> SemanticCheck:
    """Compare the program fields of two runs (module docstring); ``inputs`` are the replay
    inputs that differ (``drifttool.diff.context.input_differences``), which decide whether the
    noise's provenance matters.

    Raises:
        ArtifactError: an unreadable trace.
    """
    ma, mb = run_a.manifest, run_b.manifest
    fa, fb = ma.get("fingerprint") or {}, mb.get("fingerprint") or {}
    found: list[ProgramDifference | None] = [
        _schedule(fa, fb),
        _plain("shift", "fingerprint.scheduler.image_seq_len", _seq_len(fa), _seq_len(fb),
               "dynamic shift from image_seq_len"),
        _plain("timestep encoding", "fingerprint.scheduler.timestep_policy",
               _get(fa, "scheduler", "timestep_policy"), _get(fb, "scheduler", "timestep_policy"),
               "policy"),
        _cfg(ma, mb),
        *_sde(fa, fb),
    ]
    noise, unrecorded = _noise(ma, mb, inputs)
    found += [noise, _lora(ma, mb), _weights(ma, mb), *_stage_weights(ma, mb),
              _attention(run_a, run_b)]
    for name, key in (("seed", ("settings", "seed")), ("sigma table", ("fingerprint", "scheduler",
                                                                       "sigma_table"))):
        missing = [s for s, m in (("A", ma), ("B", mb)) if _get(m, *key) is None]
        if len(missing) == 1:
            unrecorded.append(f"{name}: not recorded in run {missing[0]}")
    differences = [d for d in found if d is not None]
    return SemanticCheck(verdict="mismatch" if differences else "match", differences=differences,
                         unrecorded=unrecorded)
