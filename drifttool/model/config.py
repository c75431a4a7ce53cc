"""Model configuration: ``MMDiTConfig`` and its named flavors.

    >>> from drifttool.model.config import FLAVORS
    >>> cfg = FLAVORS["tiny"]()
    >>> cfg.inner_dim, cfg.num_layers, cfg.in_channels, cfg.latent_channels
    (32, 2, 64, 16)

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


# Top-level keys diffusers' config loader reads but does not pass to ``__init__`` although they
# change the arithmetic: ``quantization_config`` makes ``from_pretrained`` quantise the weights.
_UNHONOURED_KEYS = ("quantization_config",)

# Integer fields of the config and the least value each may take; none may exceed a tensor
# dimension (int64), which keeps every derived size printable and every check instant.
_MAX_SIZE = 2**63 - 1
_INT_FIELDS = {
    "patch_size": 1,
    "in_channels": 1,
    "out_channels": 1,
    "num_layers": 1,
    "attention_head_dim": 1,
    "num_attention_heads": 1,
    "joint_attention_dim": 1,
    "rope_theta": 1,
    "mlp_ratio": 1,
}

# The pipelines pack latents 2×2 into tokens (``_pack_latents``), whatever ``patch_size`` says.
LATENT_PACK = 4


@dataclass(frozen=True, kw_only=True)
class MMDiTConfig:
    """Shape of the Qwen-Image MMDiT (double-stream transformer), numerics spec §1.

    Attributes:
        patch_size: p; only sizes ``proj_out`` (``p² · out_channels`` outputs per token), as in
            diffusers (2 for Qwen-Image).
        in_channels: input width per token of ``img_in`` (64 = 2×2-packed 16-channel latents).
        out_channels: c_out; ``proj_out`` gives ``p² · c_out`` per token (16).
        num_layers: number of double-stream blocks (60).
        attention_head_dim: head dimension Dh (128).
        num_attention_heads: heads H (24); the hidden size is ``d = H · Dh``.
        joint_attention_dim: text-encoder hidden size Dj (3584, Qwen2.5-VL-7B).
        axes_dims_rope: RoPE axis sizes (frame, row, column); sum equals Dh; each even.
        rope_theta: RoPE base (10000).
        eps: epsilon of every LayerNorm / RMSNorm in the model (1e-6).
        mlp_ratio: MLP hidden width over d (4; diffusers ``FeedForward`` default).

    Every shape diffusers' ``QwenImageTransformer2DModel`` builds and runs is accepted, including
    ``p² · c_out != in_channels`` (its unit-test model has 16 in, 4 out; ``out_channels=None``
    gives ``c_out = in_channels``). Whether a *rollout* can use the shape is ``check_rollout``.

    Raises:
        UnsupportedConfigError: a non-integer or non-positive size, or RoPE axes diffusers cannot
            run (not three, odd, or not summing to Dh); every problem named in one message.
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
        bad = []
        for name, least in _INT_FIELDS.items():
            v = getattr(self, name)
            if type(v) is not int:  # bool is an int subclass; 2.0 is not a size
                bad.append(f"{name}={v!r} must be an integer")
            elif not least <= v <= _MAX_SIZE:
                bad.append(f"{name}={v if v.bit_length() < 128 else '<huge>'} must be in [{least}, 2**63-1]")
        axes = self.axes_dims_rope
        if not isinstance(axes, (list, tuple)) or any(type(a) is not int or abs(a) > _MAX_SIZE for a in axes):
            bad.append(f"axes_dims_rope={str(axes)[:80]} must be a list of integers in [1, 2**63-1]")
        else:
            object.__setattr__(self, "axes_dims_rope", tuple(axes))
            if len(axes) != 3:
                bad.append(f"axes_dims_rope={list(axes)} must have 3 axes (frame, row, column)")
            elif type(self.attention_head_dim) is int and sum(axes) != self.attention_head_dim:
                bad.append(f"sum(axes_dims_rope)={sum(axes)} != attention_head_dim={self.attention_head_dim}")
            if any(a <= 0 or a % 2 for a in axes):
                bad.append(f"axes_dims_rope={list(axes)} must be positive and even")
        if type(self.eps) is not float or not self.eps > 0:
            bad.append(f"eps={self.eps!r} must be a positive float")
        if bad:
            raise UnsupportedConfigError("unsupported MMDiT config: " + "; ".join(bad))

    def check_rollout(self) -> None:
        """Refuse a shape the sampler cannot run, naming why (the transformer itself loads and
        runs, as in diffusers; its pipelines fail on it too).

        Raises:
            UnsupportedConfigError: ``in_channels`` is not a multiple of 4 (2×2-packed latents),
                or the v_t width ``patch_size² · out_channels`` differs from the x_t width
                ``in_channels`` (``x_t + dt · v_t`` needs them equal).
        """
        bad = []
        if self.in_channels % LATENT_PACK:
            bad.append(f"in_channels={self.in_channels} is not 2×2-packed latents (not a multiple of 4)")
        if self.out_dim != self.in_channels:
            bad.append(
                f"v_t width patch_size²·out_channels={self.patch_size}²·{self.out_channels}={self.out_dim} "
                f"!= x_t width in_channels={self.in_channels}"
            )
        if bad:
            raise UnsupportedConfigError(
                "this transformer loads but cannot drive a rollout (x_{t-1} = x_t + dt·v_t): " + "; ".join(bad)
            )

    @property
    def latent_channels(self) -> int:
        """Latent channels C of a rollout: ``in_channels / 4`` (the pipelines'
        ``num_channels_latents = in_channels // 4``, packed 2×2 into ``in_channels`` per token).

        Raises:
            UnsupportedConfigError: as ``check_rollout``.
        """
        self.check_rollout()
        return self.in_channels // LATENT_PACK

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


