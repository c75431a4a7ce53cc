"""Runtime adapters: capture other implementations of the Qwen-Image MMDiT into drifttool artifacts.

``taps``: a table of taps (module path pattern -> RFC operator, stream, layout, which tensor)
turned into forward hooks that record through ``drifttool.ops.sink.record_external``.

``diffusers_qwenimage``: an unmodified diffusers ``QwenImageTransformer2DModel`` instrumented with
its table of taps, and its attention through a registered diffusers attention backend
(``diffusers_attention``) (RFC ``diffusers_runtime_adapter_qwenimage``, capture half); its
docstring says how to add another runtime. diffusers is imported lazily: drifttool runs without it.

``vllm_omni_qwenimage``: vllm-omni's ``QwenImageTransformer2DModel`` (0.30) captured the same way;
``vllm_omni_glue`` records its fused QKV and QK-norm+RoPE and reads back its kernels,
``vllm_omni_cpu`` runs it on the CPU; ``vllm_omni_strict`` and ``vllm_omni_strict_attention`` bind
drifttool's strict GEMMs (through vLLM's linear method) and joint attention (in place of the
attention implementation) into it. ``docs/adapters.md``: what each adapter captures, binds and
refuses.

``xfuser_qwenimage``: xfuser (xDiT) 0.7.0's Qwen-Image wrapper (a diffusers subclass) captured with
the diffusers table, its attention through xfuser's attention registry; ``xfuser_cpu`` runs it on
the CPU as one rank.

``diffusers_pipeline``: an unmodified diffusers ``QwenImagePipeline`` (or edit pipeline) call
captured whole (``capture_pipeline``); ``pipeline_hooks`` (imports diffusers) taps its
transformer, scheduler and methods, ``pipeline_scope`` names each transformer call (step, sigma,
CFG branch, text rows, grid), ``pipeline_stages`` captures the stages around the loop: the text
encoder (``transformers_qwen25vl``: transformers' Qwen2.5-VL language model, its attention
through a function registered with transformers' ``AttentionInterface``) and the VAE encode and
decode (``diffusers_vae``: diffusers' ``AutoencoderKLQwenImage``).
"""
