"""Replay inputs of a batch of logical samples: what they are, how they are built from a fixture,
and how they are stored (``inputs.safetensors``).

    >>> inputs, noise_rec = build_inputs(fx, seed=386, samples=[0, 1], img_grid=(4, 6),
    ...                                  num_steps=4, config=model.config)
    >>> sorted(replay_tensors(inputs))          # the tensors the artifact stores
    ['img_grid', 'neg_txt', 'noise', 'sample_ids', 'txt', 'txt_mask', 'x0']

An edit run adds ``cond`` (packed condition-image latents) and ``cond_grids`` (their patch grids,
int64 [K, 2]); the model receives them at every step and both CFG branches
(``drifttool.model.conditions``).
    >>> inputs_from_tensors(replay_tensors(inputs)).sample_ids
    [0, 1]

``build_inputs`` draws the pinned noise per logical sample (``sampling.noise``) and batches the
fixture's prompt embeddings, right-padded with a key mask — or takes prompts and initial latents
read from files (``sampling.input_files``); the runner and the GRPO loop both use it. Inputs are
built on the CPU (the portable noise is CPU arithmetic) and moved to the run's device with
``RolloutInputs.to``. ``replay_tensors`` and ``inputs_from_tensors`` are each other's inverse
(bool masks stored as uint8).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from drifttool.errors import DriftToolError
from drifttool.fixture import Fixture
from drifttool.model.config import MMDiTConfig
from drifttool.sampling.input_files import ExternalInputs
from drifttool.sampling.noise import draw_noise


@dataclass(kw_only=True)
class RolloutInputs:
    """Replay inputs of one batch of logical samples (all on one device).

    Attributes:
        sample_ids: logical sample id of each batch row (B entries).
        x0: [B, N, Cp] fp32 initial packed latents (N = h·w, Cp = 4·latent channels).
        txt: [B, L, D] prompt embeddings (right-padded).
        img_grid: (h, w) patch grid.
        txt_mask: [B, L] bool valid-token mask, or None (all valid).
        noise: SDE noise, [num_steps, B, N, Cp] fp32, or a list of B per-sample tensors
            [num_steps, N, Cp] (``sampling.noise``); may be None when no step is stochastic.
        neg_txt: [B, L', D] negative prompt embeddings (CFG), or None.
        neg_mask: [B, L'] bool, or None.
        cond: [B, Nc, Cp] fp32 packed condition-image latents (edit pipelines), or None.
        cond_grids: (h_k, w_k) patch grid of each condition image, Σ h_k·w_k = Nc; () without
            ``cond``.
    """

    sample_ids: list[int]
    x0: torch.Tensor
    txt: torch.Tensor
    img_grid: tuple[int, int]
    txt_mask: torch.Tensor | None = None
    noise: torch.Tensor | Sequence[torch.Tensor] | None = None
    neg_txt: torch.Tensor | None = None
    neg_mask: torch.Tensor | None = None
    cond: torch.Tensor | None = None
    cond_grids: tuple[tuple[int, int], ...] = ()

    @property
    def batch(self) -> int:
        return len(self.sample_ids)

    def validate(self) -> None:
        """Raise ValueError on inconsistent shapes/dtypes."""
        B = self.batch
        h, w = self.img_grid
        if self.x0.dim() != 3 or self.x0.shape[0] != B or self.x0.shape[1] != h * w:
            raise ValueError(f"x0 {tuple(self.x0.shape)} must be [B={B}, N={h * w}, Cp]")
        if self.x0.dtype != torch.float32:
            raise ValueError(f"x0 must be fp32, got {self.x0.dtype}")
        pairs = (("txt", self.txt, self.txt_mask), ("neg_txt", self.neg_txt, self.neg_mask))
        for name, t, m in pairs:
            if t is None:
                if m is not None:
                    raise ValueError(f"{name} mask given without {name}")
                continue
            if t.dim() != 3 or t.shape[0] != B:
                raise ValueError(f"{name} {tuple(t.shape)} must be [B={B}, L, D]")
            if m is not None and (m.shape != t.shape[:2] or m.dtype != torch.bool):
                raise ValueError(f"{name} mask must be bool [B, L], got {m.dtype} {tuple(m.shape)}")
        if (self.cond is None) != (not self.cond_grids):
            raise ValueError("cond and cond_grids go together (condition latents and their grids)")
        if self.cond is not None:
            nc = sum(int(a) * int(b) for a, b in self.cond_grids)
            if tuple(self.cond.shape) != (B, nc, self.x0.shape[2]) or self.cond.dtype != torch.float32:
                raise ValueError(f"cond must be fp32 [B={B}, Nc={nc}, {self.x0.shape[2]}] for "
                                 f"cond_grids {list(self.cond_grids)}, got {self.cond.dtype} "
                                 f"{tuple(self.cond.shape)}")

    def model_kwargs(self, repeat: int = 1) -> dict[str, Any]:
        """The condition keywords of the model call (``model(..., cond=, cond_grids=)``), the
        latents repeated ``repeat`` times along the batch (batched CFG); empty without ``cond``."""
        if self.cond is None:
            return {}
        cond = self.cond if repeat == 1 else torch.cat([self.cond] * repeat)
        return {"cond": cond, "cond_grids": tuple(self.cond_grids)}

    def select(self, sample_ids: Sequence[int]) -> "RolloutInputs":
        """The inputs of the logical samples ``sample_ids`` (in that order): the rows a rank runs
        in a sample-parallel rollout. Each sample keeps its own latents, noise and prompts, so a
        strict sample's bytes do not depend on which rank runs it.

        Raises:
            ValueError: an id that is not in this batch.
        """
        missing = [s for s in sample_ids if s not in self.sample_ids]
        if missing:
            raise ValueError(f"samples {missing} are not in the batch {self.sample_ids}")
        rows = [self.sample_ids.index(s) for s in sample_ids]
        idx = torch.tensor(rows, dtype=torch.long)

        def pick(t: torch.Tensor | None, dim: int = 0) -> torch.Tensor | None:
            return None if t is None else t.index_select(dim, idx)

        noise = self.noise
        if isinstance(noise, torch.Tensor):
            noise = pick(noise, 1)  # [num_steps, B, N, Cp]
        elif noise is not None:
            noise = [noise[r] for r in rows]
        return RolloutInputs(sample_ids=list(sample_ids), x0=pick(self.x0), txt=pick(self.txt),
                             img_grid=self.img_grid, txt_mask=pick(self.txt_mask), noise=noise,
                             neg_txt=pick(self.neg_txt), neg_mask=pick(self.neg_mask),
                             cond=pick(self.cond), cond_grids=self.cond_grids)

    def to(self, device: torch.device | str) -> "RolloutInputs":
        """The same inputs on ``device`` (values unchanged: a copy, or ``self``'s tensors when
        they are there already)."""

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        noise = self.noise
        if isinstance(noise, torch.Tensor):
            noise = noise.to(device)
        elif noise is not None:
            noise = [n.to(device) for n in noise]
        return RolloutInputs(sample_ids=list(self.sample_ids), x0=move(self.x0), txt=move(self.txt),
                             img_grid=self.img_grid, txt_mask=move(self.txt_mask), noise=noise,
                             neg_txt=move(self.neg_txt), neg_mask=move(self.neg_mask),
                             cond=move(self.cond), cond_grids=self.cond_grids)

    def noise_at(self, step: int) -> torch.Tensor:
        """[B, N, Cp] noise of step ``step``."""
        if self.noise is None:
            raise ValueError(f"step {step} is stochastic but RolloutInputs.noise is None")
        if isinstance(self.noise, torch.Tensor):
            out = self.noise[step]
        else:
            out = torch.stack([n[step] for n in self.noise])
        if out.shape != self.x0.shape:
            raise ValueError(
                f"noise of step {step} is {tuple(out.shape)}, expected {tuple(self.x0.shape)}"
            )
        return out



def replay_tensors(inputs: RolloutInputs) -> dict[str, torch.Tensor]:
    """The tensors stored in ``inputs.safetensors`` (masks as uint8, ids and grid as int64)."""
    t = {"sample_ids": torch.tensor(inputs.sample_ids, dtype=torch.int64), "x0": inputs.x0,
         "txt": inputs.txt, "img_grid": torch.tensor(inputs.img_grid, dtype=torch.int64)}
    if inputs.txt_mask is not None:
        t["txt_mask"] = inputs.txt_mask.to(torch.uint8)
    if inputs.noise is not None:
        t["noise"] = inputs.noise
    if inputs.neg_txt is not None:
        t["neg_txt"] = inputs.neg_txt
    if inputs.neg_mask is not None:
        t["neg_mask"] = inputs.neg_mask.to(torch.uint8)
    if inputs.cond is not None:
        t["cond"] = inputs.cond
        t["cond_grids"] = torch.tensor(inputs.cond_grids, dtype=torch.int64).reshape(-1, 2)
    return t


REQUIRED_TENSORS = ("sample_ids", "x0", "txt", "img_grid")
"""Tensors every stored set of replay inputs holds."""


def inputs_from_tensors(tensors: dict[str, torch.Tensor]) -> RolloutInputs:
    """The inverse of ``replay_tensors``.

    Raises:
        KeyError: a tensor of ``REQUIRED_TENSORS`` is missing (its name).
        ValueError: the tensors are inconsistent (``RolloutInputs.validate``).
    """
    need = [k for k in REQUIRED_TENSORS if k not in tensors]
    if need:
        raise KeyError(need)
    mask = tensors.get("txt_mask")
    neg_mask = tensors.get("neg_mask")
    inputs = RolloutInputs(
        sample_ids=[int(i) for i in tensors["sample_ids"].tolist()], x0=tensors["x0"],
        txt=tensors["txt"], img_grid=tuple(int(i) for i in tensors["img_grid"].tolist()),
        txt_mask=None if mask is None else mask.to(torch.bool), noise=tensors.get("noise"),
        neg_txt=tensors.get("neg_txt"), neg_mask=None if neg_mask is None else neg_mask.to(torch.bool),
        cond=tensors.get("cond"),
        cond_grids=tuple((int(a), int(b)) for a, b in tensors["cond_grids"].tolist())
        if "cond_grids" in tensors else (),
    )
    inputs.validate()
    return inputs


def build_inputs(
    fx: Fixture,
    *,
    seed: int,
    samples: Sequence[int],
    img_grid: tuple[int, int],
    num_steps: int,
    config: MMDiTConfig,
    prompt_rows: Sequence[int] | None = None,
    pad_prompts_to: int | None = None,
    sample_labels: Sequence[int] | None = None,
    external: ExternalInputs | None = None,
) -> tuple[RolloutInputs, dict[str, Any]]:
    """Replay inputs for the sample batch, and the noise record: pinned noise
    (``sampling.noise``) with ``config.latent_channels`` latent channels (x0 ``[B, N,
    in_channels]``) and prompt embeddings ``[B, L, joint_attention_dim]`` (the fixture's, or
    seeded random ones at the fixture's lengths for an external checkpoint), right-padded to the
    batch's longest prompt with a key mask (None if all valid, as the pipeline does, numerics
    §5.11).

    Args:
        prompt_rows: the fixture prompt of each batch row (default: sample id modulo the number
            of prompts).
        pad_prompts_to: right-pad every prompt and the negative prompt to this many tokens
            (masked; the negative prompt then gets a mask too).
        sample_labels: logical ids written for the rows instead of ``samples``.
        external: prompts (``txt``/``neg_txt`` with masks, one row per sample, kept at their
            length L) and initial latents ``x0`` read from files; each replaces the fixture's
            prompts or the drawn x0 when set (the SDE noise is drawn from ``seed`` regardless).
            File prompts without a negative file have no negative prompt (CFG off). Its
            condition latents (``cond``, ``cond_grids``) are the inputs' (one row, or one per
            sample).

    Raises:
        UnsupportedConfigError: the config cannot drive a rollout (``MMDiTConfig.latent_channels``).
        DriftToolError: ``pad_prompts_to`` shorter than the longest prompt.
    """
    ids = list(samples)
    grid = tuple(img_grid)
    noise = draw_noise(seed, ids, img_grid=grid, num_steps=num_steps, channels=config.latent_channels)
    if external is not None and external.txt is not None:
        tb, mask, nb, neg_mask = _file_prompts(external, pad_prompts_to)
    else:
        tb, mask, nb, neg_mask = _fixture_prompts(fx, config, seed, ids, prompt_rows, pad_prompts_to)
    x0 = external.x0 if external is not None and external.x0 is not None else noise.x0
    inputs = RolloutInputs(
        sample_ids=list(sample_labels) if sample_labels is not None else ids, x0=x0, txt=tb,
        img_grid=grid, txt_mask=None if mask is None or bool(mask.all()) else mask, noise=noise.noise,
        neg_txt=nb, neg_mask=None if neg_mask is None or bool(neg_mask.all()) else neg_mask,
    )
    if external is not None and external.cond is not None:
        cond = external.cond
        if cond.shape[0] == 1 and len(ids) > 1:  # one condition for every sample, as the
            cond = cond.expand(len(ids), -1, -1).contiguous()  # pipelines repeat the image
        inputs.cond, inputs.cond_grids = cond, tuple(external.cond_grids)
    return inputs, noise.record


def _fixture_prompts(fx: Fixture, config: MMDiTConfig, seed: int, ids: list[int],
                     prompt_rows: Sequence[int] | None, pad_prompts_to: int | None):
    """(txt [B, L, D], mask [B, L] bool, neg [B, Ln, D], neg mask or None) from the fixture."""
    txt, lens, neg, neg_len = fx.prompts(config.joint_attention_dim, seed=seed)
    rows = list(prompt_rows) if prompt_rows is not None else [i % txt.shape[0] for i in ids]
    width = max(int(lens[r]) for r in rows)
    if pad_prompts_to is not None:
        if int(pad_prompts_to) < max(width, int(neg_len)):
            raise DriftToolError(f"pad_prompts_to={pad_prompts_to} is shorter than the longest prompt "
                                 f"({max(width, int(neg_len))} tokens)")
        txt = torch.cat([txt, txt.new_zeros(txt.shape[0], max(0, int(pad_prompts_to) - txt.shape[1]),
                                            txt.shape[2])], dim=1)
        width = int(pad_prompts_to)
    tb = torch.stack([txt[r, :width] for r in rows])  # [B, L, D]
    mask = torch.stack([torch.arange(width) < lens[r] for r in rows])  # [B, L] bool
    nb = neg[:, : int(neg_len)].expand(len(ids), -1, -1).contiguous()  # [B, Ln, D]
    neg_mask = None
    if pad_prompts_to is not None:
        nb = torch.cat([nb, nb.new_zeros(len(ids), width - nb.shape[1], nb.shape[2])], dim=1)
        neg_mask = (torch.arange(width) < int(neg_len)).expand(len(ids), -1).contiguous()
    return tb, mask, nb, neg_mask


def _pad_to(txt: torch.Tensor, mask: torch.Tensor | None, width: int):
    """Right-pad [B, L, D] prompts with zeros to ``width`` tokens; the [B, width] bool mask."""
    B, L, D = txt.shape
    mask = torch.ones(B, L, dtype=torch.bool) if mask is None else mask
    return (torch.cat([txt, txt.new_zeros(B, width - L, D)], dim=1),
            torch.cat([mask, mask.new_zeros(B, width - L)], dim=1))


def _file_prompts(external: ExternalInputs, pad_prompts_to: int | None):
    """(txt, mask, neg, neg mask) from prompt-embedding files, right-padded to
    ``pad_prompts_to`` tokens when given."""
    tb, mask, nb, neg_mask = external.txt, external.txt_mask, external.neg_txt, external.neg_mask
    if pad_prompts_to is not None:
        longest = max(tb.shape[1], 0 if nb is None else nb.shape[1])
        if int(pad_prompts_to) < longest:
            raise DriftToolError(f"pad_prompts_to={pad_prompts_to} is shorter than the prompt "
                                 f"embeddings ({longest} tokens)")
        tb, mask = _pad_to(tb, mask, int(pad_prompts_to))
        if nb is not None:
            nb, neg_mask = _pad_to(nb, neg_mask, int(pad_prompts_to))
    return tb, mask, nb, neg_mask
