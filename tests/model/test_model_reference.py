"""drifttool's strict MMDiT (FP32) against the FP64 reference forward, ``references/mmdit.py``.

The embedded tiny model (``fixtures/tiny-t2i/transformer``: 2 blocks, d = 32, 2 heads of 16,
bf16 weights, upcast exactly) runs once through ``MMDiT`` (strict family, FP32, loaded by
``load_checkpoint``) and once through the reference (weights and config read here with
safetensors and json, never through drifttool), on the same inputs: batch 3, the fixture's
prompts 0..2 right-padded to L = 13 (valid 7, 13, 5) with garbage in the padded slots, σ at both
ends of the schedule and in between, and image grids 4x6, 5x3 and 3x7.

Criterion (references/tolerances.json, ``models`` → ``mmdit_tiny_t2i``, derived as every entry of
that profile): elementwise ``|c − r| ≤ atol + rtol·|r|`` with ``atol`` = 4x the largest excess
over one FP32 output rounding among |r| < 1 and ``rtol`` = 2⁻²⁴ + 4x the largest relative excess
among |r| ≥ 1, measured over 6 seeds of every case with and without the mask:

    python -m tests.model.test_model_reference

The measured error (≤ 7e-7) is the strict family's rounding accumulated over the forward's ~60
operator calls; through the production family the same inputs are up to ~5e-6 off (diffusers'
polar RoPE tables, framework GEMMs), outside this tolerance at some elements. A one-bf16-ULP
change of a single weight is caught (``test_planted_weight_change_is_caught``), so the
comparison can fail.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from drifttool.fixture import load_fixture
from drifttool.model.checkpoint import load_checkpoint
from drifttool.references import mmdit as ref_mmdit
from drifttool.runtime import Runtime
from tests.ops import test_reference_accuracy as accuracy

TOLERANCE = accuracy.TOLERANCES["models"]["mmdit_tiny_t2i"]["strict"]["float32"]
GRIDS = [(4, 6), (5, 3), (3, 7)]
TAU = [1.0, 0.5123, 0.019999980926513672]  # σ_0, a middle σ, the terminal σ of the schedule
BATCH = 3

FIXTURE = load_fixture("tiny-t2i")
WEIGHTS = load_file(str(FIXTURE.model_dir / "diffusion_pytorch_model.safetensors"))
CONFIG = json.loads((FIXTURE.model_dir / "config.json").read_text())
PLANTS = [  # (tensor, element): the text path into the last block's attention, the output, τ
    ("transformer_blocks.1.attn.norm_added_k.weight", (0,)),
    ("proj_out.bias", (0,)),
    ("time_text_embed.timestep_embedder.linear_1.weight", (0, 0)),
]


def _inputs(seed: int, grid: tuple[int, int], masked: bool = True):
    """(x [3, h·w, 64], txt [3, 13, 32], mask [3, 13] bool or None, tau [3]) fp32: the fixture's
    prompts 0..2, their padded slots filled with N(0, 10²) (a mask that leaks shows)."""
    g = torch.Generator().manual_seed(seed)
    h, w = grid
    x = torch.randn(BATCH, h * w, CONFIG["in_channels"], generator=g)
    prompts, lengths, _, _ = FIXTURE.prompts(CONFIG["joint_attention_dim"], seed=0)
    txt, lengths = prompts[:BATCH].clone(), lengths[:BATCH]
    mask = torch.arange(txt.shape[1])[None, :] < lengths[:, None]  # [3, 13], right padding
    txt[~mask] = 10 * torch.randn(int((~mask).sum()), txt.shape[-1], generator=g)
    return x, txt, (mask if masked else None), torch.tensor(TAU)


def _strict(model, inputs, grid) -> torch.Tensor:
    with torch.no_grad():
        return model(*inputs, grid, Runtime(mode="strict"))


@pytest.fixture(scope="module")
def model():
    return load_checkpoint(FIXTURE.model_dir, dtype=torch.float32)


@pytest.mark.parametrize("grid", GRIDS, ids=[f"{h}x{w}" for h, w in GRIDS])
def test_strict_fp32_matches_fp64_reference(model, grid):
    inputs = _inputs(0, grid)
    got = _strict(model, inputs, grid)
    want = ref_mmdit.forward(WEIGHTS, CONFIG, *inputs, grid)
    assert got.dtype == torch.float32 and want.dtype == torch.float64
    accuracy.assert_within(got, want, TOLERANCE["atol"], TOLERANCE["rtol"], f"MMDiT strict fp32 {grid}")


@pytest.mark.parametrize("name,index", PLANTS, ids=[p[0] for p in PLANTS])
def test_planted_weight_change_is_caught(name, index):
    """One element of one weight moved up by one bf16 ULP in the model (not in the reference's
    weights): the same judge must reject the output."""
    planted = load_checkpoint(FIXTURE.model_dir, dtype=torch.float32)
    p = dict(planted.named_parameters())[name]
    with torch.no_grad():
        p[index] = (p[index].to(torch.bfloat16).view(torch.int16) + 1).view(torch.bfloat16).float()
    grid = GRIDS[0]
    inputs = _inputs(0, grid)
    got = _strict(planted, inputs, grid)
    want = ref_mmdit.forward(WEIGHTS, CONFIG, *inputs, grid)
    with pytest.raises(pytest.fail.Exception, match="out of tolerance"):
        accuracy.assert_within(got, want, TOLERANCE["atol"], TOLERANCE["rtol"], f"planted {name}")


def test_reference_model_imports_only_the_operator_references():
    """references/mmdit.py stands on references/ops.py alone: statically (its import statements)
    and at run time (a fresh interpreter importing it loads no other drifttool module)."""
    source = Path(ref_mmdit.__file__)
    imported = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"relative import in {source}"
            imported |= {node.module} if node.module != "drifttool.references" else {
                f"drifttool.references.{a.name}" for a in node.names}
    assert imported <= {"__future__", "typing", "torch", "drifttool.references.ops"}, imported
    code = ("import sys; import drifttool.references.mmdit; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'drifttool'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert eval(out.stdout.strip()) == ["drifttool", "drifttool.references", "drifttool.references.mmdit",
                                        "drifttool.references.ops"]


def measure() -> dict[str, float]:
    """The error statistics (``accuracy.error_stats``) of the strict model against the reference,
    max over 6 seeds, every grid, with and without the mask."""
    model = load_checkpoint(FIXTURE.model_dir, dtype=torch.float32)
    stats: dict[str, float] = {}
    for seed in range(6):
        for grid in GRIDS:
            for masked in (True, False):
                inputs = _inputs(seed, grid, masked)
                got = _strict(model, inputs, grid)
                want = ref_mmdit.forward(WEIGHTS, CONFIG, *inputs, grid)
                for key, val in accuracy.error_stats(got, want).items():
                    stats[key] = max(stats.get(key, 0.0), val)
    return stats


if __name__ == "__main__":  # pragma: no cover
    s = measure()
    u = accuracy.UNIT_ROUNDOFF[torch.float32]
    print(json.dumps(s, indent=1))
    print(f"atol = 4 x excess_abs_small = {4 * s['excess_abs_small']:.3g}; "
          f"rtol = 2^-24 + 4 x excess_rel_large = {u + 4 * s['excess_rel_large']:.3g} (round up to 2 digits)")
