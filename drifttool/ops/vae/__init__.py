"""The VAE's operators (RFC Phase B, ``vae_contract``): ``AutoencoderKLQwenImage``'s arithmetic
as five named operators, declared with the others in ``drifttool.ops.specs`` (component ``vae``,
contract ``qwenimage.<name>.v1``, forward only), each implemented for two families:

====================  ===============================================  =================================
operator              strict (CPU; FP32 accumulation, one cast out)    production (diffusers 0.42.1)
====================  ===============================================  =================================
vae_causal_conv3d     im2col rows, ``tiled_linear`` over K =           ``F.pad`` + ``F.conv3d`` (+ the
                      (ci, dt, dy, dx) — the zero taps included        residual), in the input dtype
vae_rms_norm          pairwise-tree Σx² over C, FP64 sqrt rounded      ``F.normalize`` (FP32 for bf16),
                      once, then ·√C·γ; SiLU in FP64 rounded once      cast back, ``·√C·γ + 0.0``, SiLU
vae_resample          nearest ×2 by index copy / zero pad, then the    ``F.interpolate`` nearest-exact /
                      conv's GEMM with stride                          ``F.pad``, ``F.conv2d``
vae_mid_attention     the norm above, ``tiled_linear`` Q/K/V and       diffusers' block: norm, 1×1
                      projection, the strict joint attention core      convs, SDPA, residual
                      (64-key blocks, fixed merge), one head
vae_latent_normalize  FP32 ``(z − mean)/std``; inverse = strict        pipelines' cast points: mean/std
                      ``latent_normalize``'s                           in z's dtype; inverse =
                                                                       production ``latent_normalize``
====================  ===============================================  =================================

The edit pipelines' image processor adds ``vae_image_resize`` (``image``: Pillow's resize of
the condition image before the encode, one function for both families).

Strict is batch- and position-invariant: every reduction runs along one sample's own axis (a
pixel's K patch, a pixel's channels, a frame's keys) in a fixed order that depends on that axis's
length only, and the GEMMs are ``strict_gemm.tiled_linear`` (row-invariant). Production with the
same weights equals ``diffusers.AutoencoderKLQwenImage`` byte for byte on the CPU (FP32 and BF16;
``tests/model/test_vae.py``). Images only: one frame (T = 1), where the causal time convolutions
of the 3-D resamplers never run (the first chunk only fills their caches), so ``vae_resample`` is
per frame.
"""

from drifttool.ops.vae import image, production, strict  # noqa: F401  (register both families)
