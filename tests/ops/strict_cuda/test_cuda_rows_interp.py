"""The strict CUDA row and sampler operators (``drifttool/ops/strict_cuda/rows.py``, ``sampler.py``)
under Triton's interpreter on CPU tensors, FP32.

These kernels do the strict CPU family's arithmetic in its order (pairwise trees, FP64 rstd and
square roots, no FMA), so the interpreter's bytes must equal the CPU family's byte for byte; the
GPU suite (tests/gpu/test_strict_cuda_rows.py) checks the same on the H200. Also here: accuracy
against the FP64 references, and raw-byte invariance to batch size, position and launch geometry.
The GEMM of txt_in_rmsnorm_linear / final_adaln_out is stood in for by the CPU's ``tiled_linear``
(the GEMM kernel is another module's), so the rest of those operators is checked exactly.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from references import ops as ref
from tests.conftest import assert_same_bytes

from drifttool.ops import scheduler
from drifttool.ops.strict import adaln, attention, embed, latent
from drifttool.ops.strict_cuda import rows as R
from drifttool.ops.strict_cuda import sampler as SM
from drifttool.ops.strict_cuda.kernels import norms as K
from drifttool.ops.strict_cuda.kernels import sampler as KS
from drifttool.ops.strict_gemm import tiled_linear
from drifttool.ops.strict_math import tree_sum


def _g(seed: int, *shape, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen) * scale + shift


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float = 2e-6, atol: float = 2e-6) -> None:
    torch.testing.assert_close(got.double(), want.double(), rtol=rtol, atol=atol)


@pytest.fixture
def cpu_gemm(monkeypatch):
    """The strict CPU GEMM in place of the CUDA GEMM kernel, whose K order differs by design."""
    def linear(x, w, b, *, out_dtype):
        return tiled_linear(x.float(), w.float(), None if b is None else b.float()).to(out_dtype)

    monkeypatch.setattr(R, "_gemm", lambda: SimpleNamespace(linear=linear))


# ----------------------------------------------------------------------------- equal to the CPU


def test_latent_ops_equal_cpu_bytes():
    z = _g(0, 3, 16, 1, 6, 10)
    packed = R.latent_pack_unpack(z)
    assert_same_bytes(packed, latent.latent_pack_unpack(z), "pack")
    assert_same_bytes(R.latent_pack_unpack(packed, "unpack", (3, 5)), z, "unpack inverts pack")
    mean, std = _g(1, 16), _g(2, 16).abs() + 0.3
    for inverse in (False, True):
        got = R.latent_normalize(z, mean, std, inverse)
        assert_same_bytes(got, latent.latent_normalize(z, mean, std, inverse), f"normalize inverse={inverse}")
        _close(got, ref.latent_normalize(z, mean, std, inverse))


def test_elementwise_ops_equal_cpu_bytes():
    x, gate, y = _g(3, 3, 7, 96), _g(4, 3, 96), _g(5, 3, 7, 96)
    got = R.adaln_gate_residual(x, gate, y)
    assert_same_bytes(got, adaln.adaln_gate_residual(x, gate, y), "gate residual")
    _close(got, ref.adaln_gate_residual(x, gate, y))
    q = _g(6, 2, 7, 3, 16)
    freqs = torch.polar(_g(7, 7, 8).abs() + 0.5, _g(8, 7, 8) * 3).to(torch.complex64)
    got = R.multi_axis_rope(q, freqs)
    assert_same_bytes(got, attention.multi_axis_rope(q, freqs), "rope")
    _close(got, ref.multi_axis_rope(q, freqs), rtol=1e-5, atol=1e-5)


def test_norms_equal_cpu_bytes():
    x, gain = _g(10, 2, 5, 3, 16, scale=3.0), _g(11, 16)
    got = R.qk_rmsnorm(x, gain)
    assert_same_bytes(got, attention.qk_rmsnorm(x, gain), "qk_rmsnorm")
    _close(got, ref.qk_rmsnorm(x, gain), rtol=1e-5, atol=1e-5)
    x, shift, scale = _g(12, 3, 7, 96, scale=2.0, shift=1.0), _g(13, 3, 96), _g(14, 3, 96)
    got = R.adaln_modulation(x, shift, scale)
    assert_same_bytes(got, adaln.adaln_modulation(x, shift, scale), "adaln_modulation")
    _close(got, ref.adaln_modulation(x, shift, scale), rtol=1e-5, atol=1e-5)


def _ln_cases(seed: int, b: int, s: int, d: int):
    return _g(seed, b, s, d, scale=3.0, shift=1.0), _g(seed + 1, b, d), _g(seed + 2, b, d), _g(seed + 3, d)


def _long_ln(x, shift, scale, **kw):
    return K.ln_modulation(x, shift, scale, 1e-6, torch.float32, **kw)


def _long_rms(x, gain, **kw):
    return K.rms_norm(x, gain, 1e-6, torch.float32, **kw)


@pytest.mark.parametrize("d", [3072, 3584, 3000, K.SHORT_ROW + 77])
def test_long_rows_equal_the_whole_row_kernel_and_cpu_bytes(d):
    """Rows longer than SHORT_ROW take the tile kernel (stride-8 octets, the tree over a tile's
    octet sums, then over the tiles): the same additions as the CPU's tree and as the kernel that
    holds the whole row in registers."""
    x, shift, scale, gain = _ln_cases(40, 1, 7, d)
    got = _long_ln(x, shift, scale)
    assert_same_bytes(got, adaln.adaln_modulation(x, shift, scale), f"LayerNorm d={d} vs CPU")
    assert_same_bytes(got, _long_ln(x, shift, scale, in_register=True), f"LayerNorm d={d} vs whole-row kernel")
    want = embed.rms_parts(x, 1e-6)[0] * gain
    assert_same_bytes(_long_rms(x, gain), want, f"RMSNorm d={d} vs CPU")
    assert_same_bytes(_long_rms(x, gain, in_register=True), want, f"RMSNorm d={d} whole-row kernel vs CPU")
    one = _long_ln(x[:, 3:4], shift, scale)
    assert_same_bytes(one[0, 0], got[0, 3], "one row alone vs row 3 of 7")


def test_long_rows_with_special_values_equal_cpu_bytes():
    """NaN, ±inf and ±0 rows (whole and in part) beside ordinary rows, d = 3000 (a padded tail)."""
    d = 3000
    x, shift, scale, gain = _ln_cases(44, 2, 6, d)
    x[0, 0] = float("nan")
    x[0, 1, 17] = float("inf")
    x[0, 2, 2999] = float("-inf")
    x[0, 3] = 0.0
    x[0, 4] = -0.0
    x[1, 0, ::7] = -0.0
    x[1, 1, 1000] = float("nan")
    x[1, 2, :8] = float("inf")
    x[1, 2, 8:16] = float("-inf")
    scale[1, 5] = float("inf")
    got = _long_ln(x, shift, scale)
    assert_same_bytes(got, adaln.adaln_modulation(x, shift, scale), "LayerNorm special values vs CPU")
    assert_same_bytes(got, _long_ln(x, shift, scale, in_register=True), "LayerNorm special values vs whole row")
    assert_same_bytes(_long_rms(x, gain), embed.rms_parts(x, 1e-6)[0] * gain, "RMSNorm special values vs CPU")


@pytest.mark.slow  # about 18 s in the interpreter
def test_long_rows_invariant_to_tile_warps_and_rows_per_program():
    """The launch configuration (tile, warps, rows per program — also rows that do not divide the
    row count) changes no byte; neither does a row's position among the rows."""
    d = 3000
    x, shift, scale, gain = _ln_cases(48, 2, 7, d)
    base = _long_ln(x, shift, scale)
    rbase = _long_rms(x, gain)
    assert_same_bytes(_long_ln(x[1:, 6:], shift[1:], scale[1:])[0, 0], base[1, 6], "1 row vs the last of 14")
    for cfg in (K.LongRows(9, 1, 1), K.LongRows(11, 8, 3), K.LongRows(12, 2, 8), K.LongRows(13, 4, 2)):
        assert_same_bytes(_long_ln(x, shift, scale, long_rows=cfg), base, f"LayerNorm {cfg}")
        assert_same_bytes(_long_rms(x, gain, long_rows=cfg), rbase, f"RMSNorm {cfg}")
    assert_same_bytes(_long_ln(x, shift, scale, rows_per_program=5), base, "rows_per_program=5")
    with pytest.raises(ValueError, match="at least 16"):
        _long_ln(x, shift, scale, long_rows=K.LongRows(3, 4, 1))


