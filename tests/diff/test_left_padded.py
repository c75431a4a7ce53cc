"""Prompts padded on the left (masked): capture keeps the valid text rows (from the mask), so the
diff compares real tokens, never padding.

Runs A and B hold the same 3-token prompt, left-padded to 5 and to 6 rows. Every operator that
acts on each token alone gives the same bytes; the first that differs is the text RoPE of
block 0, whose angle is the token's row in the padded sequence (rope_tables: positions 0..L-1,
the mask ignored, as diffusers 0.42.1): every real token moved by one row."""

from __future__ import annotations

import pytest
import torch

from drifttool.artifact import open_run
from drifttool.artifact.writer import ArtifactWriter
from drifttool.capture.recorder import Recorder
from drifttool.diff import Verdict, diff_runs
from drifttool.diff.location import RowRef
from drifttool.errors import UnsupportedConfigError
from drifttool.model.config import tiny
from drifttool.model.mmdit import MMDiT, random_init_
from drifttool.runtime import Runtime
from drifttool.sampling.config import SamplerConfig
from drifttool.sampling.inputs import RolloutInputs, replay_tensors
from drifttool.sampling.rollout import rollout

GRID = (2, 2)


def _inputs(pad: int, mask: list[bool] | None = None) -> RolloutInputs:
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(1, 4, 64, generator=g)  # [B, h*w, Cp]
    tokens = torch.randn(1, 3, 32, generator=g)  # [B, 3, D] the real prompt
    txt = torch.cat([torch.zeros(1, pad, 32), tokens], 1)  # [B, pad + 3, D], padded on the left
    m = torch.tensor([[False] * pad + [True] * 3] if mask is None else [mask])
    return RolloutInputs(sample_ids=[0], x0=x0, txt=txt, txt_mask=m, img_grid=GRID,
                         noise=torch.randn(2, 1, 4, 64, generator=g))


def _run(path, inputs, **cfg):
    model = random_init_(MMDiT(tiny()), seed=0)
    writer = ArtifactWriter(path, manifest={"fingerprint": {"arch": {"num_layers": 2}}})
    rec = Recorder("L2", writer)
    rt = Runtime(recorder=rec)
    writer.write_inputs(replay_tensors(inputs))
    rollout(model, inputs, SamplerConfig(num_steps=2, **cfg), rt, max_steps=1)
    writer.write_trace(rt.trace.rows())
    rec.close(complete=True)
    return path


def test_left_padded_prompts_first_drift_is_text_rope(tmp_path):
    r = diff_runs(open_run(_run(tmp_path / "a", _inputs(2))),
                  open_run(_run(tmp_path / "b", _inputs(3))))
    assert r.verdict is Verdict.DRIFT
    fd = r.first_drift
    assert (fd.kind, fd.step, fd.block, fd.stream, fd.op, fd.sample, fd.origin_kind) == (
        "op", 0, 0, "txt", "multi_axis_rope", 0, "record")
    assert fd.shape == ([3, 2, 16], [3, 2, 16])  # the 3 real tokens [L, heads, head_dim]
    assert fd.rows.n_rows == 3 and fd.rows.first == [RowRef(row=k, kind="txt", pos=k)
                                                       for k in range(3)]


def test_left_padded_batched_cfg_equals_sequential(tmp_path):
    # batched CFG right-pads [cond; uncond] to one width: the cond rows keep their left offset
    def inputs():
        i = _inputs(2)
        i.neg_txt, i.neg_mask = torch.ones(1, 2, 32), None
        return i

    r = diff_runs(open_run(_run(tmp_path / "a", inputs(), cfg_layout="batched")),
                  open_run(_run(tmp_path / "b", inputs(), cfg_layout="sequential")))
    assert r.verdict is Verdict.IDENTICAL, r.reason
    assert r.counts["ops"].matched == r.counts["ops"].a > 0


def test_mask_with_gaps_is_refused(tmp_path):
    with pytest.raises(UnsupportedConfigError, match="batch row 0 has gaps"):
        _run(tmp_path / "a", _inputs(2, mask=[False, True, False, True, True]))


def test_inputs_of_common_samples_compare_valid_prompt_rows(tmp_path):
    # run A holds samples [0, 1] padded on the left to 5 rows, run B sample 1 alone padded to 4:
    # sample 1's prompt is the same 3 tokens, only its padding differs
    a = _inputs(2)
    a = RolloutInputs(sample_ids=[0, 1], x0=torch.cat([a.x0, a.x0 + 1]),
                      txt=torch.cat([a.txt, a.txt]), txt_mask=torch.cat([a.txt_mask] * 2),
                      img_grid=GRID, noise=torch.cat([a.noise] * 2, 1))
    b = _inputs(1)
    b.sample_ids, b.x0 = [1], a.x0[1:]
    r = diff_runs(open_run(_run(tmp_path / "a", a)), open_run(_run(tmp_path / "b", b)))
    inputs = [c for c in r.context if c.startswith("inputs.")]
    assert r.input_differences == []  # the same 3 tokens: no replay input differs
    assert inputs == ["inputs.txt: prompt rows moved for common samples [1] "
                      "(sample 1: rows [2, 5) of 5 vs [1, 4) of 4)"]  # the layout is context


@pytest.mark.parametrize("neg_pad", [0, 4])
def test_left_padded_prompts_of_other_lengths_batched_equals_sequential(tmp_path, neg_pad):
    """Batched CFG right-pads [cond; uncond] to one width: a left-padded cond (5 rows) and a
    left-padded uncond (4 + neg_pad rows) keep their valid rows where the model sees them, so
    every record (text rows included, L2) equals the sequential run's; no padding row is ever
    digested."""
    def inputs():
        i = _inputs(2)
        valid = torch.full((1, 2, 32), 0.5)
        i.neg_txt = torch.cat([torch.zeros(1, neg_pad, 32), valid], 1)
        i.neg_mask = torch.tensor([[False] * neg_pad + [True] * 2])
        return i

    a = open_run(_run(tmp_path / "a", inputs(), cfg_layout="batched"))
    b = open_run(_run(tmp_path / "b", inputs(), cfg_layout="sequential"))
    r = diff_runs(a, b)
    assert r.verdict is Verdict.IDENTICAL, r.reason
    assert r.counts["ops"].matched == r.counts["ops"].a > 0
    txt_in = [row for row in a.ops_table().to_pylist() if row["op"] == "txt_in_rmsnorm_linear"]
    assert {(row["branch"], len(row["row_digests"])) for row in txt_in} == {("cond", 3),
                                                                           ("uncond", 2)}
