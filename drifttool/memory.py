"""A lower bound of a run's peak memory, checked against what the machine has before any work.

    >>> need, what = peak_lower_bound(settings, read_config(folder), vae_config(folder))
    >>> check_memory(settings, read_config(folder), vae_config(folder))   # or DriftToolError:
    error: --height 16384 --width 16384: the run needs at least 23.7 GiB, 20.3 GiB available (...)

The bound counts only tensors of known shapes that the code keeps alive at the same moment, so
a run is refused only when it cannot fit whatever else it allocates (the operators' working
tensors, the capture, the weights are not counted: a run that fits is never refused). B samples,
an h × w patch grid (N = h·w image tokens, H × W = 16h × 16w pixels), ``a`` bytes per element of
the model dtype:

* always, for the whole run: the initial latents x0 [B, N, in_channels] FP32;
* the transformer's image-stream MLP (``mmdit_block``): while ``mlp_down_gemm`` runs, the
  block's residual stream and the modulated input [B, N, d], the MLP hidden state
  [B, N, mlp_dim] and the output [B, N, d] (B rows: batched CFG runs 2B, not counted);
* a chain or edit run's VAE decode (``chain.decode_latents``), after the trajectory: its
  latents x_0 … x_S [S+1, B, N, in_channels] (latents dtype) and, at the last full-resolution
  residual block's ``conv2`` (C = base_dim · dim_mult[0] channels, ``model.vae.ResidualBlock``),
  the block's shortcut, ``conv1``'s output and ``norm2``'s output [B, C, H, W] (dtype ``a``),
  plus the convolution's causally padded input (three frames: [B, C, 3, H, W]) and its output
  [B, C, H, W] in the family's working dtype (FP32 in the strict family, ``a`` in production).

Available memory: ``MemAvailable`` of ``/proc/meminfo`` for the CPU (no check where it cannot
be read), ``torch.cuda.mem_get_info`` (free bytes) for a CUDA device.
"""

from __future__ import annotations

import torch

from drifttool.errors import DriftToolError
from drifttool.model.config import MMDiTConfig
from drifttool.model.vae import VAEConfig
from drifttool.settings import RunSettings

GIB = 1 << 30
MEMINFO = "/proc/meminfo"
"""Where the host's available memory is read (Linux)."""


def _amount(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB // 10 else f"{n / (1 << 20):.0f} MiB"


def available_bytes(device: str) -> int | None:
    """Bytes a run on ``device`` can still allocate: ``MemAvailable`` of ``MEMINFO`` for ``cpu``
    (None where that file is missing or has no such line), the free bytes of a CUDA device."""
    if torch.device(device).type == "cuda":
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def peak_lower_bound(settings: RunSettings, config: MMDiTConfig, vae: VAEConfig | None = None
                     ) -> tuple[int, str]:
    """A lower bound of the run's peak memory in bytes (module docstring), with a few words on
    what it is made of. ``vae``: the config of the VAE that decodes the final latents (chain and
    edit runs), None for a run without a decode."""
    b = len(settings.samples)
    h, w = settings.img_grid
    tokens = h * w
    a = settings.torch_dtype.itemsize
    x0 = b * tokens * config.in_channels * 4  # [B, N, Cp] fp32
    forward = b * tokens * (3 * config.inner_dim + config.mlp_dim) * a
    need, what = x0 + forward, "the transformer's image-stream MLP activations"
    if vae is not None:
        latents = (settings.steps + 1) * b * tokens * config.in_channels \
            * settings.sampler().latents_torch_dtype.itemsize  # [S+1, B, N, Cp]
        height, width = settings.image_size
        c = vae.base_dim * vae.dim_mult[0]
        work = 4 if settings.mode.family == "strict" else a
        decode = b * c * height * width * (3 * a + 4 * work)  # [B, C, (3 +) H, W] tensors
        if x0 + latents + decode > need:
            need = x0 + latents + decode
            what = (f"the VAE decode's full-resolution activations ({_amount(decode)} at "
                    f"{height}x{width} px, {c} channels) and the trajectory's latents")
    return need, what


def check_memory(settings: RunSettings, config: MMDiTConfig, vae: VAEConfig | None = None) -> None:
    """Refuse a run whose peak memory cannot fit: even ``peak_lower_bound`` exceeds
    ``available_bytes`` of the run's device (no check where that is unknown).

    Raises:
        DriftToolError: one line naming the image size, the bound, what it is made of and the
            memory available.
    """
    free = available_bytes(settings.device)
    if free is None:
        return
    need, what = peak_lower_bound(settings, config, vae)
    if need > free:
        where = "host" if torch.device(settings.device).type == "cpu" else f"{settings.device} device"
        height, width = settings.image_size
        raise DriftToolError(
            f"--height {height} --width {width}: the run needs at least {_amount(need)}, "
            f"{_amount(free)} available ({where} memory; a lower bound: {what}); a smaller "
            "image or fewer samples fits in less")
