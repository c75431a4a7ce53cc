"""Triton kernels of the strict CUDA family (imported only when a strict CUDA call runs, or by the
kernels' own tests under ``TRITON_INTERPRET=1`` on CPU tensors).

Every wrapper here takes and returns ``torch.Tensor`` on one device and allocates its output on
that device, so the same function runs on an H200 and, in the interpreter, on the CPU."""