@pytest.mark.slow
def test_long_rows_on_130_rows_equal_cpu_bytes():
    """130 rows (two samples of 65), d = 3072: the registered configuration and 13 rows per program."""
    x, shift, scale, gain = _ln_cases(52, 2, 65, 3072)
    got = _long_ln(x, shift, scale)
    assert_same_bytes(got, adaln.adaln_modulation(x, shift, scale), "LayerNorm 130 rows vs CPU")
    assert_same_bytes(_long_ln(x, shift, scale, long_rows=K.LongRows(12, 4, 13)), got, "13 rows per program")
    assert_same_bytes(_long_rms(x, gain), embed.rms_parts(x, 1e-6)[0] * gain, "RMSNorm 130 rows vs CPU")


def test_gemm_bearing_ops_equal_cpu_bytes_around_the_gemm(cpu_gemm):
    e, gain, w, b = _g(15, 2, 5, 100, scale=3.0), _g(16, 100), _g(17, 24, 100, scale=0.1), _g(18, 24)
    assert_same_bytes(R.txt_in_rmsnorm_linear(e, gain, w, b), embed.txt_in_rmsnorm_linear(e, gain, w, b), "txt_in")
    x, temb, w, b = _g(19, 3, 7, 48), _g(20, 3, 48), _g(21, 96, 48, scale=0.1), _g(22, 96)
    got = R.final_adaln_out(x, temb, w, b)
    assert_same_bytes(got, adaln.final_adaln_out(x, temb, w, b), "final_adaln_out (scale first)")
    _close(got, ref.final_adaln_out(x, temb, w, b), rtol=1e-5, atol=1e-5)


