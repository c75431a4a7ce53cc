"""The vllm-omni capture refuses a compiled run (``enforce_eager=False``) in one message naming
the setting: each way vllm-omni 0.30 compiles a transformer, reproduced with plain
``torch.compile`` on a stand-in module (no vllm-omni needed; nothing is compiled until a call,
and nothing here calls). tests/adapters_vllm checks the same on vllm-omni's own model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from drifttool.adapters.vllm_omni_qwenimage import (VllmOmniQwenImage, compiled_problem,
                                                    instrument)
from drifttool.errors import UnsupportedConfigError
from drifttool.runtime import Runtime


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.img_mlp = torch.nn.Linear(3, 5)

    def forward(self, x):
        return self.img_mlp(x)


class _Transformer(torch.nn.Module):
    """The shape the checks walk: a module with ``transformer_blocks``."""

    def __init__(self) -> None:
        super().__init__()
        self.img_in = torch.nn.Linear(5, 3)
        self.transformer_blocks = torch.nn.ModuleList([_Block(), _Block(), _Block()])

    def forward(self, x):
        for blk in self.transformer_blocks:
            x = blk(x)
        return x


def _regional(tr: _Transformer, attr: str = "forward") -> _Transformer:
    """vllm-omni's regional compilation: each block's forward (or, under its hook registry,
    ``_omni_original_forward``) replaced by a compiled function."""
    for blk in tr.transformer_blocks:
        setattr(blk, attr, torch.compile(blk.forward))
    return tr


def _full(tr: _Transformer) -> _Transformer:
    tr.compile()  # vllm-omni's full granularity: Module.compile() in place
    return tr


def _one_block(tr: _Transformer) -> _Transformer:
    tr.transformer_blocks[2].compile()
    return tr


@pytest.mark.parametrize("how,where", [
    (torch.compile, "wrapped by torch.compile (an OptimizedModule)"),
    (_full, "the transformer is compiled in place (Module.compile()"),
    (_one_block, "transformer_blocks.2 is compiled in place"),
    (_regional, "transformer_blocks.0.forward is a torch.compile'd function"),
    (lambda tr: _regional(tr, "_omni_original_forward"),
     "transformer_blocks.0._omni_original_forward is a torch.compile'd function"),
])
def test_every_way_vllm_omni_compiles_is_refused_naming_enforce_eager(how, where):
    tr = _Transformer()
    assert compiled_problem(tr) is None
    compiled = how(tr)
    assert where in compiled_problem(compiled)
    with pytest.raises(UnsupportedConfigError, match=r"enforce_eager=False.*enforce_eager=True") as e:
        with instrument(compiled, Runtime(mode="auto")):
            pass
    assert where in str(e.value) and "\n" not in str(e.value)
    eager = SimpleNamespace(enforce_eager=True)
    with pytest.raises(UnsupportedConfigError, match=r"enforce_eager=False"):
        VllmOmniQwenImage(compiled, eager, {})


def test_an_engine_config_that_compiles_is_refused_before_the_model_is_read():
    with pytest.raises(UnsupportedConfigError, match=r"has enforce_eager=False; build and run it "
                                                     r"with enforce_eager=True"):
        VllmOmniQwenImage(_Transformer(), SimpleNamespace(enforce_eager=False), {})
