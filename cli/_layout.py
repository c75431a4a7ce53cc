"""The parallel layout of a command under torchrun: ``--tp``, ``--sp``, ``--sp-attention`` and
``--cfg-parallel`` of ``run``, ``replay``, ``recompute``, ``probe`` and ``experiment``.

    $ torchrun --standalone --nproc-per-node 2 -m drifttool run --tp 2 -o runs/tp2
    $ torchrun --standalone --nproc-per-node 2 -m drifttool replay runs/one --sp 2 -o runs/one-sp2
    $ torchrun --standalone --nproc-per-node 2 -m drifttool recompute runs/one --cfg-parallel 2 -o runs/one-train

Before any process group starts, every rank checks the layout against the model and the run
(``check_layout``): the degrees (``ParallelDims``), the model's widths and heads, the family
(TP/SP run strict only), CFG on for ``--cfg-parallel``, no L2 capture with Ring attention, and
then the launch's world size (``check_launch``). These checks read only the command line, the
model's ``config.json`` and ``WORLD_SIZE``, so every rank refuses alike: they run under
``alike_on_every_rank`` and the refusal is printed once (``cli._errors.user_errors``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import typer

from drifttool.errors import DriftToolError

if TYPE_CHECKING:  # pragma: no cover
    from drifttool.distributed import DistContext, LaunchEnv
    from drifttool.distributed.plan import ParallelDims

TP_HELP = "Tensor-parallel degree (1, 2, 4, 8): attention heads and MLP channels over ranks; strict only."
SP_HELP = "Sequence-parallel degree (1, 2, 4, 8): image rows and their RoPE positions over ranks; strict only."
SP_ATTENTION_HELP = "agrs (default) | ulysses | ring: how SP attention sees every key (needs --sp)."
CFG_PARALLEL_HELP = "1 or 2: one CFG branch per rank (needs CFG on)."


def tp_option() -> Any:
    return typer.Option(1, "--tp", help=TP_HELP)


def sp_option() -> Any:
    return typer.Option(1, "--sp", help=SP_HELP)


def sp_attention_option() -> Any:
    return typer.Option(None, "--sp-attention", help=SP_ATTENTION_HELP, show_default=False)


def cfg_parallel_option() -> Any:
    return typer.Option(1, "--cfg-parallel", help=CFG_PARALLEL_HELP)


def layout_dims(tp: int, sp: int, sp_attention: Optional[str], cfg_parallel: int) -> "ParallelDims":
    """The ``ParallelDims`` of the options. ``--sp-attention`` without ``--sp`` is refused: there
    is no sequence shard for it to act on, and a run silently laid out otherwise than asked would
    be worse than one line.

    Raises:
        UnsupportedConfigError: a degree or SP attention ``ParallelDims`` refuses.
        DriftToolError: ``--sp-attention`` without ``--sp`` > 1.
    """
    from drifttool.distributed.plan import ParallelDims  # lazy: keeps torch out of `drifttool --help`

    dims = ParallelDims(tp=tp, sp=sp, cfg=cfg_parallel, sp_attention=sp_attention or "agrs")
    if sp_attention is not None and dims.sp == 1:
        raise DriftToolError(f"--sp-attention {sp_attention} needs --sp 2, 4 or 8 (it says how "
                             "sequence-parallel ranks attend; without --sp every rank holds every row)")
    return dims


def describe(dims: "ParallelDims") -> str:
    """``tp 2 × sp 2 ring × cfg 1``: the layout as the summary tables print it."""
    return (f"tp {dims.tp} × sp {dims.sp}" + (f" {dims.sp_attention}" if dims.sp > 1 else "")
            + f" × cfg {dims.cfg}")


def check_layout(dims: "ParallelDims", *, model_dir: Any, mode: Any, level: str, cfg_branches: int,
                 cfg_layout: str, capture_from: str = "", conditions: int = 0,
                 lora_mode: Optional[str] = None, internals: bool = True) -> None:
    """Refuse, before any rank starts a process group or opens the artifact, a layout that the
    model or the run cannot take: the plan's own checks (``ParallelPlan.build`` against the
    config of the model in ``model_dir``, on a stand-in context of the layout's world size:
    TP/SP strict only, heads and widths the degrees divide, Ulysses heads per TP rank, Ring
    attention at a capture ``level`` that records attention internals when ``mode``
    (``runtime.Mode``) captures and ``internals`` is on) and ``plan.check_cfg_parallel`` (CFG
    on, production with sequential CFG only); condition images (``conditions`` of them: an edit run) with SP > 1;
    an adapter in an unfused ``lora_mode`` (None: no adapter) with TP or SP > 1
    (``model.lora_calls.check_mode_layout``, which the run would raise on every rank after they
    start). Nothing for a one-process layout. ``capture_from`` names where a default capture
    level came from.

    Raises:
        DriftToolError (UnsupportedConfigError): naming the option and the reason.
    """
    if not dims.parallel:
        return
    if conditions and dims.sp > 1:
        from drifttool.errors import UnsupportedConfigError  # lazy: likewise

        raise UnsupportedConfigError(f"--sp {dims.sp} with --condition: condition images under "
                                     "sequence parallelism are not supported (use --sp 1)")
    from drifttool.distributed import DistContext  # lazy: likewise
    from drifttool.distributed.plan import ParallelPlan, check_cfg_parallel  # lazy: likewise
    from drifttool.model.checkpoint import read_config  # lazy: likewise
    from drifttool.model.lora_calls import check_mode_layout  # lazy: likewise

    ParallelPlan.build(DistContext(rank=0, world_size=dims.world_size), dims, read_config(model_dir),
                       family=mode.family, capture_level=level if mode.captures else None,
                       capture_from=capture_from, internals=internals)
    check_cfg_parallel(dims, family=mode.family, cfg_on=cfg_branches == 2, cfg_layout=cfg_layout)
    check_mode_layout(lora_mode, dims)


def settings_layout(fx: Any, settings: Any) -> dict[str, Any]:
    """``check_layout``'s keywords for a resolved run (``settings.resolve``: fixture, settings)."""
    return dict(model_dir=settings.checkpoint or fx.model_dir, mode=settings.mode,
                level=settings.capture, internals=settings.internals, cfg_branches=settings.cfg_branches,
                cfg_layout=settings.cfg_layout, lora_mode=settings.lora_mode,
                conditions=len(settings.external.cond_grids) if settings.external is not None else 0)


