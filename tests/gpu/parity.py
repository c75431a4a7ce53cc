"""drifttool's production MMDiT next to diffusers' transformer on one device: same weights, same
inputs, both captured at L1 through the same ``Runtime`` identities, so a difference is named by
its first operator (a helper of ``test_production_parity_cuda`` and the benchmark)."""

from __future__ import annotations

import torch

from drifttool.adapters.diffusers_qwenimage import instrument
from drifttool.capture.recorder import Recorder
from drifttool.model.checkpoint import load_state_dict_into
from drifttool.model.config import from_diffusers_config
from drifttool.model.mmdit import MMDiT
from drifttool.runtime import Runtime

FULL_WIDTH = dict(patch_size=2, in_channels=64, out_channels=16, attention_head_dim=128,
                  num_attention_heads=24, joint_attention_dim=3584, axes_dims_rope=(16, 56, 56))


def diffusers_transformer(num_layers: int, device: str, seed: int = 0):
    """A random full-width ``QwenImageTransformer2DModel`` in bf16, built on ``device``."""
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(seed)
    with torch.device(device):
        tr = QwenImageTransformer2DModel(num_layers=num_layers, **FULL_WIDTH).to(torch.bfloat16)
        with torch.no_grad():
            for name, p in tr.named_parameters():
                if p.dim() == 1 and "norm" in name:
                    p.normal_(1.0, 0.1)
    # diffusers builds its RoPE tables on the CPU at init (plain attributes, moved per device in
    # forward); built under ``torch.device("cuda")`` they would come from the GPU's sin/cos
    tr.pos_embed = type(tr.pos_embed)(theta=10000, axes_dim=list(FULL_WIDTH["axes_dims_rope"]),
                                      scale_rope=True)
    return tr.eval()


def ours_from(tr) -> MMDiT:
    """drifttool's ``MMDiT`` sharing nothing with ``tr`` but holding its weights, on its device."""
    cfg = from_diffusers_config(dict(tr.config))
    with torch.device("meta"):
        model = MMDiT(cfg, dtype=tr.dtype)
    load_state_dict_into(model, {k: v.detach() for k, v in tr.state_dict().items()})
    return model.to(next(tr.parameters()).device)


def inputs(batch: int, grid: tuple[int, int], slots: int, lens: list[int], device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, grid[0] * grid[1], 64, generator=g).bfloat16()
    txt = torch.randn(batch, slots, 3584, generator=g).bfloat16()
    mask = torch.arange(slots)[None, :] < torch.tensor(lens)[:, None]
    tau = torch.rand(batch, generator=g)
    return [t.to(device) for t in (x, txt, mask, tau)]


def scope(batch, lens, grid):
    return dict(phase="rollout", step=0, sigma=1.0, branch="cond", samples=list(range(batch)),
                txt_lens=list(lens), img_grid=tuple(grid))


def diffusers_forward(tr, x, txt, mask, tau, grid):
    return tr(hidden_states=x, encoder_hidden_states=txt, encoder_hidden_states_mask=mask,
              timestep=tau, img_shapes=[(1, *grid)] * x.shape[0], return_dict=False)[0]


def both(tr, ours, x, txt, mask, tau, grid, lens, level="L1"):
    """``(v_diffusers, v_ours, records_d, records_o)``; records: ordered lists of
    ``((block, stream, op, call, index, sample, branch), digest)``."""
    sc = scope(x.shape[0], lens, grid)
    rt_d = Runtime(mode="auto", recorder=Recorder(level))
    with torch.no_grad(), instrument(tr, rt_d), rt_d.scope(**sc):
        v_d = diffusers_forward(tr, x, txt, mask, tau, grid)
    rt_o = Runtime(mode="auto", recorder=Recorder(level))
    with torch.no_grad(), rt_o.scope(**sc):
        v_o = ours(x, txt, mask, tau, grid, rt_o)
    key = ("block", "stream", "op", "call", "index", "sample", "branch")
    out = []
    for rt in (rt_d, rt_o):
        rt.recorder.flush()
        out.append([(tuple(r[k] for k in key), r["digest"]) for r in rt.recorder.ops_table().to_pylist()])
    kernels = sorted({e.kernel for e in rt_d.trace.entries() if e.op == "joint_attention_fused"})
    return v_d, v_o, out[0], out[1], kernels


def first_difference(rd, ro) -> str | None:
    """The first record (in diffusers' order) whose digest differs or that one side lacks."""
    o = dict(ro)
    for k, d in rd:
        if k not in o:
            return f"{k} missing in drifttool's records"
        if o[k] != d:
            return f"first differing record {k}"
    return None
