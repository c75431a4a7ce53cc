"""The peer under test and what it runs on: the diffusers transformer behind drifttool's model call
with one ``PeerCall`` applied (``PeerModel``), a planted weight ULP (``planted_ulp``), loading the
transformer (``load_peer``), and a fixture on another image grid (``grid_fixture``, ``pixel_grid``).

    >>> tr = load_peer(None, device="cpu")                 # the tiny fixture's transformer
    >>> with planted_ulp(tr, ("transformer_blocks.0.attn.norm_q.weight", 0)):  # one ULP up
    ...     v = PeerModel(tr, PeerCall(grad=True), torch.device("cpu"))  # a model call, one factor
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Iterator

import torch

from drifttool.adapters.diffusers_qwenimage import DiffusersQwenImage, load_transformer
from drifttool.errors import DriftToolError
from drifttool.fixture import DEFAULT_FIXTURE, load_fixture
from drifttool.probes.peer_catalog import PeerCall
from drifttool.setting_checks import check_device as settings_check_device
from drifttool.setting_checks import check_pixels
from drifttool.settings import RunSpec, resolve

GARBAGE_SEED = 10_386


class PeerModel(DiffusersQwenImage):
    """The diffusers transformer behind drifttool's model call, run on ``device`` with one
    ``PeerCall``: inputs move to ``device`` (the runner already placed them there), the factor
    is applied, the instrumented forward runs there, and the velocity ``[B, N, C]`` (model
    dtype) goes back to the device of the sampler's latents ``x``, where the sampler's
    operators (drifttool's ``production`` ones, identical in both runs) take it with them."""

    def __init__(self, transformer: torch.nn.Module, call: PeerCall, device: torch.device) -> None:
        super().__init__(transformer)
        object.__setattr__(self, "call", call)
        object.__setattr__(self, "device", torch.device(device))

    def forward(self, x, txt, txt_mask, tau, img_grid, rt):
        dev, c = self.device, self.call
        home = x.device  # the sampler's device: the velocity goes back there
        x, txt, tau = x.to(dev), txt.to(dev), tau.to(dev, c.timestep_dtype)
        mask = None if txt_mask is None else txt_mask.to(dev)
        if c.pad_garbage and mask is not None:
            g = torch.Generator().manual_seed(GARBAGE_SEED)
            junk = (torch.randn(txt.shape, generator=g) * 100).to(dev, txt.dtype)
            txt = torch.where(mask[..., None].bool(), txt, junk)
        with c.around():
            v = super().forward(x, txt, mask, tau, img_grid, rt)
        return v.detach().to(home)


@contextlib.contextmanager
def planted_ulp(transformer: torch.nn.Module, plant: tuple[str, int] | None) -> Iterator[None]:
    """Raise one weight element by one ULP of its dtype (``torch.nextafter`` towards +inf) for
    the block; the original bytes are restored on exit.

    Raises:
        DriftToolError: no such parameter, or the index is outside it.
    """
    if plant is None:
        yield
        return
    name, index = plant
    params = dict(transformer.named_parameters())
    if name not in params or not 0 <= index < params[name].numel():
        raise DriftToolError(f"cannot plant a ULP at {name}[{index}]: no such weight element")
    flat = params[name].data.view(-1)
    old = flat[index].clone()
    flat[index] = torch.nextafter(old, torch.tensor(float("inf"), dtype=old.dtype, device=old.device))
    try:
        yield
    finally:
        flat[index] = old


def grid_fixture(out: str | Path, img_grid: tuple[int, int],
                 base: str | Path | None = None) -> Path:
    """Write a fixture directory at ``out`` holding ``base``'s settings (default: the tiny
    fixture) and prompt embeddings with the patch grid ``img_grid`` = (h, w) (pixels / 16); it
    has no ``transformer/`` (the peer's transformer is passed in memory) and no seal. Returns
    ``out``.

    Raises:
        DriftToolError: a grid that is not two positive integers.
        FixtureError: ``base`` cannot be read.
    """
    h, w = (int(v) for v in img_grid)
    if h < 1 or w < 1:
        raise DriftToolError(f"image grid {img_grid} must be positive (pixels / 16)")
    fx = load_fixture(base or DEFAULT_FIXTURE)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {**fx.meta, "name": f"{fx.name}-{h}x{w}",
            "description": f"{fx.name}'s settings and prompts on a {h}x{w} patch grid",
            "settings": {**fx.settings, "img_grid": [h, w]}}
    (out / "fixture.json").write_text(json.dumps(meta, indent=2))
    shutil.copyfile(fx.path / "prompts.safetensors", out / "prompts.safetensors")
    return out


def load_peer(checkpoint: str | Path | None, *, device: str | torch.device = "cpu",
              dtype: torch.dtype = torch.bfloat16, fixture: str | Path | None = None) -> torch.nn.Module:
    """diffusers' ``QwenImageTransformer2DModel.from_pretrained`` of ``checkpoint`` (a transformer
    or pipeline folder; default: the fixture's ``transformer/``), in ``dtype``, on ``device``.

    Raises:
        DriftToolError: diffusers missing, an unloadable folder, or an unavailable device
            (``check_device``).
    """
    device = check_device(str(device))
    folder = checkpoint
    if folder is None:
        fx, _ = resolve(RunSpec(fixture=fixture))
        folder = fx.model_dir
    return load_transformer(folder, dtype).to(device)


def check_device(device: str | None) -> torch.device:
    """``device`` (default ``cpu``) as a ``torch.device``: ``setting_checks.check_device``'s rules
    (cpu, cuda or cuda:N, available here).

    Raises:
        DriftToolError: as ``drifttool.setting_checks.check_device``.
    """
    return torch.device(settings_check_device("cpu" if device is None else device))


def pixel_grid(height: int | None, width: int | None) -> tuple[int, int] | None:
    """The (h, w) patch grid of an image of ``height`` x ``width`` pixels (16 pixels a patch:
    8x VAE, 2x2 packing), or ``None`` when neither is given.

    Raises:
        DriftToolError: only one given, or not a multiple of 16 from 16 to
            ``setting_checks.MAX_PIXELS`` (``setting_checks.check_pixels``).
    """
    if height is None and width is None:
        return None
    if height is None or width is None:
        raise DriftToolError("give --height and --width together")
    return check_pixels("height", height) // 16, check_pixels("width", width) // 16
