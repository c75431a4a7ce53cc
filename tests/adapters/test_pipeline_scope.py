"""The identity scope of a transformer call inside a diffusers pipeline (``pipeline_scope``)."""

from __future__ import annotations

import pytest
import torch

from drifttool.adapters.pipeline_scope import TextRows, branch_of, img_grid_of, timestep_policy_of
from drifttool.errors import UnsupportedConfigError


def test_branch_comes_from_the_cache_context_else_the_call_order():
    assert branch_of("cond", seen=[], step=0) == "cond"
    assert branch_of("uncond", seen=[], step=0) == "uncond"  # the context wins over the order
    assert branch_of(None, seen=[], step=0) == "cond"
    assert branch_of(None, seen=["cond"], step=0) == "uncond"


@pytest.mark.parametrize("context,seen,match", [
    ("cond_img", [], "cache_context"), (None, ["cond", "uncond"], "more than 2"),
    ("cond", ["cond"], "twice"), (None, ["uncond"], "twice")])
def test_branch_refuses_what_it_cannot_name(context, seen, match):
    with pytest.raises(UnsupportedConfigError, match=match):
        branch_of(context, seen=seen, step=2)


def test_img_grid_of_pipeline_shapes():
    assert img_grid_of([[(1, 4, 6)]] * 3) == (4, 6)
    assert img_grid_of([(1, 5, 3)]) == (5, 3)
    for bad in ([], None, [[(1, 4, 6), (1, 4, 6)]], [(1, 4, 6), (1, 6, 4)], [(2, 4, 6)]):
        with pytest.raises(UnsupportedConfigError):
            img_grid_of(bad)


def test_timestep_policy_follows_the_latent_dtype():
    assert timestep_policy_of(torch.bfloat16) == "pipeline_bf16"
    assert timestep_policy_of(torch.float32) == "t_div_1000_fp32"
    with pytest.raises(UnsupportedConfigError, match="float16"):
        timestep_policy_of(torch.float16)


def test_text_rows_read_each_mask_once():
    txt = torch.zeros(3, 7, 2)
    mask = torch.arange(7)[None] < torch.tensor([7, 4, 1])[:, None]
    rows = TextRows()
    assert rows(txt, None) == {"txt_lens": [7, 7, 7], "txt_starts": None}
    first = rows(txt, mask)
    assert first == {"txt_lens": [7, 4, 1], "txt_starts": None}
    mask[1, :] = False  # the cache holds the first read: the pipeline never edits its mask
    assert rows(txt, mask) is first
    left = torch.arange(7)[None] >= torch.tensor([0, 3, 6])[:, None]  # left padding
    assert rows(txt, left.long()) == {"txt_lens": [7, 4, 1], "txt_starts": [0, 3, 6]}
    with pytest.raises(UnsupportedConfigError, match="gaps"):
        rows(txt, torch.tensor([[1, 0, 1, 0, 0, 0, 0]] * 3))
