"""The diff of two prompt runs (``drifttool run --prompt``) names where a drift is born: a drift
inside the text encoder is a record's, not the replay inputs' (the text encoder makes those), and
what the text encoder reads (the prompts) decides whether its first drift consumed other inputs.
On the shipped tiny pipeline (``tiny-t2i-chain``), strict against auto mode."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

from drifttool.artifact import open_run  # noqa: E402
from drifttool.chain import run_chain  # noqa: E402
from drifttool.diff import Verdict, diff_runs  # noqa: E402
from drifttool.settings import RunSpec  # noqa: E402

PROMPT, NEGATIVE = "a cube", "cat"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("chain-origin")


def _pair(base, level):
    """Strict and auto prompt runs of one prompt and negative prompt at ``level`` (made once)."""
    out = []
    for mode in ("strict", "auto"):
        path = base / f"{mode}-{level}"
        if not path.exists():
            spec = RunSpec(mode=mode, capture=level, steps=2)
            assert run_chain(spec, path, prompts=[PROMPT], negative_prompts=[NEGATIVE])["complete"]
        out.append(path)
    return out


def test_a_drift_inside_the_text_encoder_is_born_in_its_record(runs):
    a, b = _pair(runs, "L2")
    r = diff_runs(open_run(a), open_run(b))
    fd = r.first_drift
    assert r.verdict is Verdict.DRIFT and (fd.component, fd.step) == ("text_encoder", -1), r.reason
    assert fd.op_pos > 0  # earlier text-encoder records (token embedding, norms) match
    assert fd.origin_kind == "record" and fd.origin and fd.input_note is None, r.reason
    assert "origin (every earlier record matches)" in r.reason
    assert "replay inputs differ" not in r.reason
    # the text encoder's outputs still differ, and the context says whose outputs they are
    made = [ln for ln in r.input_differences if ln.startswith(("inputs.txt:", "inputs.neg_txt:"))]
    assert len(made) == 2 and all("the text encoder's output in both runs" in ln for ln in made), \
        r.input_differences


def test_at_l0_the_first_transformer_record_names_every_text_encoder_output(runs):
    """No text-encoder record at L0: the transformer's first record consumed the differing
    embeddings, and the origin names both (prompt and negative prompt) as the text encoder's."""
    a, b = _pair(runs, "L0")
    r = diff_runs(open_run(a), open_run(b))
    fd = r.first_drift
    assert fd.component == "mmdit" and fd.origin_kind == "inputs", r.reason
    assert "inputs.txt:" in fd.input_note and "inputs.neg_txt:" in fd.input_note, fd.input_note
    assert fd.input_note.count("the text encoder's output in both runs") == 2, fd.input_note


def test_other_prompts_are_what_the_text_encoders_first_record_consumed(runs, tmp_path):
    spec = RunSpec(mode="strict", capture="L2", steps=2)
    assert run_chain(spec, tmp_path / "x", prompts=[PROMPT])["complete"]
    assert run_chain(spec, tmp_path / "y", prompts=["a red ball"])["complete"]
    r = diff_runs(open_run(tmp_path / "x"), open_run(tmp_path / "y"))
    fd = r.first_drift
    assert fd.component == "text_encoder" and fd.origin_kind == "inputs", r.reason
    assert fd.input_note.startswith('chain.prompts: ["a cube"] != ["a red ball"]'), fd.input_note
    assert 'chain.prompts: ["a cube"] != ["a red ball"]' in r.context
    # prompts of other lengths did not move: the context says their lengths differ
    assert not [ln for ln in r.context if "rows moved" in ln], r.context
    (lengths,) = [ln for ln in r.context if "lengths differ" in ln]
    n_a, n_b = (int(open_run(tmp_path / n).raw_inputs()["txt"].array.shape[1]) for n in ("x", "y"))
    assert n_a != n_b and lengths == (f"inputs.txt: the prompts' lengths differ for common samples [0] "
                                      f"(sample 0: {n_a} vs {n_b} tokens)"), lengths


