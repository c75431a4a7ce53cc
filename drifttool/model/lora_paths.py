"""Where a LoRA adapter lies on disk: the file names of its layouts and the check of a path given
as ``--lora`` (``run``, ``replay``, ``recompute``, ``experiment train-rollout``), torch-free.

    >>> adapter_location("adapter/")                       # PosixPath('adapter')
    >>> adapter_location("adapter/adapter_config.json")
    CheckpointError: LoRA adapter adapter/adapter_config.json: the config file of a peft adapter,
    not the adapter: pass its folder adapter; --lora takes a peft adapter folder (with
    adapter_config.json and adapter_model.safetensors) or a .safetensors file

An adapter is a folder holding peft's pair (``PEFT_CONFIG`` + ``PEFT_WEIGHTS``, as
``PeftModel.save_pretrained`` writes it) and/or diffusers' ``DIFFUSERS_WEIGHTS``
(``save_lora_weights``), or one ``.safetensors`` file (diffusers' or kohya's layouts; a peft
``PEFT_WEIGHTS`` next to its ``PEFT_CONFIG`` stands for its folder). ``lora_formats.read_adapter``
reads what ``adapter_location`` returns; the CLI's ``--lora`` options check the path as typed
(``cli._paths.adapter``) before any model loads, with the same words.
"""

from __future__ import annotations

from pathlib import Path

from drifttool.errors import CheckpointError

PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"
DIFFUSERS_WEIGHTS = "pytorch_lora_weights.safetensors"

TAKES = (f"--lora takes a peft adapter folder (with {PEFT_CONFIG} and {PEFT_WEIGHTS}) "
         "or a .safetensors file")
"""What an adapter path may name, in the words every refusal ends with."""


def _holds_adapter(folder: Path) -> bool:
    """Whether ``folder`` holds peft's pair or diffusers' file."""
    peft = (folder / PEFT_CONFIG).is_file() and (folder / PEFT_WEIGHTS).is_file()
    return peft or (folder / DIFFUSERS_WEIGHTS).is_file()


def _problem(p: Path) -> str:
    """Why ``p`` names no adapter (``adapter_location`` found none there)."""
    if not p.exists():
        return "no such file or folder"
    if p.is_dir():
        if (p / PEFT_CONFIG).is_file():
            return f"a folder with {PEFT_CONFIG} but no {PEFT_WEIGHTS}"
        return f"a folder without adapter files (neither peft's pair nor diffusers' {DIFFUSERS_WEIGHTS})"
    if p.name == PEFT_CONFIG:
        return f"the config file of a peft adapter, not the adapter: pass its folder {p.parent}"
    if _holds_adapter(p.parent):
        return f"not a .safetensors file: pass the adapter folder it lies in, {p.parent}"
    return "not a .safetensors file"


def adapter_location(path: str | Path) -> Path:
    """The folder or ``.safetensors`` file to read the adapter at ``path`` from: ``path``
    itself, or the folder of a peft ``PEFT_WEIGHTS`` that has its ``PEFT_CONFIG`` beside it.
    Reads no file (whether a ``.safetensors`` file parses is ``read_adapter``'s to say).

    Raises:
        CheckpointError: one line naming ``path`` as given and why it names no adapter (missing;
            a folder without adapter files; a file that is no ``.safetensors``, a peft
            ``PEFT_CONFIG`` naming its folder instead), ending with ``TAKES``.
    """
    p = Path(path)
    if p.is_file() and p.name == PEFT_WEIGHTS and (p.parent / PEFT_CONFIG).is_file():
        return p.parent
    if (p.is_file() and p.suffix == ".safetensors") or (p.is_dir() and _holds_adapter(p)):
        return p
    raise CheckpointError(f"LoRA adapter {path}: {_problem(p)}; {TAKES}")
