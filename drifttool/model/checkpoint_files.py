"""The files of a diffusers-format checkpoint folder: which ones, their headers, their tensors.

    >>> folder = transformer_folder("Qwen-Image")            # a pipeline folder → its transformer/
    >>> files = weight_files(folder)                          # single file, or the shards of the index
    >>> read_shapes(files)["img_in.weight"]                   # from the headers alone
    (3072, 64)
    >>> locate_tensors(files)["img_in.weight"]               # where its bytes lie
    StoredTensor(file=…, offset=…, dtype=torch.bfloat16, shape=(3072, 64))

A transformer folder holds ``config.json`` (diffusers ``QwenImageTransformer2DModel`` config) and
either ``diffusion_pytorch_model.safetensors`` or ``diffusion_pytorch_model.safetensors.index.json``
plus the shards it names (with a weight variant: ``diffusion_pytorch_model.fp16.safetensors``, as
``save_pretrained(variant=)`` writes). A pipeline folder (``model_index.json`` + ``transformer/``)
loads from its root. Only safetensors is read — never pickle (``.bin`` / ``.pt``) — and JSON files
past any plausible checkpoint size are refused before they are parsed. Every failure is one
``CheckpointError`` line naming the file. What the tensors mean (names, shapes, the model) is
``drifttool.model.checkpoint``'s.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch

from drifttool.errors import CheckpointError, UnsupportedConfigError

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
PIPELINE_INDEX_NAME = "model_index.json"
TRANSFORMER_SUBFOLDER = "transformer"

# A transformer's config.json is < 1 KiB and the full model's index ~ 150 KiB: anything past this
# is not a checkpoint file, and is refused before it is parsed.
_MAX_JSON_BYTES = 16 * 2**20

_VARIANT = r"[A-Za-z0-9_\-]+"
# diffusers' variant weight files: single, shard and index (``_add_variant``).
_VARIANT_FILE = re.compile(
    rf"diffusion_pytorch_model(?:\.safetensors\.index)?\.({_VARIANT}?)(?:-\d+-of-\d+)?\.(?:safetensors|json)"
)

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
"""Weight files drifttool never reads (pickle): ``torch.load`` runs code."""


def conversion_hint(folder: Path, root: Path) -> str:
    """The diffusers call that rewrites ``root`` (a transformer or pipeline folder whose
    transformer is ``folder``) with safetensors weights, in a sibling ``<root>-safetensors``
    (``save_pretrained`` writes safetensors by default)."""
    pipeline = folder != root and (root / PIPELINE_INDEX_NAME).is_file()
    cls = "DiffusionPipeline" if pipeline else "QwenImageTransformer2DModel"
    out = root.parent / f"{root.name}-safetensors"
    return (f"convert it once to safetensors: python -c \"from diffusers import {cls}; "
            f"{cls}.from_pretrained('{root}').save_pretrained('{out}')\" and pass {out}")


def check_variant(variant: str | None) -> None:
    """Refuse a weight variant that is not a plain name (``fp16``, ``ema``): it becomes part of
    a file name.

    Raises:
        UnsupportedConfigError: anything but None or a plain name.
    """
    if variant is not None and (not isinstance(variant, str) or not re.fullmatch(_VARIANT, variant)):
        raise UnsupportedConfigError(f"weight variant {variant!r} must be a plain name such as 'fp16'")


def _read_json(path: Path) -> Any:
    """Parse a small JSON file. Raises ``CheckpointError`` (one line) when it is missing, too
    large, not UTF-8, not JSON, nested too deep, or holds an integer too long to convert."""
    try:
        size = path.stat().st_size
        if size > _MAX_JSON_BYTES:
            raise CheckpointError(f"{path}: {size} bytes, larger than any checkpoint JSON ({_MAX_JSON_BYTES})")
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (OSError, ValueError, RecursionError) as e:  # ValueError: JSONDecodeError, UTF-8, digits
        raise CheckpointError(f"{path}: unreadable JSON ({type(e).__name__}: {str(e)[:200]})") from None


def read_json_object(path: Path) -> dict[str, Any]:
    """A small JSON file holding an object (``config.json``, an index).

    Raises:
        CheckpointError: as ``_read_json``, or JSON that is not an object.
    """
    obj = _read_json(path)
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: must hold a JSON object, got {type(obj).__name__}")
    return obj


def _variant_name(name: str, variant: str | None) -> str:
    """diffusers' ``_add_variant``: ``a.b.safetensors`` → ``a.b.<variant>.safetensors``."""
    if variant is None:
        return name
    head, _, ext = name.rpartition(".")
    return f"{head}.{variant}.{ext}"


