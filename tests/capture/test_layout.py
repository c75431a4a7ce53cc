"""Canonical layout: per-sample selection, padding invariance, joint selection, row mapping."""

from __future__ import annotations

import pytest
import torch

from drifttool.capture.digest import digest
from drifttool.capture.layout import RowMap, canonicalize, row_id


def site(stream, **kw):
    return {"stream": stream, "samples": None, "txt_lens": None, "img_grid": None, **kw}


def padded_txt(valid: list[torch.Tensor], pad: int, fill: float) -> torch.Tensor:
    """[B, pad, C] with sample b's valid rows first and ``fill`` garbage after them."""
    out = torch.full((len(valid), pad, valid[0].shape[-1]), fill)
    for b, v in enumerate(valid):
        out[b, : len(v)] = v
    return out


def test_txt_padding_invariance():
    g = torch.Generator().manual_seed(0)
    valid = [torch.randn(3, 4, generator=g), torch.randn(7, 4, generator=g)]
    a = padded_txt(valid, 7, 0.0)
    b = padded_txt(valid, 12, float("nan"))
    pa_ = canonicalize(site("txt", txt_lens=[3, 7]), a, "BS.")
    pb = canonicalize(site("txt", txt_lens=[3, 7]), b, "BS.")
    assert [digest(p.tensor) for p in pa_] == [digest(p.tensor) for p in pb]
    assert [tuple(p.tensor.shape) for p in pa_] == [(3, 4), (7, 4)]
    assert pa_[0].rows == RowMap(3, None)


def test_left_padded_txt_keeps_the_valid_rows():
    # prompts padded on the left (masked): the valid rows are the last ones, not [0, txt_len)
    g = torch.Generator().manual_seed(2)
    valid = [torch.randn(3, 4, generator=g), torch.randn(5, 4, generator=g)]
    right = padded_txt(valid, 5, 0.0)
    left = torch.stack([torch.cat([torch.full((5 - len(v), 4), 7.0), v]) for v in valid])
    s = site("txt", txt_lens=[3, 5])
    want = [digest(p.tensor) for p in canonicalize(s, right, "BS.")]
    got = canonicalize({**s, "txt_starts": [2, 0]}, left, "BS.")
    assert [digest(p.tensor) for p in got] == want
    assert torch.equal(got[0].tensor, valid[0]) and got[0].rows == RowMap(3, None)
    # joint stream [B, L + h*w, C]: text rows [2, 5) then the image rows
    img = torch.randn(2, 6, 4, generator=g)
    joint = canonicalize({**s, "stream": "joint", "img_grid": (2, 3), "txt_starts": [2, 0]},
                         torch.cat([left, img], 1), "BS.")
    assert torch.equal(joint[0].tensor, torch.cat([valid[0], img[0]]))
    assert joint[0].rows.row_id(2) == ("txt", 2) and joint[0].rows.row_id(3) == ("img", 0, 0)


def test_joint_selection_and_padding_invariance():
    g = torch.Generator().manual_seed(1)
    h, w = 2, 3
    txt = [torch.randn(2, 5, generator=g), torch.randn(4, 5, generator=g)]
    img = torch.randn(2, h * w, 5, generator=g)

    def joint(pad, fill):
        return torch.cat([padded_txt(txt, pad, fill), img], dim=1)  # [B, pad + h*w, C]

    s = site("joint", txt_lens=[2, 4], img_grid=(h, w), samples=[10, 11])
    p4, p9 = canonicalize(s, joint(4, 1.0), "BS."), canonicalize(s, joint(9, -3.0), "BS.")
    assert [p.sample for p in p4] == [10, 11]
    for a, b, t, i in zip(p4, p9, txt, img):
        assert torch.equal(a.tensor, torch.cat([t, i])) and digest(a.tensor) == digest(b.tensor)
    assert p4[1].rows.row_id(3) == ("txt", 3)
    assert p4[1].rows.row_id(4) == ("img", 0, 0) and p4[1].rows.row_id(9) == ("img", 1, 2)


def test_key_axis_uses_joint_selection_on_any_stream():
    # attention probabilities [B, H, S_img, K]: rows are image queries, K spans the joint sequence
    probs = torch.arange(2 * 1 * 6 * 10, dtype=torch.float32).reshape(2, 1, 6, 10)
    parts = canonicalize(site("img", txt_lens=[1, 4], img_grid=(2, 3)), probs, "B.SK")
    assert parts[0].tensor.shape == (1, 6, 7) and parts[1].tensor.shape == (1, 6, 10)
    assert torch.equal(parts[0].tensor[..., :1], probs[0, ..., :1])
    assert torch.equal(parts[0].tensor[..., 1:], probs[0, ..., 4:])
    assert parts[0].row_axis == 1 and parts[0].rows == RowMap(0, (2, 3))


def test_img_rows_and_unbatched():
    x = torch.randn(6, 8)
    (p,) = canonicalize(site("img", img_grid=(2, 3)), x, "S.")
    assert p.sample == -1 and p.tensor.data_ptr() == x.data_ptr()  # no copy needed
    assert p.rows.row_id(5) == ("img", 1, 2)
    (q,) = canonicalize(site("none"), torch.randn(3), ".")
    assert q.row_axis is None and q.rows is None


def test_row_id_rule():
    assert row_id(2, 3, 4) == ("txt", 2)
    assert row_id(3, 3, 4) == ("img", 0, 0) and row_id(8, 3, 4) == ("img", 1, 1)
    assert row_id(5, 0, None) == ("row", 5)


@pytest.mark.parametrize("s,shape,layout,msg", [
    (site("img"), (2, 3), "BS.", "does not fit"),
    (site("img"), (2, 3), "BB", "does not fit"),
    (site("img", samples=[0]), (2, 3), "BS", "batch size 2"),
    (site("joint"), (1, 5, 2), "BS.", "needs site"),
    (site("joint", img_grid=(2, 2), txt_lens=[3]), (1, 6, 2), "BS.", "cannot hold"),
    (site("txt", txt_lens=[9]), (1, 6, 2), "BS.", r"text rows are \[0, 9\)"),
    (site("txt", txt_lens=[3], txt_starts=[4]), (1, 6, 2), "BS.", r"text rows are \[4, 7\)"),
    (site("txt", txt_lens=[3], txt_starts=[0, 1]), (1, 6, 2), "BS.", "txt_starts"),
    (site("img", img_grid=(2, 2)), (1, 6, 2), "BS.", "needs 4"),
])
def test_layout_errors(s, shape, layout, msg):
    with pytest.raises(ValueError, match=msg):
        canonicalize(s, torch.zeros(shape), layout)
