"""What a run notices about its inputs is said in its summary: a sharded checkpoint whose index
lists a tensor its shard does not hold (a warning, also recorded in the manifest, as diffusers
warns when it loads one), a prompt mask that masks every text token and fixture prompts
replaced by random ones of the model's width (notes, as CFG-off is noted)."""

from __future__ import annotations

import json
from dataclasses import replace

import torch
from safetensors.torch import save_file

from drifttool.artifact import open_run
from drifttool.model.checkpoint import save_checkpoint
from drifttool.model.checkpoint_files import WEIGHTS_INDEX_NAME
from drifttool.model.config import tiny
from drifttool.model.mmdit import MMDiT, random_init_


def test_an_index_listing_a_tensor_no_shard_holds_is_warned_and_recorded(cli, tmp_path):
    ck = tmp_path / "ck"
    save_checkpoint(random_init_(MMDiT(tiny()), seed=0), ck, max_shard_bytes=40_000)
    index = json.loads((ck / WEIGHTS_INDEX_NAME).read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"]["transformer_blocks.0.ghost.weight"] = shard
    (ck / WEIGHTS_INDEX_NAME).write_text(json.dumps(index))
    code, out = cli("run", "-o", tmp_path / "run", "--checkpoint", ck, "--steps", "2",
                    "--capture", "L0")
    assert code == 0, out
    text = " ".join(out.split())
    assert "warning: checkpoint:" in text and "transformer_blocks.0.ghost.weight" in text, out
    warnings = open_run(tmp_path / "run").manifest["checkpoint_warnings"]
    assert len(warnings) == 1 and shard in warnings[0] and "ghost.weight" in warnings[0]


def test_a_true_index_gives_no_warning(cli, tmp_path):
    ck = tmp_path / "ck"
    save_checkpoint(random_init_(MMDiT(tiny()), seed=0), ck, max_shard_bytes=40_000)
    code, out = cli("run", "-o", tmp_path / "run", "--checkpoint", ck, "--steps", "2",
                    "--capture", "L0")
    assert code == 0 and "warning" not in out, out
    assert "checkpoint_warnings" not in open_run(tmp_path / "run").manifest


def test_an_all_zero_prompt_mask_is_noted(cli, tmp_path):
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    save_file({"prompt_embeds": torch.randn(2, 3, 32) * mask[..., None],
               "prompt_embeds_mask": mask}, str(tmp_path / "pe.safetensors"))
    code, out = cli("run", "-o", tmp_path / "run", "--prompt-embeds", tmp_path / "pe.safetensors",
                    "--steps", "2", "--capture", "L0")
    assert code == 0, out
    text = " ".join(out.split())
    assert "note: the prompt mask of sample(s) [1] masks every text token" in text, out


def test_fixture_prompts_of_another_width_are_noted(cli, tmp_path):
    """A checkpoint whose text input is wider than the fixture's embeddings runs on seeded random
    embeddings at the fixture's lengths (``Fixture.prompts``): a note says so; a checkpoint of the
    fixture's width gives none."""
    for width, noted in ((48, True), (32, False)):
        ck = tmp_path / f"ck{width}"
        save_checkpoint(random_init_(MMDiT(replace(tiny(), joint_attention_dim=width)), seed=0), ck)
        code, out = cli("run", "-o", tmp_path / f"run{width}", "--checkpoint", ck, "--steps", "2",
                        "--capture", "L0")
        assert code == 0, out
        text = " ".join(out.split())
        assert ("note: the fixture's prompt embeddings are 32 wide and the model's text input 48: the "
                "prompts are seeded N(0, 1) embeddings" in text) is noted, out
