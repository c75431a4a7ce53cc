"""What a replay or a training recompute of a stored rollout may change, in one place.

    >>> recompute_run("runs/a", "runs/a-train", RerunOptions(mode="auto"),
    ...               TrainOptions(grad=True, micro_batch=1))
    >>> replay_run("runs/a", "runs/a-replay", RerunOptions(capture="L2", overwrite=True))

``RerunOptions`` (replay and recompute): the runtime mode and capture level (default: the
rollout's), the device (default: the rollout's; shapes always come from the artifact), the model
overrides (fixture, checkpoint, LoRA adapter; every one fingerprint-checked against the rollout)
and ``overwrite``. ``TrainOptions`` (recompute only): the backward and the
trainer's execution layout. Both validate on construction with the lines ``drifttool run`` uses
(``drifttool.setting_checks.check_mode``/``check_level``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from drifttool.errors import DriftToolError
from drifttool.setting_checks import check_device, check_level, check_mode


@dataclass(frozen=True, kw_only=True)
class RerunOptions:
    """Overrides of a replay or recompute (``None``: the rollout's own).

    Attributes:
        mode: runtime mode (strict | audit | auto | off).
        capture: capture level (L0 | L1 | L2).
        internals: at L2, capture the fused attention's internals (``artifact.levels``); None:
            as the rollout did (its manifest's ``settings.internals``, true when absent).
        fixture: fixture holding the model, if the manifest's name does not resolve.
        checkpoint: model folder replacing the manifest's (must match its fingerprint).
        lora: LoRA adapter replacing the manifest's (must match its fingerprint).
        device: cpu | cuda | cuda:N (``setting_checks.check_device``); None: the rollout's
            (``settings.device``, ``cpu`` when not recorded).
        overwrite: replace an existing artifact directory.

    Raises:
        DriftToolError: unknown mode, capture level or device; CUDA unavailable.
    """

    mode: str | None = None
    capture: str | None = None
    internals: bool | None = None
    fixture: str | Path | None = None
    checkpoint: str | Path | None = None
    lora: str | Path | None = None
    device: str | None = None
    overwrite: bool = False

    def rerun_internals(self, settings: dict) -> bool:
        """Whether the re-run captures the internals at L2: ``internals``, else the stored
        rollout's ``settings`` (absent: true)."""
        return bool(settings.get("internals", True) if self.internals is None else self.internals)

    def __post_init__(self) -> None:
        if self.mode is not None:
            object.__setattr__(self, "mode", check_mode(self.mode).value)  # "STRICT" is "strict"
        if self.device is not None:
            object.__setattr__(self, "device", check_device(self.device))  # "CPU" is "cpu"
        if self.capture is not None:
            object.__setattr__(self, "capture", check_level(self.capture))  # "l2" is "L2"


@dataclass(frozen=True, kw_only=True)
class TrainOptions:
    """The trainer's side of a recompute.

    Attributes:
        grad: backward of −mean_b logp_t per SDE step, LoRA gradients digested (needs an adapter).
        gradient_checkpointing: recompute block activations in the backward.
        micro_batch: samples per trainer forward (``trainer.micro_batched``); None = the whole batch.
        trim_padding: with ``micro_batch``, trim the prompts to each micro-batch.

    Raises:
        DriftToolError: ``micro_batch`` below 1.
    """

    grad: bool = False
    gradient_checkpointing: bool = False
    micro_batch: int | None = None
    trim_padding: bool = True

    def __post_init__(self) -> None:
        if self.micro_batch is not None and int(self.micro_batch) < 1:
            raise DriftToolError(f"micro-batch size must be >= 1, got {self.micro_batch}")
