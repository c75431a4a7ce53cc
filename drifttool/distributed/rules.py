"""The parallel rule table: what TP and SP do to each RFC operator, declared once.

    >>> RULES["mlp_down_gemm"]
    OpRule(tp=<row-parallel mlp_down_gemm>, sp=None, heads=None, rows=1, ...)

One ``OpRule`` per RFC operator (the rows of ``drifttool.ops.specs.OPERATORS``; tested), read by dispatch
(``ParallelPlan.call`` wraps a call in its ``tp`` / ``sp`` compute rule) and by capture
(``placement``: the output axes ``heads`` and ``rows`` say where a rank's block of the output
sits), so the two cannot disagree. An operator without a compute rule runs unchanged on what the
rank holds (its heads, its image rows, or the replicated hidden state).

The CUDA rule is declared here too: the strict CUDA family reduces each axis in one sequential
order, so on CUDA TP's row-parallel GEMMs gather their input (``tp_row_for``) and a rule that
would split a reduction axis across ranks (``OpRule.splits``: Ring attention) is refused
(``reduction_splits``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from drifttool.distributed import sp, tp

Rule = Callable[..., Any]
"""``rule(plan, rt, stream, run, args, kwargs) -> out``: runs one call under the plan, calling
``run(*args, **kwargs)`` (the resolved implementation, or the next rule) on what this rank holds."""

Split = Callable[[Any, str], "str | None"]
"""``split(dims, tp_row) -> why | None``: why the operator's rules under the layout ``dims``
(``ParallelDims``; TP row mode ``tp_row`` resolved) split a reduction axis across ranks."""


@dataclass(frozen=True, kw_only=True)
class OpRule:
    """What the parallel layouts do to one RFC operator.

    Attributes:
        tp: TP's compute rule (``Rule``); None: the call runs unchanged on the rank's heads or
            channels, or replicated.
        sp: SP's compute rule; None: the call runs unchanged on the rank's image rows (row-wise
            operators) or replicated (text stream).
        heads: the output axis of the attention heads / MLP channels inside the blocks: TP shards
            it (and, for a joint output, Ulysses' internals); None: TP replicates the output.
        rows: the output axis of the image rows in the ``img`` stream, or of the [text, image]
            query rows in the ``joint`` stream: SP shards it; None: SP replicates the output.
        sp_gathers_final: SP's compute rule returns the gathered output at the final layer
            (``proj_out``): replicated there.
        splits: the CUDA rule (``Split``), or None: the rules split no reduction axis.
    """

    tp: Rule | None = None
    sp: Rule | None = None
    heads: int | None = None
    rows: int | None = None
    sp_gathers_final: bool = False
    splits: Split | None = None


def _ring_splits(dims: Any, tp_row: str) -> str | None:
    if dims.sp > 1 and dims.sp_attention == "ring":
        return "--sp-attention ring (each rank reduces its own keys)"
    return None


def _row_splits(dims: Any, tp_row: str) -> str | None:
    if dims.tp > 1 and tp_row == "partials":
        return "TP row-parallel partials (each rank reduces its K shard)"
    return None


_ROW = 1  # the image / query rows of a [B, S, ...] output

RULES: dict[str, OpRule] = {
    "latent_pack_unpack": OpRule(),  # the pipeline's, outside the forward
    "latent_normalize": OpRule(),
    "latent_proj_gemm": OpRule(sp=sp.latent_proj, rows=_ROW, sp_gathers_final=True),  # img_in, proj_out
    "txt_in_rmsnorm_linear": OpRule(),
    "timestep_embed_mlp": OpRule(),
    "adaln_mod_projection": OpRule(),  # per sample [B, 6d]
    "adaln_modulation": OpRule(rows=_ROW),
    "adaln_gate_residual": OpRule(rows=_ROW),
    "qkv_bias_gemm": OpRule(tp=tp.qkv, heads=2, rows=_ROW),  # column-parallel
    "qk_rmsnorm": OpRule(heads=2, rows=_ROW),
    "multi_axis_rope": OpRule(sp=sp.rope, heads=2, rows=_ROW),
    "joint_attn_qk_gemm": OpRule(heads=1, rows=2),  # [B, H, S, S]
    "joint_attn_softmax": OpRule(heads=1, rows=2),
    "joint_attn_av_gemm": OpRule(heads=2, rows=_ROW),
    "joint_attention_fused": OpRule(sp=sp.attention, heads=2, rows=_ROW, splits=_ring_splits),
    "attn_out_bias_gemm": OpRule(tp=tp.row_rule("attn_out_bias_gemm"), rows=_ROW, splits=_row_splits),
    "mlp_up_gemm_gelu": OpRule(tp=tp.column, heads=2, rows=_ROW),  # column-parallel
    "mlp_down_gemm": OpRule(tp=tp.row_rule("mlp_down_gemm"), rows=_ROW, splits=_row_splits),
    "final_adaln_out": OpRule(rows=_ROW),
    "cfg_combine_renorm": OpRule(),  # the sampler runs replicated on the gathered v_t
    "flow_sigma_table": OpRule(),
    "flow_sde_step_logp": OpRule(),
    # the text encoder runs on one rank, unsharded: no rule shards it
    "te_tokenize": OpRule(),
    "te_embed_tokens": OpRule(),
    "te_rmsnorm": OpRule(),
    "te_qkv_bias_gemm": OpRule(),
    "te_mrope": OpRule(),
    "te_causal_attention": OpRule(),
    "te_attn_out_residual": OpRule(),
    "te_mlp_gate_up_silu": OpRule(),
    "te_mlp_down_residual": OpRule(),
    "te_prompt_extract": OpRule(),
    "te_vision_resize": OpRule(),
    "te_vision_patchify": OpRule(),
    "te_vision_patch_embed": OpRule(),
    "te_vision_rope_table": OpRule(),
    "te_vision_rmsnorm": OpRule(),
    "te_vision_qkv": OpRule(),
    "te_vision_rope": OpRule(),
    "te_vision_attention": OpRule(),
    "te_vision_attn_out_residual": OpRule(),
    "te_vision_mlp_gate_up_silu": OpRule(),
    "te_vision_mlp_down_residual": OpRule(),
    "te_vision_merger": OpRule(),
    "te_vision_rope_index": OpRule(),
    "te_vision_scatter": OpRule(),
    # the VAE is not parallelised: every rank runs it whole on what it holds
    "vae_causal_conv3d": OpRule(),
    "vae_rms_norm": OpRule(),
    "vae_resample": OpRule(),
    "vae_mid_attention": OpRule(),
    "vae_latent_normalize": OpRule(),
    "vae_image_resize": OpRule(),
}
"""One rule per RFC operator, in the RFC's order (``specs.OPERATORS``; tested)."""

REPLICATED = OpRule()
"""The rule of an operator that is not an RFC row (``lora_merge``, ...): runs unchanged."""

def rule(op: str) -> OpRule:
    """The rule of operator ``op`` (``REPLICATED`` for an operator that is not an RFC row)."""
    return RULES.get(op, REPLICATED)


def tp_row_for(dims: Any, on_cuda: bool) -> str:
    """How TP row-parallel GEMMs split their work (``ParallelDims.tp_row`` resolved): ``auto``
    is ``gather`` on CUDA (no reduction axis split across ranks) and ``partials`` on the CPU."""
    if dims.tp_row != "auto":
        return dims.tp_row
    return "gather" if on_cuda else "partials"


def reduction_splits(dims: Any, tp_row: str) -> list[str]:
    """Why the layout ``dims`` splits a reduction axis across ranks, one reason per rule that
    would (in the RFC's order, each once); empty when none does."""
    found = (r.splits(dims, tp_row) for r in RULES.values() if r.splits is not None)
    return list(dict.fromkeys(why for why in found if why))
