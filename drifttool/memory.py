"""A lower bound of a run's peak memory, checked against what the machine has before any work.

    >>> need, what = peak_lower_bound(settings, read_config(folder), vae_config(folder))
    >>> check_memory(settings, read_config(folder), vae_config(folder))   # or DriftToolError:
    error: --height 16384 --width 16384: the run needs at least 23.7 GiB, 20.3 GiB available (...)

The bound counts only tensors of known shapes that the code keeps alive at the same moment, so
a run is refused only when it cannot fit whatever else it allocates (the operators' working
tensors, the capture but for one key table, the weights are not counted: a run that fits is
never refused). B samples,
an h × w patch grid (N = h·w image tokens, H × W = 16h × 16w pixels), ``a`` bytes per element of
the model dtype:

* always, for the whole run: the initial latents x0 [B, N, in_channels] FP32 and an edit run's
  condition latents [1, Nc, in_channels] FP32 (Nc tokens over its condition images);
* the transformer's image-stream MLP (``mmdit_block``) over S = N + Nc tokens (an edit run's
  stream is [noisy | condition]): while ``mlp_down_gemm`` runs, the block's residual stream and
  the modulated input [B, S, d], the MLP hidden state [B, S, mlp_dim] and the output [B, S, d]
  (B rows: batched CFG runs 2B, not counted);
* where the attention runs unfused (``unfused_attention``: the strict family at capture L2, its
  decomposition ``joint_attn_qk_gemm`` → ``joint_attn_softmax`` → ``joint_attn_av_gemm``,
  ``ops.specs``), the scores and the probabilities [B, heads, S', S'] FP32, alive together while
  the softmax and the AV product run (S' ≥ S: the text tokens are not counted);
* a chain or edit run's VAE decode (``chain.decode_latents``), after the trajectory: its
  latents x_0 … x_S [S+1, B, N, in_channels] (latents dtype) and, at the last full-resolution
  residual block's ``conv2`` (C = base_dim · dim_mult[0] channels, ``model.vae.ResidualBlock``),
  the block's shortcut, ``conv1``'s output and ``norm2``'s output [B, C, H, W] (dtype ``a``),
  plus the convolution's causally padded input (three frames: [B, C, 3, H, W]) and its output
  [B, C, H, W] in the family's working dtype (FP32 in the strict family, ``a`` in production);
* an edit run's VAE encode of its largest condition image (``chain_edit.encode_condition``, one
  image at a time, before the trajectory), at its resized size Hc × Wc: the same five tensors of
  the encoder's first full-resolution residual block with B = 1;
* capturing at L1 or L2 on the CPU, a VAE output at full resolution is one record row of
  C·H·W words (C·Hc·Wc for the encode, 3·Hc·Wc for the resized image), for which the digest
  builds its column key table (``key_table_bytes``: 96 bytes a column, columns the next power
  of two; the table stays cached).

Each bullet after the first is a moment of its own; the bound is the largest.

A strict training recompute with a merged adapter is checked once its model is loaded
(``check_canonical_gradient``): the canonical gradient's FP32 partials per adapted weight and
(sample, CFG branch) (``canonical_gradient_bytes``) must fit beside it.

Available memory: ``MemAvailable`` of ``/proc/meminfo`` for the CPU (no check where it cannot
be read), ``torch.cuda.mem_get_info`` (free bytes) for a CUDA device.
"""

from __future__ import annotations

from typing import Sequence

import torch

from drifttool.artifact.levels import captures_internals
from drifttool.errors import DriftToolError
from drifttool.host_memory import MEMINFO, host_meminfo
from drifttool.model.config import MMDiTConfig
from drifttool.model.vae import VAEConfig
from drifttool.settings import RunSettings

GIB = 1 << 30


