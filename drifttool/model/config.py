"""Model configuration: ``MMDiTConfig`` and its named flavors.

    >>> from drifttool.model.config import FLAVORS
    >>> cfg = FLAVORS["tiny"]()
    >>> cfg.inner_dim, cfg.num_layers, cfg.in_channels
    (32, 2, 64)

Fields carry diffusers' ``QwenImageTransformer2DModel`` argument names so a checkpoint's
``config.json`` maps one to one (numerics spec §1). Flavors are functions (torchtitan's
``models/llama3/__init__.py`` habit): ``full()`` is the published Qwen-Image transformer,
``tiny()`` the embedded debug model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from drifttool.errors import UnsupportedConfigError

# diffusers 0.42.1 ``QwenImageTransformer2DModel.__init__`` arguments whose non-default values
# select a different graph (Edit-2511 / Layered variants, guidance distillation); drifttool
# implements only the defaults and fails closed on anything else (numerics §1, §5.10).
_UNSUPPORTED_TRUE_FLAGS = ("guidance_embeds", "zero_cond_t", "use_additional_t_cond", "use_layer3d_rope")


@dataclass(frozen=True, kw_only=True)
class MMDiTConfig:
    """Shape of the Qwen-Image MMDiT (double-stream transformer), numerics spec §1.

    Attributes:
        patch_size: latent patch edge (2; 2×2 packing of 16-channel latents into 64 values).
        in_channels: packed input width per token (``patch_size² · out_channels`` = 64).
        out_channels: latent channels (16); the output width is ``patch_size² · out_channels``.
        num_layers: number of double-stream blocks (60).
        attention_head_dim: head dimension Dh (128).
        num_attention_heads: heads H (24); the hidden size is ``d = H · Dh``.
        joint_attention_dim: text-encoder hidden size Dj (3584, Qwen2.5-VL-7B).
        axes_dims_rope: RoPE axis sizes (frame, row, column); sum equals Dh; each even.
        rope_theta: RoPE base (10000).
        eps: epsilon of every LayerNorm / RMSNorm in the model (1e-6).
        mlp_ratio: MLP hidden width over d (4; diffusers ``FeedForward`` default).

    Raises:
        UnsupportedConfigError: shapes that are not Qwen-Image-shaped (see ``__post_init__``).
    """

    patch_size: int = 2
    in_channels: int = 64
    out_channels: int = 16
    num_layers: int = 60
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 3584
    axes_dims_rope: tuple[int, int, int] = (16, 56, 56)
    rope_theta: int = 10000
    eps: float = 1e-6
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        object.__setattr__(self, "axes_dims_rope", tuple(int(a) for a in self.axes_dims_rope))
        bad = []
        if self.patch_size != 2:
            bad.append(f"patch_size={self.patch_size} (only 2×2 packing is supported)")
        if self.in_channels != self.patch_size**2 * self.out_channels:
            bad.append(
                f"in_channels={self.in_channels} != patch_size²·out_channels="
                f"{self.patch_size**2 * self.out_channels} (input and output must share the packed layout)"
            )
        if len(self.axes_dims_rope) != 3:
            bad.append(f"axes_dims_rope={self.axes_dims_rope} must have 3 axes (frame, row, column)")
        elif sum(self.axes_dims_rope) != self.attention_head_dim:
            bad.append(f"sum(axes_dims_rope)={sum(self.axes_dims_rope)} != attention_head_dim={self.attention_head_dim}")
        if any(a <= 0 or a % 2 for a in self.axes_dims_rope):
            bad.append(f"axes_dims_rope={self.axes_dims_rope} must be positive and even")
        for name in ("num_layers", "attention_head_dim", "num_attention_heads", "joint_attention_dim", "out_channels"):
            if getattr(self, name) <= 0:
                bad.append(f"{name}={getattr(self, name)} must be positive")
        if bad:
            raise UnsupportedConfigError("unsupported MMDiT config: " + "; ".join(bad))

    @property
    def inner_dim(self) -> int:
        """Hidden size d = heads · head_dim (3072)."""
        return self.num_attention_heads * self.attention_head_dim

    @property
    def out_dim(self) -> int:
        """Width of ``proj_out`` = packed output channels per token (64)."""
        return self.patch_size**2 * self.out_channels

    @property
    def mlp_dim(self) -> int:
        """MLP hidden width (4·d = 12288)."""
        return self.mlp_ratio * self.inner_dim

    def arch_fields(self) -> dict[str, Any]:
        """Every field that changes tensor shapes or arithmetic: the incomparability fingerprint.

        Two runs whose ``arch_fields()`` differ cannot be aligned record by record.
        """
        d = dataclasses.asdict(self)
        d["axes_dims_rope"] = list(self.axes_dims_rope)
        d["inner_dim"] = self.inner_dim
        d["out_dim"] = self.out_dim
        d["mlp_dim"] = self.mlp_dim
        return d

    def to_diffusers_config(self) -> dict[str, Any]:
        """The ``config.json`` diffusers writes for this shape (``QwenImageTransformer2DModel``)."""
        if self.rope_theta != 10000 or self.eps != 1e-6 or self.mlp_ratio != 4:
            raise UnsupportedConfigError(
                "rope_theta, eps and mlp_ratio are fixed in diffusers' QwenImageTransformer2DModel; "
                f"got rope_theta={self.rope_theta}, eps={self.eps}, mlp_ratio={self.mlp_ratio}"
            )
        return {
            "_class_name": "QwenImageTransformer2DModel",
            "_diffusers_version": "0.42.1",
            "patch_size": self.patch_size,
            "in_channels": self.in_channels,
            "out_channels": self.out_channels,
            "num_layers": self.num_layers,
            "attention_head_dim": self.attention_head_dim,
            "num_attention_heads": self.num_attention_heads,
            "joint_attention_dim": self.joint_attention_dim,
            "guidance_embeds": False,
            "axes_dims_rope": list(self.axes_dims_rope),
            "zero_cond_t": False,
            "use_additional_t_cond": False,
            "use_layer3d_rope": False,
        }


_DIFFUSERS_SHAPE_KEYS = (
    "patch_size",
    "in_channels",
    "out_channels",
    "num_layers",
    "attention_head_dim",
    "num_attention_heads",
    "joint_attention_dim",
    "axes_dims_rope",
)


def from_diffusers_config(cfg: dict[str, Any]) -> MMDiTConfig:
    """Build an ``MMDiTConfig`` from a diffusers transformer ``config.json`` dict.

    Keys starting with ``_`` (``_class_name``, ``_diffusers_version``, ...) are ignored; missing
    keys take diffusers' constructor defaults (= ``full()``); ``out_channels: null`` means
    ``in_channels`` (diffusers' rule).

    Raises:
        UnsupportedConfigError: ``_class_name`` is not ``QwenImageTransformer2DModel``; any of
            ``guidance_embeds``, ``zero_cond_t``, ``use_additional_t_cond``, ``use_layer3d_rope``
            is true; an unknown key is present; or the shape is unsupported.
    """
    cls = cfg.get("_class_name", "QwenImageTransformer2DModel")
    problems = []
    if cls != "QwenImageTransformer2DModel":
        problems.append(f"_class_name={cls!r} (expected 'QwenImageTransformer2DModel')")
    for flag in _UNSUPPORTED_TRUE_FLAGS:
        if cfg.get(flag):
            problems.append(f"{flag}={cfg[flag]!r}")
    known = set(_DIFFUSERS_SHAPE_KEYS) | set(_UNSUPPORTED_TRUE_FLAGS)
    unknown = sorted(k for k in cfg if not k.startswith("_") and k not in known)
    if unknown:
        problems.append(f"unknown keys {unknown}")
    if problems:
        raise UnsupportedConfigError("unsupported diffusers config: " + "; ".join(problems))
    kw = {k: cfg[k] for k in _DIFFUSERS_SHAPE_KEYS if k in cfg}
    if "out_channels" in kw and kw["out_channels"] is None:
        kw["out_channels"] = kw.get("in_channels", MMDiTConfig.in_channels)
    if "axes_dims_rope" in kw:
        kw["axes_dims_rope"] = tuple(kw["axes_dims_rope"])
    return MMDiTConfig(**kw)


def full() -> MMDiTConfig:
    """The published Qwen-Image transformer (numerics §1): 60 blocks, 24×128 heads, 20.4 B params."""
    return MMDiTConfig(
        patch_size=2,
        in_channels=64,
        out_channels=16,
        num_layers=60,
        attention_head_dim=128,
        num_attention_heads=24,
        joint_attention_dim=3584,
        axes_dims_rope=(16, 56, 56),
    )


def tiny() -> MMDiTConfig:
    """The embedded debug model: Qwen-Image-shaped (real 16-channel latents, 64-value packing,
    three RoPE axes, both streams), 2 blocks of 2×16 heads (d = 32), text width 32.

    92,448 parameters; a 4-step CFG trajectory at a 4×6 grid runs in well under a second
    on a 2-core CPU.
    """
    return MMDiTConfig(
        patch_size=2,
        in_channels=64,
        out_channels=16,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        axes_dims_rope=(4, 6, 6),
    )


FLAVORS: dict[str, Callable[[], MMDiTConfig]] = {"tiny": tiny, "full": full}
