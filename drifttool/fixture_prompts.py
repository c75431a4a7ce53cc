"""A trajectory fixture's prompt embeddings (``prompts.safetensors``), read and checked without torch.

    >>> arrays = read_prompts(fx.path / "prompts.safetensors")   # numpy, checked; FixtureError
    >>> arrays["txt"].shape, arrays["txt_len"]                     # (P, L, D) float, (P,) integers

``Fixture.prompts`` runs from these arrays, and ``verify.check_reseal`` reads them to tell whether
``fixture seal --rebuild`` would accept the file, as fast as ``fixture verify`` checks the seal:
nothing here imports torch. safetensors' numpy reader has no bfloat16, so a BF16 tensor's words are
read from the file where its header places them and widened to float32 (exact: a bfloat16 is the
top half of a float32's bits).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from drifttool.errors import FixtureError

PROMPT_TENSORS = {"txt": 3, "txt_len": 1, "neg_txt": 3, "neg_len": 0}
"""Tensor name → dimensions: prompt embeddings ``[P, L, D]`` (float), their valid lengths ``[P]``
(integer), the negative prompt's ``[1, Ln, D]`` and its length."""

FLOATS = ("F64", "F32", "F16", "BF16")
"""The float types of the embeddings (safetensors' names)."""

INTEGERS = ("I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8")
"""The integer types of the lengths (safetensors' names)."""


def read_prompts(source: Path) -> dict[str, np.ndarray]:
    """``source``'s tensors as numpy arrays (the embeddings float16, float32 or float64, the
    lengths integers), checked: exactly ``PROMPT_TENSORS``, each of its number of dimensions, the
    embeddings float and finite, the lengths integers; at least one prompt, one length per prompt,
    one negative prompt, each length from 0 to its embeddings' slots.

    Raises:
        FixtureError: naming ``source``: unreadable (not a safetensors file), or what is missing
            or malformed.
    """
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(source), framework="numpy") as f:
            slices = {name: f.get_slice(name) for name in f.keys()}
            dtypes = {name: sl.get_dtype() for name, sl in slices.items()}
            shapes = {name: tuple(sl.get_shape()) for name, sl in slices.items()}
            _check_names(source, dtypes)
            _check_types(source, dtypes, shapes)
            arrays = {name: _bf16(source, name) if dtypes[name] == "BF16" else f.get_tensor(name)
                      for name in dtypes}
    except (SafetensorError, OSError, ValueError) as e:
        raise FixtureError(f"{source}: unreadable ({e})") from None
    _check_values(source, arrays)
    return arrays


def embedding_width(source: Path) -> int:
    """The width D of the prompt embeddings ``txt`` ``[P, L, D]`` in ``source`` (a file
    ``read_prompts`` accepted), from its header alone."""
    from safetensors import safe_open

    with safe_open(str(source), framework="numpy") as f:
        return int(f.get_slice("txt").get_shape()[-1])


def _check_names(source: Path, dtypes: dict[str, str]) -> None:
    missing, extra = sorted(set(PROMPT_TENSORS) - set(dtypes)), sorted(set(dtypes) - set(PROMPT_TENSORS))
    if missing or extra:
        what = "; ".join(x for x in (f"lacks {', '.join(missing)}" if missing else "",
                                     f"holds {', '.join(extra)}, which no fixture has" if extra else "") if x)
        raise FixtureError(f"{source}: {what} (a fixture's prompt embeddings are {', '.join(PROMPT_TENSORS)})")


def _check_types(source: Path, dtypes: dict[str, str], shapes: dict[str, tuple]) -> None:
    for name, dims in PROMPT_TENSORS.items():
        floating = name in ("txt", "neg_txt")
        if len(shapes[name]) != dims or dtypes[name] not in (FLOATS if floating else INTEGERS):
            kinds = "/".join(FLOATS if floating else INTEGERS)
            raise FixtureError(f"{source}: {name} is {dtypes[name]} {shapes[name]}, not a {dims}-D "
                               f"{'float' if floating else 'integer'} tensor ({kinds})")


def _bf16(source: Path, name: str) -> np.ndarray:
    """Tensor ``name`` (BF16) of the safetensors file ``source`` as float32, read at the offsets
    its header gives (the format: an 8-byte little-endian header size, the JSON header, the data)."""
    with open(source, "rb") as fh:
        (size,) = struct.unpack("<Q", fh.read(8))
        entry = json.loads(fh.read(size))[name]
        start, end = entry["data_offsets"]
        fh.seek(8 + size + start)
        words = np.frombuffer(fh.read(end - start), dtype="<u2")
    if words.size != int(np.prod(entry["shape"], dtype=np.int64)):
        raise ValueError(f"{name}: {words.size} words for shape {entry['shape']}")
    return (words.astype(np.uint32) << 16).view(np.float32).reshape(entry["shape"])


def _check_values(source: Path, t: dict[str, np.ndarray]) -> None:
    """The checks of ``read_prompts`` on the values (names, dimensions and types checked)."""
    for name in ("txt", "neg_txt"):
        if not np.isfinite(t[name]).all():
            raise FixtureError(f"{source}: {name} holds {int((~np.isfinite(t[name])).sum())} non-finite value(s)")
    txt, lens, neg, neg_len = t["txt"], t["txt_len"], t["neg_txt"], int(t["neg_len"])
    if neg.shape[2] != txt.shape[2]:
        raise FixtureError(f"{source}: neg_txt is {neg.shape[2]} wide and txt {txt.shape[2]}: one width")
    if txt.shape[0] == 0 or lens.shape[0] != txt.shape[0] or neg.shape[0] != 1:
        raise FixtureError(f"{source}: txt holds {txt.shape[0]} prompt(s), txt_len {lens.shape[0]} length(s) "
                           f"and neg_txt {neg.shape[0]} negative prompt(s): at least one prompt, a length "
                           "each, one negative prompt")
    bad = [int(n) for n in lens if not 0 <= int(n) <= txt.shape[1]]
    if bad or not 0 <= neg_len <= neg.shape[1]:
        raise FixtureError(f"{source}: lengths out of range (txt_len {lens.tolist()} of {txt.shape[1]} slots, "
                           f"neg_len {neg_len} of {neg.shape[1]}): each from 0 to its slots")
