"""The scope's prompt rows of a batched-CFG forward (``[cond; uncond]`` right-padded to one length)
are derived from the two branches' own rows, not re-read from the padded mask each step: this
checks that the derivation equals reading the padded mask, for right- and left-padded prompts,
all-valid and all-masked rows, and prompts of different lengths."""

from __future__ import annotations

import torch

from drifttool.sampling.step import _pad_txt, _stacked_rows, txt_rows


def _mask(lens, starts, length):
    return torch.stack([(torch.arange(length) >= s) & (torch.arange(length) < s + n)
                        for n, s in zip(lens, starts)])


def test_stacked_rows_equal_the_padded_masks_rows():
    g = torch.Generator().manual_seed(7)
    for trial in range(40):
        B = int(torch.randint(1, 4, (1,), generator=g))
        Lc, Lu = (int(v) for v in torch.randint(1, 13, (2,), generator=g))
        masks = []
        for L in (Lc, Lu):
            if trial % 5 == 0:
                masks.append(None)  # every token valid
                continue
            lens = torch.randint(0, L + 1, (B,), generator=g).tolist()
            starts = [int(torch.randint(0, L - n + 1, (1,), generator=g)) for n in lens]
            masks.append(_mask(lens, starts, L))
        tc, tu = torch.zeros(B, Lc, 2), torch.zeros(B, Lu, 2)
        L = max(Lc, Lu)
        pc, mc = _pad_txt(tc, masks[0], L)
        pu, mu = _pad_txt(tu, masks[1], L)
        want = txt_rows(torch.cat([pc, pu]), torch.cat([mc, mu]))
        got = _stacked_rows(txt_rows(tc, masks[0]), txt_rows(tu, masks[1]))
        assert got == want, (trial, masks)