def component_folder(path: str | Path, subfolder: str, cls: str, what: str) -> Path:
    """The folder holding one model's ``config.json``: ``path`` itself, or, for a pipeline folder
    (``model_index.json`` naming a ``cls`` component ``subfolder``, as
    ``DiffusionPipeline.save_pretrained`` writes), its ``subfolder/``. ``what`` names the model in
    messages ("transformer", "VAE").

    Raises:
        CheckpointError: not a directory; neither kind of folder; a pipeline whose ``subfolder``
            component is missing or of another class.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a directory")
    if (folder / CONFIG_NAME).is_file():
        return folder
    index = folder / PIPELINE_INDEX_NAME
    if not index.is_file():
        raise CheckpointError(f"{folder}: no {CONFIG_NAME} (a {what} folder) and no "
                              f"{PIPELINE_INDEX_NAME} (a pipeline folder)")
    component = read_json_object(index).get(subfolder)
    if not (isinstance(component, list) and component[-1:] == [cls]):
        raise CheckpointError(f"{index}: component {subfolder!r} is {component!r}, not a {cls}")
    sub = folder / subfolder
    if not (sub / CONFIG_NAME).is_file():
        raise CheckpointError(f"{sub}: missing {CONFIG_NAME} of the pipeline's {what}")
    return sub


def transformer_folder(path: str | Path) -> Path:
    """The folder holding the transformer's ``config.json``: ``path`` itself, or a pipeline
    folder's ``transformer/`` (``component_folder``).

    Raises:
        CheckpointError: as ``component_folder``.
    """
    return component_folder(path, TRANSFORMER_SUBFOLDER, "QwenImageTransformer2DModel", "transformer")


def weight_files(folder: Path, variant: str | None = None) -> list[Path]:
    """The safetensors files of a folder (single file, or the shards an index names), with
    diffusers' ``variant`` file names when given (``diffusion_pytorch_model.fp16.safetensors``,
    ``diffusion_pytorch_model.safetensors.index.fp16.json``)."""
    single = folder / _variant_name(WEIGHTS_NAME, variant)
    index = folder / _variant_name(WEIGHTS_INDEX_NAME, variant)
    if single.is_file():
        return [single]
    if index.is_file():
        wm = read_json_object(index).get("weight_map")
        if not isinstance(wm, dict) or not wm or not all(isinstance(v, str) for v in wm.values()):
            raise CheckpointError(f"{index}: no 'weight_map' of tensor name → shard file name")
        shards = sorted(set(wm.values()))
        outside = [s for s in shards if Path(s).name != s or s in (".", "..")]
        if outside:
            raise CheckpointError(f"{index}: shard names must be file names in {folder}, got {outside[:5]}")
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise CheckpointError(f"{index}: shard file(s) missing: {missing}")
        return [folder / s for s in shards]
    names = sorted(p.name for p in folder.iterdir())
    pickles = [n for n in names if Path(n).suffix in PICKLE_SUFFIXES]
    variants = sorted({m.group(1) for n in names if (m := _VARIANT_FILE.fullmatch(n))})
    hint = ""
    if variants:
        hint = f" (found weight variant(s) {variants}: pass variant=/--variant)"
    elif pickles:
        hint = (f" (found {pickles}: pickle weights are never loaded; "
                f"{conversion_hint(folder, folder)})")
    raise CheckpointError(f"{folder}: neither {single.name} nor {index.name}{hint}")


def index_warnings(path: str | Path, variant: str | None = None) -> list[str]:
    """What a sharded checkpoint's index claims that its shards do not hold (diffusers warns of
    the same when it loads): one line per shard whose tensors the index lists but the shard
    lacks, ``[]`` for a single-file checkpoint or a true index. Reads the index and the
    safetensors headers only.

    Raises:
        CheckpointError: as ``load_checkpoint`` for files it cannot read.
    """
    folder = transformer_folder(path)
    index = folder / _variant_name(WEIGHTS_INDEX_NAME, variant)
    files = weight_files(folder, variant)
    if len(files) == 1 and files[0].name == _variant_name(WEIGHTS_NAME, variant):
        return []
    from safetensors import safe_open

    held: dict[str, set[str]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                held[f.name] = set(sf.keys())
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise _safetensors_error(f, e) from None
    lacking: dict[str, list[str]] = {}
    for name, shard in read_json_object(index)["weight_map"].items():
        if name not in held.get(shard, set()):
            lacking.setdefault(shard, []).append(name)
    return [f"{index.name} lists {len(names)} tensor(s) that {shard} does not hold: "
            f"{', '.join(sorted(names)[:8])}{', …' if len(names) > 8 else ''} (the shards' own "
            "headers decide what loads; diffusers warns of the same)"
            for shard, names in sorted(lacking.items())]


def _safetensors_error(f: Path, e: Exception) -> CheckpointError:
    return CheckpointError(f"{f}: unreadable safetensors file ({type(e).__name__}: {str(e)[:200]})")


def read_shapes(files: Iterable[Path]) -> dict[str, tuple[int, ...]]:
    """Tensor name → shape from the safetensors headers alone (no tensor data is read).

    Raises:
        CheckpointError: an unreadable or corrupt file; a tensor stored in more than one file.
    """
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    dupes = []
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                for k in sf.keys():
                    if k in shapes:
                        dupes.append(f"{k} ({f.name})")
                    shapes[k] = tuple(sf.get_slice(k).get_shape())
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise _safetensors_error(f, e) from None
    if dupes:
        raise CheckpointError(f"tensor(s) stored in more than one shard: {dupes}")
    return shapes


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                       "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
                       "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
"""safetensors header dtype names → torch dtypes (the ones a checkpoint may plausibly hold)."""


def read_dtypes(files: Iterable[Path]) -> dict[str, str]:
    """Tensor name → safetensors dtype name (``"BF16"``, ``"F32"``, …) from the headers alone.

    Raises:
        CheckpointError: an unreadable or corrupt file.
    """
    from safetensors import safe_open

    out: dict[str, str] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                out.update({k: str(sf.get_slice(k).get_dtype()) for k in sf.keys()})
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise _safetensors_error(f, e) from None
    return out


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes lie: ``file``, the absolute byte ``offset`` of its first byte,
    its stored ``dtype`` and ``shape`` (row-major, ``nbytes`` long)."""

    file: Path
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


_MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit on the JSON header


def _header(f: Path) -> tuple[dict[str, Any], int, int]:
    """(the JSON header, the data area's offset, its size) of one safetensors file."""
    with open(f, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        if not 2 <= n <= _MAX_HEADER_BYTES:
            raise ValueError(f"header length {n}")
        header = json.loads(fh.read(n))
        size = os.fstat(fh.fileno()).st_size
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    return header, 8 + n, size - 8 - n


def _stored_tensor(f: Path, name: str, entry: Any, start: int, size: int) -> StoredTensor:
    if not isinstance(entry, dict) or entry.get("dtype") not in SAFETENSORS_DTYPES:
        raise ValueError(f"{name}: no known dtype")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise ValueError(f"{name}: shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise ValueError(f"{name}: data_offsets {offsets!r}")
    t = StoredTensor(f, start + offsets[0], SAFETENSORS_DTYPES[entry["dtype"]], tuple(shape))
    if not 0 <= offsets[0] <= offsets[1] <= size or offsets[1] - offsets[0] != t.nbytes:
        raise ValueError(f"{name}: data_offsets {offsets} do not hold {t.nbytes} bytes within {size}")
    return t


def locate_tensors(files: Iterable[Path]) -> dict[str, StoredTensor]:
    """Tensor name → where its bytes lie (``StoredTensor``), from the safetensors headers alone;
    every tensor's byte range is checked to lie within its file and to match its dtype and shape.

    Raises:
        CheckpointError: an unreadable or corrupt file; a tensor stored in more than one file.
    """
    out: dict[str, StoredTensor] = {}
    for f in files:
        try:
            header, start, size = _header(f)
            located = {k: _stored_tensor(f, k, v, start, size) for k, v in header.items()
                       if k != "__metadata__"}
        except (OSError, ValueError, RecursionError) as e:
            raise _safetensors_error(f, e) from None
        dupes = sorted(located.keys() & out.keys())
        if dupes:
            raise CheckpointError(f"tensor(s) stored in more than one shard: {dupes[:8]}")
        out.update(located)
    return out
