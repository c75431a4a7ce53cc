"""Which rank computed a row of a record in a TP/SP/CFG-parallel run (torch-free).

    >>> sp_row_spans(350, 2)                 # 6 blocks of 64 image rows: 3 and 3
    [(0, 192), (192, 350)]
    >>> row_owner({"kind": "parallel", "tp": 1, "sp": 2, "cfg_parallel": 1, "sp_attention": "agrs"},
    ...           dict(stream="img", block=0, op="multi_axis_rope", rank=0, txt_len=0,
    ...                img_h=10, img_w=35), row=192)
    1

A parallel run's record is *written* by one rank (TP and SP coordinate 0: ``rank`` column) from
the logical tensor that capture gathered; under SP its rows were *computed* by different ranks
(``drifttool.distributed.sp``). ``row_owner`` names the rank that computed a canonical row:

* image-stream records of the model (blocks −1..depth; the sampler's records at
  ``SAMPLER_BLOCK`` run replicated on the full latent): image row ``n`` lies in
  ``sp_row_spans(img_h·img_w, sp)[s]`` → SP coordinate ``s``;
* joint-stream records (rows = the ``txt_len`` text rows, then the image rows: the query axis,
  also for the ``B.SK`` score records ``joint_attn_qk_gemm``/``joint_attn_softmax``, whose row
  digests run over query positions): text rows are replicated and attributed to SP coordinate
  0, image row ``n = r − txt_len`` as above. Under ``--sp-attention ulysses`` the attention
  trades rows for heads (each SP rank computes every row of its heads), so no single rank
  computed a joint row: ``None``;
* anything else (text stream: replicated; per-sample records without rows; a layout without
  SP): ``None``.

The global rank is ``mesh_rank`` at ``{"cfg": c, "sp": s, "tp": 0}``, ``c`` the writer's CFG
coordinate (``writer // (sp·tp)``): the CFG rank that ran the branch. TP ranks share a row
(each its heads or channels); TP coordinate 0 is named.

The row split is ``drifttool.distributed.ring.sp_row_spans`` restated without torch (the diff
imports no torch: tests/cli/test_import_cost.py); tests/diff/test_row_owner.py checks that both
agree.
"""

from __future__ import annotations

from typing import Any, Mapping

BLOCK = 64  # image rows per query/key block (strict attention's KEY_TILE)
SEGMENTS = 8  # contract v2's image segments (3 levels of halving)
SAMPLER_BLOCK = -2  # artifact.schema.SAMPLER_BLOCK


def image_segments(n_blocks: int) -> list[tuple[int, int]]:
    """The 8 image segments [lo, hi) of block indices by recursive halving (mid = lo + ⌈n/2⌉)."""
    def split(lo: int, hi: int, depth: int) -> list[tuple[int, int]]:
        if depth == 0:
            return [(lo, hi)]
        mid = lo + -(-(hi - lo) // 2)
        return split(lo, mid, depth - 1) + split(mid, hi, depth - 1)

    return split(0, n_blocks, 3)


def sp_row_spans(n_img: int, sp: int) -> list[tuple[int, int]]:
    """Each SP rank's image rows [lo, hi) (``drifttool.distributed.ring.sp_row_spans``).

    Raises:
        ValueError: ``sp`` not in {1, 2, 4, 8} or ``n_img`` < 0.
    """
    if sp not in (1, 2, 4, 8) or n_img < 0:
        raise ValueError(f"sp_row_spans: sp {sp!r} (1, 2, 4 or 8), n_img {n_img!r} (>= 0)")
    segs, per = image_segments(-(-n_img // BLOCK)), SEGMENTS // sp
    return [(min(segs[r * per][0] * BLOCK, n_img), min(segs[(r + 1) * per - 1][1] * BLOCK, n_img))
            for r in range(sp)]


def mesh_rank(tp: int, sp: int, coords: Mapping[str, int]) -> int:
    """The global rank at ``coords`` of the mesh (cfg, sp, tp): ``(c·sp + s)·tp + t``
    (``drifttool.distributed.plan.mesh_rank``)."""
    return (coords.get("cfg", 0) * sp + coords.get("sp", 0)) * tp + coords.get("tp", 0)


def sp_layout(layout: Mapping[str, Any] | None) -> tuple[int, int, str] | None:
    """``(tp, sp, sp_attention)`` of a manifest layout of kind ``parallel`` with ``sp > 1``, else
    ``None``."""
    lay = layout or {}
    if lay.get("kind") != "parallel" or int(lay.get("sp", 1)) <= 1:
        return None
    return int(lay.get("tp", 1)), int(lay["sp"]), str(lay.get("sp_attention", "agrs"))


def row_owner(layout: Mapping[str, Any] | None, record: Mapping[str, Any], row: int) -> int | None:
    """The global rank that computed canonical row ``row`` of the op record ``record`` (its
    ``stream``, ``block``, ``rank`` (the writer), ``txt_len``, ``img_h``, ``img_w``) in a run of
    manifest ``layout``; ``None`` where no single SP rank computed it (see the module docstring)."""
    sp_lay = sp_layout(layout)
    if sp_lay is None:
        return None
    tp, sp, how = sp_lay
    stream, block = record.get("stream"), record.get("block")
    h, w = record.get("img_h"), record.get("img_w")
    if block is None or int(block) < -1 or h is None or w is None or row < 0:
        return None
    if stream == "img":
        text = 0
    elif stream == "joint" and how != "ulysses":
        text = int(record.get("txt_len") or 0)
    else:
        return None
    n_img = int(h) * int(w)
    n = row - text
    if n >= n_img:
        return None
    s = 0
    if n >= 0:
        s = next(i for i, (lo, hi) in enumerate(sp_row_spans(n_img, sp)) if lo <= n < hi)
    cfg = int(record["rank"]) // (sp * tp)
    return mesh_rank(tp, sp, {"cfg": cfg, "sp": s, "tp": 0})
