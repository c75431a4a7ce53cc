"""Phase B runs past the machine, refused in one line (exit 2) before any work, as a newcomer met
them: an edit run whose --image-area needs more memory than there is (the condition image's VAE
encode, its tokens, the capture's digest key table), a strict run at capture L2 whose unfused
attention holds [B, heads, S, S] scores, torch's CPU allocator failing, a condition image over
Pillow's pixel limit, an --image-area past the sigma table; and an image file in the way of -o
that drifttool did not write. Memory is never really allocated: the available-memory reader is
patched, or torch is asked for more than any machine has."""

from __future__ import annotations

import pytest

pytest.importorskip("PIL")

from drifttool import memory  # noqa: E402
from drifttool.fixture import locate  # noqa: E402
from drifttool.model.checkpoint import read_config  # noqa: E402
from drifttool.model.vae_checkpoint import vae_config  # noqa: E402
from drifttool.settings import RunSpec, resolve  # noqa: E402
from tests.conftest import one_error_line  # noqa: E402

EDIT = locate("tiny-edit")
GIB = 1 << 30


def _edit(out, *extra):
    return ("run", "--image", EDIT / "condition.png", "--fixture", "tiny-edit", "--mode", "auto",
            "--preset", "diffusers-edit", "-o", out, *extra)


def test_the_edit_runs_bound_counts_its_condition_image():
    """--image-area 60000000 with the 80x48 condition image: a 9984x6016 px image (376 x 624
    patches) VAE-encoded and decoded, 234624 noisy and as many condition tokens. At capture L1
    the resized image's and the VAE's full-resolution records are rows of 4·9984·6016 words: the
    digest's key table of 2^28 columns, 2·6·8 bytes each, 24 GiB (the run was killed at 23.7 GiB);
    at L0 the condition tokens count in the MLP and the encode is as large as the decode."""
    folder = EDIT
    config, vae = read_config(folder / "transformer"), vae_config(folder)
    grid = (376, 624)
    _, s = resolve(RunSpec(fixture="tiny-edit", mode="auto", height=6016, width=9984))
    need, what = memory.peak_lower_bound(s, config, vae, [grid])
    assert need == 96 * (1 << 28) and "key table" in what, (need, what)
    _, s0 = resolve(RunSpec(fixture="tiny-edit", mode="auto", height=6016, width=9984, capture="L0"))
    n = 376 * 624
    mlp = memory.peak_lower_bound(s0, config, None, [grid])[0]
    assert mlp == 2 * n * 64 * 4 + 2 * n * (3 * 32 + 128) * 2  # x0 and cond, [noisy | cond] MLP
    encode_only = memory.peak_lower_bound(s0, config, vae, [(400, 700)])
    assert encode_only == (4 * 6400 * 11200 * (3 * 2 + 4 * 2), "the condition image's VAE encode at "
                           "11200x6400 px (4 channels)")


def test_an_edit_run_past_memory_names_image_area(cli, tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda device: 2 * GIB)
    out = tmp_path / "e"
    one_error_line(*cli(*_edit(out, "--image-area", "60000000")),
              "error: --image-area 60000000: the run needs at least 24.0 GiB, 2.0 GiB available",
              "digest key table", "--capture L0, a smaller --image-area or fewer samples")
    assert not out.exists() and not (tmp_path / "e.png").exists()


