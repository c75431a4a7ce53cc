"""Which rank computed a row of a record in a TP/SP/CFG-parallel run (torch-free).

    >>> sp_row_spans(350, 2)                 # 6 blocks of 64 image rows: 3 and 3
    [(0, 192), (192, 350)]
    >>> row_owner({"kind": "parallel", "tp": 1, "sp": 2, "cfg_parallel": 1, "sp_attention": "agrs"},
    ...           dict(stream="img", block=0, op="multi_axis_rope", rank=0, txt_len=0,
    ...                img_h=10, img_w=35), row=192)
    1

A parallel run's record is *written* by one rank (TP and SP coordinate 0: ``rank`` column) from
the digest partials of every rank that holds a block of it; under SP its rows were *computed* by
different ranks (``drifttool.distributed.sp``). ``row_owner`` names the rank that computed a canonical row:

* image-stream records of the model (blocks −1..depth; the sampler's records at
  ``SAMPLER_BLOCK`` run replicated on the full latent): image row ``n`` lies in
  ``sp_row_spans(img_h·img_w, sp)[s]`` → SP coordinate ``s``;
* joint-stream records (rows = the ``txt_len`` text rows, then the image rows: the query axis,
  also for the ``B.SK`` score records ``joint_attn_qk_gemm``/``joint_attn_softmax``, whose row
  digests run over query positions): text rows are replicated and attributed to SP coordinate
  0, image row ``n = r − txt_len`` as above. Under ``--sp-attention ulysses`` the attention
  trades rows for heads (each SP rank computes every row of its heads), so no single rank
  computed a joint row: ``None`` (the rank whose heads differ is named from the records' per-rank
  digest partials, ``rank_digests``, against a run of the same layout: ``diff.compare``);
* anything else (text stream: replicated; per-sample records without rows; a layout without
  SP): ``None``.

The global rank is ``mesh_rank`` at ``{"cfg": c, "sp": s, "tp": 0}``, ``c`` the writer's CFG
coordinate (``writer // (sp·tp)``): the CFG rank that ran the branch. TP ranks share a row
(each its heads or channels); TP coordinate 0 is named.

The row split and the mesh order come from ``drifttool.shards`` (torch-free, shared with the SP
rules).
"""

from __future__ import annotations

from typing import Any, Mapping

from drifttool.shards import mesh_rank, sp_row_spans

ULYSSES_HEAD_OPS = ("joint_attention_fused", "joint_attn_qk_gemm", "joint_attn_softmax",
                    "joint_attn_av_gemm")
"""Joint records that ``--sp-attention ulysses`` computes by heads (each SP rank every row of its
heads; ``distributed.sp.capture_source`` and ``_JOINT_HEADS``)."""


def heads_note(layout: Mapping[str, Any] | None, record: Mapping[str, Any], side: str) -> str | None:
    """A note for a first drift at a Ulysses attention record of run ``side`` whose differing
    rank could not be named (no run of the same layout to compare each rank's part with)."""
    sp_lay = sp_layout(layout)
    if sp_lay is None or sp_lay[2] != "ulysses" or record.get("stream") != "joint" \
            or record.get("op") not in ULYSSES_HEAD_OPS:
        return None
    return (f"run {side}: under --sp-attention ulysses every SP rank computed its heads of "
            f"{record['op']}; rank {record['rank']} only wrote it — diff against a run of the same "
            "layout to name the rank whose heads differ")


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
