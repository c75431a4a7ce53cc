"""``drifttool.artifact.raw`` reads safetensors without torch and digests to the same identity as
``drifttool.capture.digest.digest`` (dtype, shape, bytes), for every dtype the artifacts use and
for per-sample slices (what ``drifttool.diff.context`` compares)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from drifttool.artifact.raw import read_raw
from drifttool.capture.digest import digest, dtype_name
from drifttool.errors import ArtifactError

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2]


def _tensor(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 5, generator=g) * 7
    x[0, 0, 0] = -0.0
    return x > 0 if dtype == torch.bool else x.to(dtype)


def test_raw_digest_and_bytes_match_torch(tmp_path):
    tensors = {dtype_name(d): _tensor(d) for d in DTYPES}
    save_file(tensors, tmp_path / "t.safetensors")
    raw = read_raw(tmp_path / "t.safetensors")
    assert sorted(raw) == sorted(tensors)
    for name, t in tensors.items():
        r = raw[name]
        assert r.dtype == name and r.array.shape == tuple(t.shape)
        assert r.array.tobytes() == t.contiguous().view(torch.uint8).numpy().tobytes(), name
        assert r.digest() == digest(t), name
        for axis in range(3):  # a per-sample slice, as diff.context takes it
            sliced = r.__class__(r.dtype, np.take(r.array, 1, axis=axis)[:2])
            assert sliced.digest() == digest(t.select(axis, 1)[:2].contiguous()), (name, axis)


def test_a_changed_byte_or_dtype_changes_the_digest(tmp_path):
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    b = a.clone()
    b[1, 2] = torch.nextafter(b[1, 2], torch.tensor(100.0))
    save_file({"a": a, "b": b, "i": a.view(torch.int32).clone()}, tmp_path / "t.safetensors")
    raw = read_raw(tmp_path / "t.safetensors")
    assert len({raw["a"].digest(), raw["b"].digest(), raw["i"].digest()}) == 3


def test_corrupt_file_is_an_artifact_error(tmp_path):
    p = tmp_path / "bad.safetensors"
    save_file({"x": torch.zeros(4)}, p)
    p.write_bytes(p.read_bytes()[:-3])
    with pytest.raises(ArtifactError, match="corrupt safetensors"):
        read_raw(p)


def test_raw_nonfinite_counts_match_torch(tmp_path):
    """NaN/±inf counted on the bits for bf16 and fp8 (no numpy type), as torch counts them."""
    tensors = {}
    for d in DTYPES:
        t = _tensor(d)
        if t.is_floating_point():
            t = t.float()
            t[0, 1, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
            t = t.to(d)
        tensors[dtype_name(d)] = t
    save_file(tensors, tmp_path / "t.safetensors")
    raw = read_raw(tmp_path / "t.safetensors")
    for name, t in tensors.items():
        want = int((~torch.isfinite(t.float())).sum()) if t.is_floating_point() else 0
        assert raw[name].nonfinite() == want, name
        assert want in (0, 3) or name == "float8_e4m3fn"  # e4m3fn has no inf: ±inf become NaN