def test_the_unfused_attention_at_l2_is_counted(cli, tmp_path, monkeypatch):
    """8192² px, strict at L2: 262144 image tokens, scores and probabilities [1, 2, S, S] FP32 =
    1 TiB (the run died trying to allocate one [S, S] score matrix); at L1 the fused attention."""
    config = read_config(locate("tiny-t2i-chain") / "transformer")
    _, s = resolve(RunSpec(height=8192, width=8192, capture="L2", samples=[0]))
    need, what = memory.peak_lower_bound(s, config)
    n = 512 * 512
    assert need == n * 64 * 4 + 2 * 2 * n * n * 4 and "unfused attention" in what
    assert memory.unfused_attention(s)
    _, s1 = resolve(RunSpec(height=8192, width=8192, capture="L1"))
    assert not memory.unfused_attention(s1)
    assert not memory.unfused_attention(resolve(RunSpec(height=64, width=64, capture="L2", mode="auto"))[1])
    monkeypatch.setattr(memory, "available_bytes", lambda device: 1 * GIB)
    out = tmp_path / "r"
    one_error_line(*cli("run", "--prompt", "a red cube", "--height", "8192", "--width", "8192", "-o", out),
              "error: --height 8192 --width 8192: the run needs at least 1024.1 GiB",
              "unfused attention", "--capture L1, a smaller image")
    assert not out.exists()


def test_torchs_cpu_allocator_failing_is_out_of_host_memory(capsys):
    """No bytes are allocated: torch refuses 2^50 bytes at once."""
    import torch
    import typer

    from drifttool.cli._errors import user_errors

    def run():
        return torch.empty(1 << 50, dtype=torch.uint8)

    with pytest.raises(typer.Exit) as e:
        user_errors(run, command="run")()
    assert e.value.exit_code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: out of host memory: "), err
    assert "internal error" not in err[0]


def test_a_condition_image_past_pillows_pixel_limit_is_bad_input(cli, tmp_path, monkeypatch):
    """A 1-bit 300x300 PNG against a limit lowered to 20000 pixels (40000 > 2·20000: Pillow's
    DecompressionBombError, as a 30000x30000 PNG is at the default limit)."""
    from PIL import Image

    big = tmp_path / "huge.png"
    Image.new("1", (300, 300)).save(big)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 20000)
    out = tmp_path / "r"
    args = ("run", "--image", big, "--fixture", "tiny-edit", "--mode", "auto", "--preset", "diffusers-edit",
            "-o", out)
    one_error_line(*cli(*args), f"condition image {big}: 300x300 pixels, more than the 40000 pixels",
              "decompression bombs")
    assert Image.MAX_IMAGE_PIXELS == 20000  # restored after the size was read


def test_an_image_area_past_the_sigma_table_names_image_area(cli, tmp_path):
    """--image-area 100000000 became 12896x7744 px: the message names the option given and the
    largest area that runs with this image, which resolves, the next one not."""
    import re

    from drifttool.edit_images import pipeline_size
    from drifttool.errors import UnsupportedConfigError

    line = one_error_line(*cli(*_edit(tmp_path / "r", "--image-area", "100000000")),
                     "error: --image-area 100000000 (a 12896x7744 px output): the scheduler's dynamic shift",
                     "at 3 steps, every --image-area up to ")
    assert "--height" not in line
    top = int(re.search(r"up to (\d+) runs", line).group(1))
    for area in (top, top - 1000, top // 2):
        w, h = pipeline_size(80, 48, area)
        resolve(RunSpec(fixture="tiny-edit", mode="auto", height=h, width=w))
    w, h = pipeline_size(80, 48, top + 1)
    with pytest.raises(UnsupportedConfigError, match="dynamic shift"):
        resolve(RunSpec(fixture="tiny-edit", mode="auto", height=h, width=w))


def test_a_foreign_file_at_the_image_path_is_not_replaced(cli, tmp_path):
    """Without and with --overwrite: the file is not drifttool's; neither message offers
    --overwrite as the way out."""
    (tmp_path / "exists.png").write_text("junk\n")
    out = tmp_path / "exists"
    for extra in ((), ("--overwrite",)):
        line = one_error_line(*cli("run", "--prompt", "a cube", "-o", out, *extra),
                         f"{tmp_path / 'exists.png'} exists and is not an image of a drifttool run",
                         "will not replace it; move it or choose another -o")
        assert "use --overwrite" not in line
    assert (tmp_path / "exists.png").read_text() == "junk\n"