def test_localize_of_an_l0_pair_says_the_drift_starts_in_the_text_encoder(runs, tmp_path):
    """An L0 pair holds no text-encoder record; re-executing a transformer step would name an
    operator that only consumed the differing embeddings (the L2 pair's first drift is in the
    text encoder). The status is not ``localized`` and names the component."""
    from drifttool.training.localize import localize

    assert diff_runs(*map(open_run, _pair(runs, "L2"))).first_drift.component == "text_encoder"
    report, loc = localize(*_pair(runs, "L0"), out_dir=tmp_path / "loc")
    assert report.verdict is Verdict.DRIFT and report.first_drift.component == "mmdit"
    assert loc.status == "before_transformer" and loc.first_drift is None, loc.reason
    assert "starts in the text encoder (component text_encoder), before the transformer" in loc.reason
    assert "inputs.txt, inputs.neg_txt differ" in loc.reason, loc.reason
    assert loc.step is None and not (tmp_path / "loc").exists()  # nothing re-executed


def test_localize_of_an_l2_pair_names_the_text_encoders_first_drift(runs):
    from drifttool.training.localize import localize

    report, loc = localize(*_pair(runs, "L2"))
    assert loc.status == "before_transformer" and report.first_drift.where() in loc.reason, loc.reason


def test_the_first_drift_table_calls_a_text_encoder_step_an_early_stage(runs, cli):
    """Its records are made before step 0 too, but they are no sigma table."""
    code, out = cli("diff", *_pair(runs, "L2"))
    assert code == 1 and "before step 0 (an early stage)" in out and "(the sigma table)" not in out, out
    assert "the sigma table, and a prompt or edit run's text encoder" in out, out


def _changed_copy(tmp_path, part: str, file: str, key: str):
    """A copy of the shipped pipeline folder with one weight of ``part`` changed (+1 on its first
    element: ``key`` is used by every run)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from drifttool.chain import default_pipeline

    folder = tmp_path / f"pipe-{part}"
    shutil.copytree(default_pipeline(), folder)
    tensors = load_file(folder / part / file)
    tensors[key] = tensors[key].clone()
    tensors[key].view(-1)[0] += torch.ones((), dtype=tensors[key].dtype)
    save_file(tensors, folder / part / file)
    return folder


@pytest.mark.parametrize("part, file, key, field", [
    ("vae", "diffusion_pytorch_model.safetensors", "decoder.conv_out.bias", "VAE weights"),
    ("text_encoder", "model.safetensors", "model.norm.weight", "text encoder weights"),
])
def test_a_replay_with_other_stage_weights_is_another_program(runs, tmp_path, part, file, key, field):
    """``replay --checkpoint`` of a prompt run with a pipeline whose VAE (or text encoder) weight
    differs: the semantic pre-check names that stage's weight digest, from the manifests' chain
    section, beside the bitwise drift."""
    import json

    from drifttool.training.options import RerunOptions
    from drifttool.training.replay import replay_run

    src = _pair(runs, "L2")[0]
    folder = _changed_copy(tmp_path, part, file, key)
    replay_run(src, tmp_path / "r", RerunOptions(checkpoint=str(folder)))
    r = diff_runs(open_run(src), open_run(tmp_path / "r"))
    assert r.verdict is Verdict.DRIFT and r.exit_code == 1, r.reason
    fields = [d.field for d in r.semantic.differences]
    assert fields == [field], r.semantic.differences
    (d,) = r.semantic.differences
    key = "vae_weights" if part == "vae" else "text_encoder_weights"
    ma, mb = (json.loads((p / "manifest.json").read_text()) for p in (src, tmp_path / "r"))
    assert (d.a, d.b) == (ma["chain"][key], mb["chain"][key]) and d.a != d.b
    assert d.keys == [f"chain.{key}"]


def test_localize_of_a_drift_in_the_vae_decode_says_after_the_transformer(runs, tmp_path):
    """A replay whose pipeline has another VAE decoder weight: every transformer and sampler
    record matches and the first drift is the decode's; localize re-executes no transformer
    step (it could show nothing) and says the drift starts after the transformer."""
    from drifttool.training.localize import localize
    from drifttool.training.options import RerunOptions
    from drifttool.training.replay import replay_run

    src = _pair(runs, "L2")[0]
    folder = _changed_copy(tmp_path, "vae", "diffusion_pytorch_model.safetensors", "decoder.conv_out.bias")
    replay_run(src, tmp_path / "r", RerunOptions(checkpoint=str(folder)))
    report, loc = localize(src, tmp_path / "r", out_dir=tmp_path / "loc")
    fd = report.first_drift
    assert fd.component == "vae" and fd.step >= 0, report.reason
    assert loc.status == "after_transformer" and loc.step is None, loc.reason
    assert "starts in the VAE decode (component vae), after the transformer" in loc.reason
    assert fd.where() in loc.reason and not (tmp_path / "loc").exists()
