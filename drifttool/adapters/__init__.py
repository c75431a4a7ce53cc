"""Runtime adapters: capture other implementations of the Qwen-Image MMDiT into drifttool artifacts.

``diffusers_qwenimage``: an unmodified diffusers ``QwenImageTransformer2DModel`` instrumented with
forward hooks (RFC ``diffusers_runtime_adapter_qwenimage``, capture half). diffusers is imported
lazily: drifttool runs without it.

``diffusers_pipeline``: an unmodified diffusers ``QwenImagePipeline`` call captured whole
(``capture_pipeline``); ``pipeline_hooks`` (imports diffusers) taps its transformer and scheduler,
``pipeline_scope`` names each transformer call (step, sigma, CFG branch, text rows, grid).
"""
