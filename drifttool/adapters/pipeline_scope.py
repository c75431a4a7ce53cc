"""The identity scope of one transformer call inside an unmodified diffusers pipeline.

    >>> branch_of("uncond", seen=["cond"], step=3)      # the pipeline's cache_context name
    'uncond'
    >>> branch_of(None, seen=["cond"], step=3)          # no context: call order in the step
    'uncond'
    >>> img_grid_of([[(1, 4, 6)]] * 3)                  # QwenImagePipeline's img_shapes
    (4, 6)
    >>> timestep_policy_of(torch.bfloat16)
    'pipeline_bf16'

drifttool's sampler sets the scope itself (``drifttool.sampling.rollout``); inside
``QwenImagePipeline.__call__`` nothing does, so ``drifttool.adapters.pipeline_hooks`` derives it
from each transformer call's own arguments with these helpers: the CFG branch from diffusers'
``cache_context`` name (or, without one, from the call order within the step), the patch grid
from ``img_shapes``, the valid text rows from ``encoder_hidden_states_mask`` (read once per mask
tensor, ``TextRows``) and the timestep policy from the dtype the pipeline casts its timestep to.
Torch only; diffusers is not imported here.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from drifttool.errors import UnsupportedConfigError
from drifttool.sampling.step import txt_rows

BRANCHES = ("cond", "uncond")
"""The CFG branches a pipeline step may call the transformer for, in diffusers' call order."""


def branch_of(context: str | None, *, seen: Sequence[str], step: int) -> str:
    """The CFG branch of a transformer call.

    Args:
        context: the name of the ``transformer.cache_context(name)`` block the call runs in
            (QwenImagePipeline: ``"cond"``/``"uncond"``), or ``None`` when the caller set none.
        seen: branches already called in this step, in order.
        step: the step (for messages).

    Returns:
        ``context`` when given; otherwise the call order: the step's first call is ``"cond"``,
        its second ``"uncond"`` (QwenImagePipeline's order).

    Raises:
        UnsupportedConfigError: another context name (e.g. an edit pipeline's), a third call in
            one step, or a branch called twice in one step.
    """
    if context is not None:
        if context not in BRANCHES:
            raise UnsupportedConfigError(
                f"transformer called under cache_context({context!r}) in step {step}: the pipeline "
                f"capture knows the CFG branches {BRANCHES} only")
        branch = context
    elif len(seen) < len(BRANCHES):
        branch = BRANCHES[len(seen)]
    else:
        raise UnsupportedConfigError(
            f"step {step} calls the transformer more than {len(BRANCHES)} times without a "
            "cache_context: the CFG branch of the call is unknown")
    if branch in seen:
        raise UnsupportedConfigError(f"step {step} calls the transformer twice for branch "
                                     f"{branch!r}: a step holds one call per CFG branch")
    return branch


def image_grids_of(img_shapes: Any) -> tuple[tuple[int, int], tuple[tuple[int, int], ...]]:
    """The output grid and the condition images' grids of a call's ``img_shapes``:
    ``QwenImagePipeline``'s ``[[(1, h, w)]] * B`` gives ``((h, w), ())``; the edit pipelines'
    ``[[(1, h, w), (1, h_1, w_1), ...]] * B`` gives ``((h, w), ((h_1, w_1), ...))``
    (``drifttool.model.conditions``).

    Raises:
        UnsupportedConfigError: as ``img_grid_of``; rows with different image lists.
    """
    rows = img_shapes or []
    if rows and all(isinstance(r, list) and len(r) > 1 for r in rows):
        lists = {tuple(tuple(int(v) for v in s) for s in r) for r in rows}
        if len(lists) != 1 or any(len(s) != 3 for s in next(iter(lists))):
            raise UnsupportedConfigError(f"img_shapes {str(img_shapes)[:120]}: every batch row "
                                         "must hold the same (1, h, w) images")
        shapes = lists.pop()
        if any(f != 1 for f, _, _ in shapes):
            raise UnsupportedConfigError("img_shapes with several frames per image: one frame only")
        return (shapes[0][1], shapes[0][2]), tuple((h, w) for _, h, w in shapes[1:])
    return img_grid_of(img_shapes), ()


def img_grid_of(img_shapes: Any) -> tuple[int, int]:
    """The ``(h, w)`` patch grid of a call's ``img_shapes``: one ``(frames=1, h, w)`` per batch
    row (QwenImagePipeline passes ``[[(1, h, w)]] * B``; a bare ``[(1, h, w)] * B`` is accepted).

    Raises:
        UnsupportedConfigError: no shapes, several images per row (edit pipelines), more than one
            frame, or rows of different grids.
    """
    rows = [s[0] if isinstance(s, list) and len(s) == 1 else s for s in (img_shapes or [])]
    grids = {tuple(int(v) for v in s) for s in rows if isinstance(s, tuple) and len(s) == 3}
    if not rows or len(grids) != 1 or len(rows) != sum(1 for s in rows if isinstance(s, tuple)):
        raise UnsupportedConfigError(
            f"img_shapes {str(img_shapes)[:120]}: the pipeline capture needs one (1, h, w) image "
            "per batch row, the same for every row")
    frames, h, w = grids.pop()
    if frames != 1:
        raise UnsupportedConfigError(f"img_shapes with {frames} frames: one frame only")
    return (h, w)


TIMESTEP_POLICY_OF_DTYPE = {torch.bfloat16: "pipeline_bf16", torch.float32: "t_div_1000_fp32"}
"""QwenImagePipeline passes ``t.expand(B).to(latents.dtype) / 1000`` (t = fp32 σ·1000): with bf16
latents that is ``pipeline_bf16`` (t rounded to bf16, divided in bf16), with fp32 latents
``t_div_1000_fp32`` (``drifttool.ops.scheduler.TIMESTEP_POLICIES``)."""


def timestep_policy_of(dtype: torch.dtype) -> str:
    """The drifttool timestep policy of a pipeline whose latents (and timestep) are ``dtype``.

    Raises:
        UnsupportedConfigError: a dtype other than bf16 or fp32.
    """
    if dtype not in TIMESTEP_POLICY_OF_DTYPE:
        raise UnsupportedConfigError(f"pipeline latents of dtype {dtype}: the capture knows the "
                                     "timestep policies of bfloat16 and float32 latents")
    return TIMESTEP_POLICY_OF_DTYPE[dtype]


class TextRows:
    """Scope fields ``txt_lens``/``txt_starts`` of a call's prompt mask, read from the host once
    per mask tensor (the pipeline passes the same mask object at every step), so a transformer
    call costs no device-to-host read after the first one of its branch.

    A ``None`` mask means every text row is valid (diffusers drops an all-true mask).
    """

    def __init__(self) -> None:
        self._seen: dict[int, tuple[torch.Tensor, dict[str, Any]]] = {}

    def __call__(self, txt: torch.Tensor, mask: torch.Tensor | None) -> dict[str, Any]:
        """``{"txt_lens": [B ints], "txt_starts": [B ints] | None}`` of [B, L, D] prompts and
        their [B, L] mask (any dtype: nonzero = valid).

        Raises:
            UnsupportedConfigError: a row whose valid tokens are not one contiguous run.
        """
        if mask is None:
            return {"txt_lens": [int(txt.shape[1])] * int(txt.shape[0]), "txt_starts": None}
        hit = self._seen.get(id(mask))
        if hit is None or hit[0] is not mask:
            rows = txt_rows(txt, mask.detach().to("cpu", torch.bool))  # the one host read
            hit = self._seen[id(mask)] = (mask, rows)  # holds the mask: its id stays unique
        return hit[1]