def check_launch(dims: "ParallelDims", launch: "LaunchEnv | None", command: str) -> None:
    """Refuse a TP/SP/CFG-parallel layout launched on another number of ranks than
    ``tp · sp · cfg`` (one process included).

    Raises:
        DriftToolError: naming the torchrun command that fits.
    """
    if dims.parallel and (launch is None or launch.world_size != dims.world_size):
        raise DriftToolError(
            f"--tp {dims.tp} --sp {dims.sp} --cfg-parallel {dims.cfg} needs {dims.world_size} ranks: "
            f"launch with torchrun --nproc-per-node {dims.world_size} -m drifttool {command} ..."
            + (f" (this launch has {launch.world_size})" if launch is not None else ""))


def start(dims: "ParallelDims", device: str) -> "DistContext":
    """This process's ``DistContext``: one process without torchrun; under it the process group
    with the mesh ``plan.MESH_DIMS`` of the layout's shape, or ``("sample",)`` when the layout is
    one process (sample-parallel). Rank r runs on ``cuda:LOCAL_RANK`` for a CUDA device."""
    from drifttool.distributed import init_distributed  # lazy: likewise
    from drifttool.distributed.plan import MESH_DIMS  # lazy: likewise

    mesh = (dict(mesh_dims=MESH_DIMS, mesh_shape=dims.mesh_shape()) if dims.parallel
            else dict(mesh_dims=("sample",)))
    return init_distributed(device=device.split(":")[0], **mesh)


def on_ranks(dims: "ParallelDims", device: str, label: str, steps: int, batch: int, branches: int,
             call: Callable[..., Any], *, quiet: bool = False) -> tuple["DistContext", Any]:
    """Start this process's place in the layout (``start``), run ``call(dist=, parallel=,
    on_step=)`` — with progress bars of the checkpoint load and of ``steps`` × ``batch`` ×
    ``branches`` on rank 0, none on the other ranks, and on every rank a stop after the step in
    which a SIGTERM's exception was lost (``cli._errors.check_terminated``); ``quiet`` (``--json``, whose stdout holds one document) draws it on stderr —
    and close the process group whatever happens. Returns (dist, result)."""
    from drifttool.cli._console import err, load_reporter, progress, step_task  # lazy: likewise
    from drifttool.cli._errors import check_terminated  # lazy: likewise
    from drifttool.distributed import close_distributed  # lazy: likewise
    from drifttool.model.checkpoint import load_progress  # lazy: likewise

    dist = start(dims, device)
    try:
        if dist.rank != 0:
            return dist, call(dist=dist, parallel=dims, on_step=lambda _: check_terminated())
        with progress(err if quiet else None) as bar:
            loading = load_reporter(bar)
            task = step_task(bar, label, steps, batch, branches)

            def on_step(_: Any) -> None:
                bar.advance(task)
                check_terminated()  # a SIGTERM whose exception was lost stops the run here

            with load_progress(loading):
                return dist, call(dist=dist, parallel=dims, on_step=on_step)
    finally:
        close_distributed(dist)


def ranks_data(dims: "ParallelDims", dist: "DistContext") -> dict[str, Any]:
    """The layout a command ran in, for ``--json``: ``world_size``, ``layout``
    (``"one process"``, ``"sample-parallel"`` or ``"parallel"``), ``tp``, ``sp``,
    ``sp_attention`` (None without SP) and ``cfg_parallel``."""
    layout = "parallel" if dims.parallel else ("sample-parallel" if dist.world_size > 1 else "one process")
    return {"world_size": dist.world_size, "layout": layout, "tp": dims.tp, "sp": dims.sp,
            "sp_attention": dims.sp_attention if dims.sp > 1 else None, "cfg_parallel": dims.cfg}


def ranks_row(dims: "ParallelDims", dist: "DistContext") -> Optional[str]:
    """The summary table's ``ranks`` value: ``2 (tp 2 × sp 1 × cfg 1)``, ``2 (sample-parallel)``,
    or None for one process."""
    if dims.parallel:
        return f"{dist.world_size} ({describe(dims)})"
    if dist.world_size > 1:
        return f"{dist.world_size} (sample-parallel)"
    return None
