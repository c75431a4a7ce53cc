"""Sampler operators: the FP32 sigma table, CFG combine + renorm, and the Flow-GRPO SDE step.

    >>> sig = call(rt, "flow_sigma_table", 10, 1024)          # 512², numerics §3.3
    >>> sig
    tensor([1.0000, 0.9290, 0.8515, 0.7666, 0.6733, 0.5701, 0.4555, 0.3274, 0.1833, 0.0200, 0.0000])
    >>> v = call(rt, "cfg_combine_renorm", v_cond, v_uncond, 4.0, stream="img", layout="BS.")
    >>> x1, logp, mu, std_t = call(rt, "flow_sde_step_logp", v, x, sig[0], sig[1],
    ...                            eta=1.2, sigma_max=sig[1], noise=eps)

Three RFC-386 rows (declared with the others in ``drifttool.ops.specs``, contract id
``qwenimage.<name>.v1``), each implemented for the ``strict`` and ``production`` backends, one
module each: ``sigmas`` (the sigma table and the timestep input), ``cfg`` (CFG combine + renorm),
``sde`` (the SDE step: its rules, shared checks and the strict kernel) and ``sde_production``:

====================  ===========================================  ==================================
operator              strict                                       production
====================  ===========================================  ==================================
flow_sigma_table      numpy fp32, diffusers' written order         same function (the arithmetic is
                      (exact IEEE ops, bit-equal to diffusers)     exact; no reduction)
cfg_combine_renorm    fp32 math; per-token norms by the pairwise     diffusers' expression in the input
                      tree over channels; fp32 output              dtype (``torch.norm``)
flow_sde_step_logp    fp32, Flow-GRPO's written order; ln s_t in   Flow-GRPO's expression verbatim in
                      binary64 rounded once; pairwise-tree mean   fp32; ``torch.mean``
====================  ===========================================  ==================================

``flow_sde_step_logp`` takes a ``rule`` keyword (``STEP_RULES``): ``"sde"`` (default, both
families) is the table's row; the production presets of ``drifttool.sampling.presets`` ask for
``"flow_grpo"`` (Flow-GRPO's step at every step, η = 0 outside its window, same kernel) and
``"diffusers_euler"`` (diffusers' ``scheduler.step``, kernel
``torch.native.diffusers_scheduler_step``). Strict declares ``"sde"`` only and refuses the others
by a declared constraint (tested in ``tests/sampling/test_presets.py``).

Strict vs production, byte for byte (tested in ``tests/ops/test_scheduler.py``):

* ``flow_sigma_table``: identical.
* ``cfg_combine_renorm``: with fp32 inputs the combined velocity is identical and the per-token
  norms may differ in the last bits (``torch.norm``'s reduction order is its own). With bf16 inputs
  production rounds every op to bf16 (diffusers) and returns bf16, strict upcasts and returns fp32.
* ``flow_sde_step_logp``: ``x_next``, ``mu`` and ``std_t`` equal up to an ULP of ``std_t`` (strict
  takes square roots in FP64 rounded once; FP32 ``torch.sqrt`` is not always correctly rounded);
  ``logp`` may differ in the last bits (``torch.log`` vs binary64 log for ``ln s_t``,
  ``torch.mean`` vs the pairwise tree).

Strict reductions use the canonical pairwise tree ``strict_math.tree_sum`` (adjacent pairs,
zero-padded to a power of two: the same tree as every other strict operator), and square roots
use ``strict_math.sqrt32`` (FP64, rounded once). ``torch.sum``/``torch.norm``/``torch.mean`` are
never used in strict: their order may depend on the tensor size and the thread count.

Backward (strict): ``cfg_combine_renorm`` and ``flow_sde_step_logp`` are ``torch.autograd.Function``s
whose forward is the arithmetic above and whose backward has a fixed per-token / per-element order
(``cfg._CFGRenorm``, ``sde._SDEStep``; docs/strict-arithmetic.md, "Backward").
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from drifttool.ops.scheduler.cfg import cfg_combine_renorm_production, cfg_combine_renorm_strict
from drifttool.ops.scheduler.sde import MAX_LOGP_ELEMENTS, STEP_RULES, flow_sde_step_logp_strict, sde_constants
from drifttool.ops.scheduler.sde_production import flow_euler_step_diffusers, flow_sde_step_logp_production
from drifttool.ops.scheduler.sigmas import TIMESTEP_POLICIES, flow_shift_mu, flow_sigma_table, timestep_input

__all__ = [
    "MAX_LOGP_ELEMENTS", "STEP_RULES", "TIMESTEP_POLICIES", "cfg_combine_renorm_production",
    "cfg_combine_renorm_strict", "flow_euler_step_diffusers", "flow_sde_step_logp_production",
    "flow_sde_step_logp_strict", "flow_shift_mu", "flow_sigma_table", "sde_constants", "timestep_input",
]
