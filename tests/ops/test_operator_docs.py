"""The operator docs (docs/operators/) cover every declared RFC operator (WS1 and the VAE's one page
each; the text encoder's ``te_*`` rows share ``text_encoder.md``) and their generated parts
(index, facts blocks with contracts, kernels and tolerances) are up to date with the registry and
references/tolerances.json. Regenerate with ``python tools/operator_docs.py`` (a developer tool
of the source tree, not installed)."""

import importlib.util
from pathlib import Path

from drifttool.ops.registry import specs
from drifttool.ops.specs import TEXT_ENCODER_OPERATORS, VAE_OPERATORS, WS1_OPERATORS

_TOOL = Path(__file__).resolve().parents[2] / "tools" / "operator_docs.py"
_spec = importlib.util.spec_from_file_location("operator_docs", _TOOL)
docs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(docs)

SECTIONS = ("## Formula", "## Reduction order, forward (strict)", "## Reduction order, backward (strict)",
            "## Precision and cast points", "## Supported geometry", "## What fails closed", "## Facts")


def test_generated_operator_docs_are_up_to_date():
    stale = [str(p.relative_to(docs.ROOT)) for p, text in docs.render().items()
             if not p.exists() or p.read_text() != text]
    assert not stale, f"stale generated docs (run `python tools/operator_docs.py`): {stale}"


def test_every_operator_page_has_the_required_sections():
    for name in (*WS1_OPERATORS, *VAE_OPERATORS):
        text = (docs.DOCS / f"{name}.md").read_text()
        missing = [s for s in SECTIONS if s not in text]
        assert not missing, f"docs/operators/{name}.md lacks {missing}"
        assert specs()[name].contract in text and "python -m pytest" in text, name


def test_the_text_encoder_page_names_each_operator_and_its_validation():
    text = (docs.DOCS / "text_encoder.md").read_text()
    missing = [n for n in TEXT_ENCODER_OPERATORS if f"`{n}`" not in text]
    assert not missing and "python -m pytest tests/text_encoder" in text, missing