def test_gemm_bearing_ops_with_the_cuda_gemm_match_fp64():
    e, gain, w, b = _g(15, 2, 5, 64, scale=3.0), _g(16, 64), _g(17, 32, 64, scale=0.1), _g(18, 32)
    _close(R.txt_in_rmsnorm_linear(e, gain, w, b), ref.txt_in_rmsnorm_linear(e, gain, w, b), rtol=1e-5, atol=1e-5)
    x, temb, w, b = _g(19, 3, 7, 32), _g(20, 3, 32), _g(21, 64, 32, scale=0.1), _g(22, 64)
    _close(R.final_adaln_out(x, temb, w, b), ref.final_adaln_out(x, temb, w, b), rtol=1e-5, atol=1e-5)


def test_cfg_combine_renorm_equals_cpu_bytes():
    c, u = _g(23, 2, 9, 64), _g(24, 2, 9, 64)
    got = SM.cfg_combine_renorm(c, u, 4.0)
    assert_same_bytes(got, scheduler.cfg_combine_renorm_strict(c, u, 4.0), "cfg")
    _close(got, ref.cfg_combine_renorm(c, u, 4.0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(3, 5, 7), (2, 300, 7)], ids=["under-one-chunk", "three-chunks"])
def test_sde_step_equals_cpu_bytes(shape):
    v, x, noise = _g(25, *shape), _g(26, *shape), _g(27, *shape)
    sig = scheduler.flow_sigma_table(6, 64)
    kw = dict(eta=1.2, sigma_max=sig[1])
    for sigma in (sig[0], sig[2]):  # sigma == 1 takes sigma_max
        got = SM.flow_sde_step_logp(v, x, sigma, sig[3], noise=noise, **kw)
        want = scheduler.flow_sde_step_logp_strict(v, x, sigma, sig[3], noise=noise, **kw)
        for name, a, b in zip(("x_next", "logp", "mu", "std_t"), got, want):
            assert_same_bytes(a, b, f"sample {name}")
        replay = SM.flow_sde_step_logp(v, x, float(sigma), float(sig[3]), prev_sample=got[0], **kw)
        assert_same_bytes(replay[1], got[1], "replay logp")
    euler = SM.flow_sde_step_logp(v, x, sig[2], sig[3], eta=0.0, sigma_max=sig[1])
    want = scheduler.flow_sde_step_logp_strict(v, x, sig[2], sig[3], eta=0.0, sigma_max=sig[1])
    for name, a, b in zip(("x_next", "logp", "mu", "std_t"), euler, want):
        assert_same_bytes(a, b, f"euler {name}")


