"""Where a ``--checkpoint`` is: a folder, or a Hugging Face hub id found in the local cache.

    >>> resolve_checkpoint("Qwen-Image")              # a folder: itself
    PosixPath('Qwen-Image')
    >>> resolve_checkpoint("Qwen/Qwen-Image")         # a hub id: its cached snapshot (offline)
    PosixPath('/root/.cache/huggingface/hub/models--Qwen--Qwen-Image/snapshots/<commit>')

The argument means what diffusers' ``from_pretrained`` takes: an existing directory is a model
folder (transformer or pipeline, ``checkpoint_files.transformer_folder``); anything else must be
a hub repository id, looked up with ``huggingface_hub.snapshot_download(local_files_only=True)``
in the cache that ``huggingface_hub`` uses (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
``~/.cache/huggingface/hub``): its ``refs/main`` snapshot. Nothing is downloaded — a model not in
the cache is refused, naming the command that downloads it. ``huggingface_hub`` is a dependency
of diffusers and transformers; without it a hub id is refused in one line.

A folder whose transformer holds pickle weights only (``diffusion_pytorch_model.bin``, as
``save_pretrained(safe_serialization=False)`` or older uploads write) is refused here, before
anything loads, with the one-line diffusers call that rewrites it as safetensors (drifttool never
unpickles: ``checkpoint_files``).
"""

from __future__ import annotations

from pathlib import Path

from drifttool.errors import CheckpointError
from drifttool.model.checkpoint_files import PICKLE_SUFFIXES, conversion_hint, transformer_folder


def refuse_pickle_only(root: Path) -> None:
    """Refuse a transformer or pipeline folder whose transformer has pickle weights and no
    safetensors file at all (one line, with ``conversion_hint``).

    Raises:
        CheckpointError: as said; or as ``transformer_folder`` (no config, wrong component).
    """
    folder = transformer_folder(root)
    names = [p.name for p in folder.iterdir() if p.is_file()]
    pickles = sorted(n for n in names if Path(n).suffix in PICKLE_SUFFIXES)
    if pickles and not any(n.endswith(".safetensors") for n in names):
        raise CheckpointError(f"{folder}: pickle weights only ({', '.join(pickles)}); drifttool "
                              f"reads safetensors only, {conversion_hint(folder, root)}")


def _hub_snapshot(repo_id: str) -> Path:
    """The cached snapshot folder of hub model ``repo_id`` (offline), else one-line refusals."""
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    except ImportError:
        raise CheckpointError(f"{repo_id}: no such folder; reading it as a Hugging Face hub id "
                              "needs huggingface_hub (pip install huggingface_hub)") from None
    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except HFValidationError:
        raise CheckpointError(f"{repo_id}: no such folder, and not a Hugging Face hub id "
                              "(org/name)") from None
    except LocalEntryNotFoundError:
        raise CheckpointError(
            f"{repo_id}: no such folder, and not in the local Hugging Face cache "
            f"({constants.HF_HUB_CACHE}; drifttool never downloads): download it first "
            f"(hf download {repo_id}) or pass the model folder") from None


def resolve_checkpoint(checkpoint: str | Path) -> Path:
    """The model folder ``checkpoint`` names (module docstring): an existing directory as given,
    else the local cache's snapshot of the hub id; its transformer checked for pickle-only
    weights.

    Raises:
        CheckpointError: a file, not a directory; a hub id that is invalid, not cached or needs
            huggingface_hub; a folder with pickle weights only; a folder that is neither a
            transformer nor a pipeline folder (``transformer_folder``).
    """
    path = Path(checkpoint)
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{path}: a file, not a model folder (a diffusers transformer or "
                              "pipeline folder, or a Hugging Face hub id)")
    if not path.is_dir():
        text = str(checkpoint)
        if text.startswith((".", "/", "~")) or text.count("/") > 1 or "\\" in text:
            raise CheckpointError(f"{text}: no such folder")  # a path, never a hub id
        path = _hub_snapshot(text)
    refuse_pickle_only(path)
    return path
