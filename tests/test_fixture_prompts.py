"""``fixture_prompts.read_prompts``: a fixture's prompt embeddings read without torch, bf16, fp16
and fp32 alike, with the values torch reads (``Fixture.prompts`` runs from them)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from drifttool.errors import FixtureError
from drifttool.fixture_prompts import read_prompts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_embeddings_read_without_torch_are_torchs_values(tmp_path, dtype):
    g = torch.Generator().manual_seed(3)
    txt = (torch.randn(3, 7, 5, generator=g) * 100).to(dtype)
    # -0, a subnormal, the largest finite value (negative)
    txt[0, 0, :3] = torch.tensor([-0.0, torch.finfo(dtype).smallest_normal / 4, -torch.finfo(dtype).max],
                                 dtype=torch.float64).to(dtype)
    neg = torch.randn(1, 2, 5, generator=g).to(dtype)
    f = tmp_path / "prompts.safetensors"
    save_file({"txt": txt, "txt_len": torch.tensor([7, 0, 3]), "neg_txt": neg, "neg_len": torch.tensor(2)}, str(f))
    got = read_prompts(f)
    for name, want in (("txt", txt), ("neg_txt", neg)):
        want = want.double().numpy()
        assert got[name].shape == want.shape
        assert np.array_equal(got[name].astype(np.float64).view(np.uint64), want.view(np.uint64)), name
    assert got["txt_len"].tolist() == [7, 0, 3] and int(got["neg_len"]) == 2


def test_a_bf16_tensor_shorter_than_its_shape_is_unreadable(tmp_path):
    f = tmp_path / "prompts.safetensors"
    save_file({"txt": torch.ones(1, 2, 4).bfloat16(), "txt_len": torch.tensor([2]),
               "neg_txt": torch.ones(1, 1, 4).bfloat16(), "neg_len": torch.tensor(1)}, str(f))
    f.write_bytes(f.read_bytes()[:-6])
    with pytest.raises(FixtureError, match="unreadable"):
        read_prompts(f)
