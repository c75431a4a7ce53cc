"""The trainer's model and its execution layout.

    >>> model = prepare_trainer(load_rollout("runs/a"), RerunOptions())   # manifest's model
    >>> fwd = micro_batched(sampler_model(model), 1)      # one sample (+ its CFG pair) per forward

``trainer_model`` rebuilds the model the rollout manifest names (fixture or checkpoint, dtype,
LoRA adapter) and ``check_fingerprint`` refuses one whose architecture or weight digest differs
from the rollout's. ``micro_batched`` is the trainer's execution layout (Flow-GRPO's per-sample
forwards with trimmed prompts); strict bytes do not depend on it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from drifttool.capture.digest import dtype_name
from drifttool.diff.context import dict_differences
from drifttool.errors import ArtifactError, DriftToolError
from drifttool.fixture import load_fixture
from drifttool.model.checkpoint import load_checkpoint
from drifttool.model.lora_io import fingerprinted, lora_record
from drifttool.model.weights import weight_digest
from drifttool.setting_checks import DTYPES, check_device
from drifttool.training.options import RerunOptions
from drifttool.training.stored import StoredRollout


def rerun_device(stored: StoredRollout, options: RerunOptions) -> str:
    """The device of a replay or recompute: the options', else the rollout's recorded device
    (``cpu`` when the manifest records none), checked (``setting_checks.check_device``).

    Raises:
        DriftToolError: unknown device; CUDA unavailable (a GPU rollout replayed on a machine
            without one: pass ``--device cpu``).
    """
    return check_device(options.device or stored.settings.get("device") or "cpu")


def trainer_model(stored: StoredRollout, *, fixture: str | Path | None = None,
                  checkpoint: str | Path | None = None, lora: str | Path | None = None,
                  device: str | torch.device = "cpu"):
    """The model the rollout manifest names (``checkpoint`` setting, else the fixture's model),
    in its dtype, with its LoRA adapter, loaded onto ``device``; each can be overridden (checked
    by ``check_fingerprint`` afterwards).

    Raises:
        DriftToolError: the fixture or checkpoint cannot be loaded.
    """
    s = stored.settings
    ckpt = checkpoint or s.get("checkpoint")
    if ckpt is None:
        name = fixture or s.get("fixture")
        if name is None:
            raise DriftToolError(f"{stored.path}: the manifest names no fixture or checkpoint; "
                                 "pass one")
        ckpt = load_fixture(name).model_dir
    dtype = DTYPES.get(s.get("dtype", "float32"))
    if dtype is None:
        raise ArtifactError(f"{stored.path}: unsupported model dtype {s.get('dtype')!r}")
    adapter = lora or s.get("lora")  # loaded with the weights, in the mode the rollout ran it
    return load_checkpoint(ckpt, dtype=dtype, variant=None if checkpoint else s.get("variant"),
                           device=device, lora=adapter, lora_mode=s.get("lora_mode") or "merged")


def check_fingerprint(stored: StoredRollout, model) -> None:
    """Refuse a model for a replay or recompute that is not the rollout's: architecture (with the
    image grid), model dtype, weight digest (base and adapter weights), adapter digest.

    Raises:
        DriftToolError: naming every differing field.
    """
    fp = stored.manifest.get("fingerprint") or {}
    arch = {**model.config.arch_fields(), "img_grid": list(stored.inputs.img_grid)}
    diffs = dict_differences(fp.get("arch", {}), arch, "arch")
    dt = dtype_name(model.dtype)
    if (fp.get("dtype_policy") or {}).get("weights") != dt:
        diffs.append(f"dtype: rollout {(fp.get('dtype_policy') or {}).get('weights')!r}, loaded {dt!r}")
    wd = weight_digest(fingerprinted(model))
    if fp.get("weights") != wd:
        diffs.append(f"weights: rollout {fp.get('weights')}, loaded {wd}")
    ra = (stored.manifest.get("lora") or {}).get("digest")
    ta = (lora_record(model) or {}).get("digest")
    if ra != ta:
        diffs.append(f"lora adapter: rollout {ra}, loaded {ta}")
    if diffs:
        raise DriftToolError(f"{stored.path}: the rollout's fingerprint differs from the model loaded "
                             "to re-run it: " + "; ".join(diffs))


def check_micro_batch(size: int | None, batch: int) -> None:
    """Refuse a micro-batch ``size`` (samples per trainer forward, ``micro_batched``; None: the
    whole batch) larger than the ``batch`` of samples it splits: it would run the whole batch in
    one forward, as no micro-batch does, while the settings record the size asked for.

    Raises:
        DriftToolError: one line naming ``--micro-batch`` and the sizes it may take.
    """
    if size is not None and size > batch:
        raise DriftToolError(f"--micro-batch {size} is more than the {batch} sample(s) of the batch it "
                             f"splits into trainer forwards; give 1 to {batch}")


def micro_batched(forward: Callable[..., torch.Tensor], size: int | None, *,
                  trim_padding: bool = True) -> Callable[..., torch.Tensor]:
    """A trainer's execution layout around ``forward(x, txt, txt_mask, tau, img_grid, rt)``: the
    rows of each logical sample (with batched CFG: its cond and its uncond row, so the pinned CFG
    layout is kept) are run ``size`` samples per forward, and with ``trim_padding`` each
    micro-batch's prompts are cut after its last valid text row (mask dropped when all valid, as
    the pipeline does; left padding is kept, since text RoPE positions count from row 0), as Flow-GRPO's ``compute_log_prob`` trims embeddings. Identity scopes
    (samples, text lengths, per-row branches) are sliced per micro-batch and the call counters
    restart for each, so the records align with the whole-batch rollout's. ``size=None``:
    ``forward`` unchanged. Strict bytes do not change (batch- and padding-invariant operators);
    production bytes may.
    """
    if size is None:
        return forward
    size = int(size)
    if size < 1:
        raise DriftToolError(f"micro-batch size must be >= 1, got {size}")

    def run(x, txt, txt_mask, tau, img_grid, rt, **conditions):
        scope = rt.current_scope()
        samples = list(scope["samples"]) if scope.get("samples") is not None else list(range(x.shape[0]))
        lens, starts = scope.get("txt_lens"), scope.get("txt_starts")
        branch = scope.get("branch")
        order = list(dict.fromkeys(samples))
        out = None
        with rt.parts() as part:  # each micro-batch restarts the call counters (Runtime.parts)
            for c in range(0, len(order), size):
                chunk = set(order[c:c + size])
                idx = [r for r, sid in enumerate(samples) if sid in chunk]
                sel = torch.tensor(idx, dtype=torch.long, device=x.device)
                t, m = txt[sel], None if txt_mask is None else txt_mask[sel]
                if trim_padding and m is not None:
                    # cut the padding after the last valid row of the micro-batch only: text RoPE
                    # positions count from row 0, so leading (left) padding stays where it is
                    ends = torch.where(m.any(dim=1), m.shape[1] - m.flip(1).to(torch.uint8).argmax(dim=1), 0)
                    width = int(ends.max())  # [B] one past each row's last valid text row
                    t, m = t[:, :width], m[:, :width]
                    m = None if bool(m.all()) else m
                sub = {"samples": [samples[r] for r in idx]}
                if lens is not None:
                    sub["txt_lens"] = [lens[r] for r in idx]
                if starts is not None:
                    sub["txt_starts"] = [starts[r] for r in idx]
                if branch is not None and not isinstance(branch, str):
                    sub["branch"] = tuple(branch[r] for r in idx)
                with part(**sub):
                    kw = {k: c[sel] if k == "cond" else c for k, c in conditions.items()}  # edit runs
                    v = forward(x[sel], t, m, tau[sel], img_grid, rt, **kw)
                if out is None:
                    out = v.new_empty((x.shape[0], *v.shape[1:]))
                out = out.index_copy(0, sel, v)
        return out

    return run


def prepare_trainer(stored: StoredRollout, options: RerunOptions, model=None):
    """The trainer's model for a replay or recompute of ``stored``: ``model`` if given, else
    ``trainer_model`` with the options' overrides on ``rerun_device``; fingerprint-checked
    either way.

    Raises:
        DriftToolError: a LoRA override of a rollout that ran without one; fingerprint mismatch.
    """
    if model is None:
        model = trainer_model(stored, fixture=options.fixture, checkpoint=options.checkpoint,
                              lora=options.lora, device=rerun_device(stored, options))
    if options.lora is not None and not stored.manifest.get("lora"):
        raise DriftToolError(f"{stored.path}: the rollout ran without a LoRA adapter, and a replay or "
                             "recompute re-runs the rollout's own model: drop --lora (to check an "
                             "adapter, roll out with it first: drifttool run --lora ADAPTER)")
    check_fingerprint(stored, model)
    return model