def test_tree_rows_is_the_pairwise_tree():
    for n in (1, 3, 1024, 1025, 5000):
        x = _g(28, 2, n)
        assert_same_bytes(KS.tree_rows(x), tree_sum(x), f"n={n}")


# ----------------------------------------------------------------------------- invariance


def test_rows_invariant_to_batch_position_and_geometry():
    x, shift, scale = _g(29, 3, 5, 96), _g(30, 3, 96), _g(31, 3, 96)
    full = K.ln_modulation(x, shift, scale, 1e-6, torch.float32)
    one = K.ln_modulation(x[1:2], shift[1:2], scale[1:2], 1e-6, torch.float32)
    assert_same_bytes(one[0], full[1], "batch 1 vs row 1 of 3")
    for per in (1, 2, 8):
        assert_same_bytes(K.ln_modulation(x, shift, scale, 1e-6, torch.float32, rows_per_program=per), full,
                          f"{per} rows per program")
    q, gain = _g(32, 3, 5, 3, 16), _g(33, 16)
    base = K.rms_norm(q, gain, 1e-6, torch.float32)
    assert_same_bytes(K.rms_norm(q[2:], gain, 1e-6, torch.float32)[0], base[2], "rms batch position")
    assert_same_bytes(K.rms_norm(q, gain, 1e-6, torch.float32, rows_per_program=4), base, "rms geometry")
    c, u = _g(34, 3, 5, 64), _g(35, 3, 5, 64)
    base = KS.cfg_combine_renorm(c, u, 3.0)
    assert_same_bytes(KS.cfg_combine_renorm(c[:1, 2:], u[:1, 2:], 3.0), base[:1, 2:], "cfg token subset")
    assert_same_bytes(KS.cfg_combine_renorm(c, u, 3.0, rows_per_program=2), base, "cfg geometry")


def test_sde_logp_invariant_to_batch():
    v, x, noise = _g(36, 3, 40, 16), _g(37, 3, 40, 16), _g(38, 3, 40, 16)
    sig = scheduler.flow_sigma_table(6, 64)
    full = SM.flow_sde_step_logp(v, x, sig[1], sig[2], eta=1.0, sigma_max=sig[1], noise=noise)
    one = SM.flow_sde_step_logp(v[2:], x[2:], sig[1], sig[2], eta=1.0, sigma_max=sig[1], noise=noise[2:])
    for a, b in zip(one, full):
        assert_same_bytes(a[0], b[2], "sample 2 alone vs in a batch of 3")


def test_fail_closed_in_one_line():
    from drifttool.errors import UnsupportedConfigError

    with pytest.raises(UnsupportedConfigError, match="even H'"):
        R.latent_pack_unpack(torch.zeros(1, 16, 3, 4))
    with pytest.raises(UnsupportedConfigError, match="complex table"):
        R.multi_axis_rope(torch.zeros(1, 2, 1, 4), torch.zeros(2, 2))
    with pytest.raises(UnsupportedConfigError, match="2\\^24|sigma"):
        SM.flow_sde_step_logp(torch.zeros(1, 2), torch.zeros(1, 2), 0.5, 0.6, eta=1.0, sigma_max=0.9,
                              noise=torch.zeros(1, 2))