def from_diffusers_config(cfg: Any) -> MMDiTConfig:
    """Build an ``MMDiTConfig`` from a diffusers transformer ``config.json`` dict, reading it the
    way diffusers 0.42.1 ``ConfigMixin.extract_init_dict`` + ``QwenImageTransformer2DModel``
    do: keys named in ``_use_default_values`` take the constructor default; other ``_``-keys
    (``_class_name``, ``_diffusers_version``, ``_name_or_path``) and keys the constructor does
    not take (``pooled_projection_dim``, ...) are ignored; missing keys take the constructor
    defaults (= ``full()``); ``out_channels`` null (or 0) means ``in_channels``
    (``out_channels or in_channels``).

    Raises:
        UnsupportedConfigError: ``cfg`` is not a JSON object; ``_class_name`` names another
            model class; ``guidance_embeds``, ``zero_cond_t``, ``use_additional_t_cond`` or
            ``use_layer3d_rope`` is true (graphs drifttool does not implement) or not a boolean;
            ``quantization_config`` is present (diffusers would quantise the weights); or the
            shape is invalid (see ``MMDiTConfig``). Every problem is named in one message.
    """
    if not isinstance(cfg, dict):
        raise UnsupportedConfigError(f"diffusers config must be a JSON object, got {type(cfg).__name__}")
    defaults = cfg.get("_use_default_values", [])
    if not isinstance(defaults, list) or not all(isinstance(k, str) for k in defaults):
        raise UnsupportedConfigError(f"_use_default_values={defaults!r} must be a list of key names")
    cfg = {k: v for k, v in cfg.items() if k not in defaults}
    cls = cfg.get("_class_name", "QwenImageTransformer2DModel")
    problems = []
    if cls != "QwenImageTransformer2DModel":
        problems.append(f"_class_name={cls!r} (expected 'QwenImageTransformer2DModel')")
    for flag in _UNSUPPORTED_TRUE_FLAGS:
        v = cfg.get(flag)
        if v is not None and not isinstance(v, bool):
            problems.append(f"{flag}={v!r} must be true or false")
        elif v:
            problems.append(f"{flag}=true (a graph drifttool does not implement)")
    for key in _UNHONOURED_KEYS:
        if key in cfg:
            problems.append(f"{key} present (diffusers would quantise the weights; drifttool runs them as stored)")
    if problems:
        raise UnsupportedConfigError("unsupported diffusers config: " + "; ".join(problems))
    kw = {k: cfg[k] for k in _DIFFUSERS_SHAPE_KEYS if k in cfg}
    out = kw.get("out_channels", MMDiTConfig.out_channels)
    if out is None or (type(out) is int and out == 0):  # diffusers: ``out_channels or in_channels``
        kw["out_channels"] = kw.get("in_channels", MMDiTConfig.in_channels)
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