def _amount(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB // 10 else f"{n / (1 << 20):.0f} MiB"


def available_bytes(device: str) -> int | None:
    """Bytes a run on ``device`` can still allocate: ``MemAvailable`` of ``MEMINFO`` for ``cpu``
    (``host_memory.host_meminfo``: None where that file is missing or lacks the line), the free bytes of a CUDA device."""
    if torch.device(device).type == "cuda":
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    host = host_meminfo(MEMINFO)
    return None if host is None else host.available


def _vae_block(c: int, height: int, width: int, a: int, work: int) -> int:
    """Bytes alive at a full-resolution residual block's ``conv2`` of one image (module
    docstring): three [C, H, W] tensors in dtype ``a``, the padded input [C, 3, H, W] and the
    output [C, H, W] in the working dtype."""
    return c * height * width * (3 * a + 4 * work)


def key_table_bytes(words: int) -> int:
    """Bytes alive while the CPU digest builds its column key table for a record row of
    ``words`` 32-bit words (``digestcore.np_table``/``col_limbs``): the table of
    ``max(1024, 2^⌈log2 words⌉)`` columns [6, n] is made as int64 then converted to FP64, the two
    alive at once (16 · 6 · n bytes); the FP64 table stays cached for the process."""
    n = max(1024, 1 << max(0, words - 1).bit_length())
    return 2 * 6 * n * 8


def _captures_rows(settings: RunSettings) -> bool:
    """Whether the run digests its operator outputs on the CPU (capture L1 or L2)."""
    return (settings.mode.captures and settings.capture != "L0"
            and torch.device(settings.device).type == "cpu")


def unfused_attention(settings: RunSettings) -> bool:
    """Whether the transformer's attention runs as its decomposition ``joint_attn_qk_gemm`` →
    ``joint_attn_softmax`` → ``joint_attn_av_gemm`` (the strict family at capture L2:
    ``Runtime.wants_internals``, ``ops.registry``), which holds [B, H, S, S] FP32 scores."""
    return (settings.mode.family == "strict" and settings.mode.captures
            and captures_internals(settings.capture) and settings.internals)


def peak_lower_bound(settings: RunSettings, config: MMDiTConfig, vae: VAEConfig | None = None,
                     condition_grids: Sequence[tuple[int, int]] | None = None) -> tuple[int, str]:
    """A lower bound of the run's peak memory in bytes (module docstring), with a few words on
    what it is made of. ``vae``: the config of the VAE that decodes the final latents (chain and
    edit runs), None for a run without a decode. ``condition_grids``: the (h, w) patch grids of
    an edit run's condition images (None: those of ``settings.external``, if any); with ``vae``,
    each image is VAE-encoded at 16h × 16w pixels."""
    if condition_grids is None:
        condition_grids = settings.external.cond_grids if settings.external is not None else ()
    b = len(settings.samples)
    h, w = settings.img_grid
    tokens = h * w
    cond = sum(gh * gw for gh, gw in condition_grids)  # the condition tokens [1, Nc, Cp]
    a = settings.torch_dtype.itemsize
    x0 = (b * tokens + cond) * config.in_channels * 4  # x0 [B, N, Cp], condition latents, fp32
    seq = tokens + cond  # the image stream: [noisy | condition] tokens
    forward = b * seq * (3 * config.inner_dim + config.mlp_dim) * a
    moments = [(x0 + forward, "the transformer's image-stream MLP activations")]
    if unfused_attention(settings):
        scores = 2 * b * config.num_attention_heads * seq * seq * 4  # scores and probs [B, H, S, S]
        moments.append((x0 + scores, f"the unfused attention's scores and probabilities at capture "
                        f"{settings.capture}, {_amount(scores)}: [B, heads, S, S] FP32 for {seq} image "
                        "tokens; --no-internals or --capture L1 runs it fused"))
    work = 4 if settings.mode.family == "strict" else a
    rows = _captures_rows(settings)
    if vae is not None:
        c = vae.base_dim * vae.dim_mult[0]
        latents = (settings.steps + 1) * b * tokens * config.in_channels \
            * settings.sampler().latents_torch_dtype.itemsize  # [S+1, B, N, Cp]
        height, width = settings.image_size
        decode = b * _vae_block(c, height, width, a, work)  # [B, C, (3 +) H, W] tensors
        moments.append((x0 + latents + decode,
                        f"the VAE decode's full-resolution activations ({_amount(decode)} at "
                        f"{height}x{width} px, {c} channels) and the trajectory's latents"))
        sizes = [(16 * gh, 16 * gw) for gh, gw in condition_grids]
        if sizes:  # encoded one at a time, before the trajectory
            ch, cw = max(sizes, key=lambda s: s[0] * s[1])
            moments.append((_vae_block(c, ch, cw, a, work),
                            f"the condition image's VAE encode at {cw}x{ch} px ({c} channels)"))
        if rows:  # one record row per sample: C·H·W words of a full-resolution VAE output
            ph, pw = max([(height, width), *sizes], key=lambda s: s[0] * s[1])
            table = key_table_bytes(max(c, 3) * ph * pw)
            moments.append((table, f"the capture's digest key table ({_amount(table)}) for the "
                            f"{pw}x{ph} px VAE activations' records at capture {settings.capture}"))
    return max(moments, key=lambda m: m[0])


def check_memory(settings: RunSettings, config: MMDiTConfig, vae: VAEConfig | None = None, *,
                 condition_grids: Sequence[tuple[int, int]] | None = None, source: str | None = None) -> None:
    """Refuse a run whose peak memory cannot fit: even ``peak_lower_bound`` exceeds
    ``available_bytes`` of the run's device (no check where that is unknown). ``source``: the
    options that set the image size, as the message names them (default ``--height H --width
    W``; an edit run sized by its condition image names ``--image-area``).

    Raises:
        DriftToolError: one line naming the image size, the bound, what it is made of, the
            memory available and what fits in less.
    """
    free = available_bytes(settings.device)
    if free is None:
        return
    need, what = peak_lower_bound(settings, config, vae, condition_grids)
    if need > free:
        where = "host" if torch.device(settings.device).type == "cpu" else f"{settings.device} device"
        height, width = settings.image_size
        smaller = "--no-internals, --capture L1, a smaller image" if "unfused attention" in what else \
            "--capture L0, a smaller image" if "key table" in what else "a smaller image"
        if source is not None and "--image-area" in source:
            smaller = smaller.replace("a smaller image", "a smaller --image-area")
        size = source or f"--height {height} --width {width}"
        n = len(settings.samples)
        raise DriftToolError(
            f"{f'{n:,} samples at ' if n > 1 else ''}{size}: the run needs at least {_amount(need)}, "
            f"{_amount(free)} available ({where} memory; a lower bound: {what}); {smaller} or fewer "
            "samples fits in less")


def canonical_gradient_bytes(weights: Sequence[tuple[int, int]], rows: int) -> int:
    """Bytes the strict canonical gradient (``training.ledger``) of a **merged** adapter holds at
    a step's end: per adapted weight W' [out, in] one FP32 atom per (sample, CFG branch) row of
    the step (every row's partial is kept until ``finish_step`` orders them) and the running sum
    D_t, FP32 [out, in] too: ``(rows + 1) · Σ out · in · 4``. ``weights``: the adapted weights'
    (out, in); ``rows``: the step's (sample, branch) atoms on this rank. A lower bound: a graphed
    step holds its atoms twice (``model.graphs_train``), and the step's activations come on top."""
    return (int(rows) + 1) * sum(int(o) * int(i) for o, i in weights) * 4


def check_canonical_gradient(weights: Sequence[tuple[int, int]], rows: int, device: str) -> None:
    """Refuse a strict training recompute with a merged adapter whose canonical gradient
    (``canonical_gradient_bytes``) exceeds ``available_bytes`` of ``device`` once the model is
    loaded (no check where that is unknown), before any step runs.

    Raises:
        DriftToolError: one line naming the bound, what it is made of, the memory available and
            the layout whose gradients fit (``--lora-mode unfused-fp32``: the factors' own).
    """
    free = available_bytes(device)
    need = canonical_gradient_bytes(weights, rows)
    if free is None or need <= free:
        return
    where = "host" if torch.device(device).type == "cpu" else f"{device} device"
    raise DriftToolError(
        f"recompute --grad: a merged adapter's strict gradients need at least {_amount(need)}, "
        f"{_amount(free)} available ({where} memory beside the loaded model): the canonical gradient "
        f"keeps an FP32 [out, in] partial per adapted weight ({len(weights)}) for each of the step's "
        f"{rows} (sample, CFG branch) rows, and their running sum; roll out with --lora-mode "
        "unfused-fp32 (its gradients are the rank-sized factors') or with fewer samples")
