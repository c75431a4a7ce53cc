"""A block's text stream on a second CUDA stream: the same kernels on the same tensors, overlapped.

    >>> rt = dataclasses.replace(rt, lanes=Lanes(device))   # what GraphedForward's capture does
    >>> i, t = block(i, t, temb, ctx, rt)                   # txt operators run on the text lane

The image stream's operators fill the GPU; the text stream's (the prompt's padded rows, e.g. 128
at batch 1) do not: a 128-row GEMM is one row of output tiles, fewer tiles than the H200 has SMs,
each walking all of K. Within a block the two streams meet only in the joint attention, so
``Block`` runs the text stream's operators on a *text lane*, a second CUDA stream, and the image
stream's on the caller's stream (the *main lane*); the GPU runs the text lane's kernels on the
SMs the image stream's leave free. Every operator reads the same inputs
and runs the same kernel on either lane, so no byte changes (``tests/gpu/test_lanes_cuda.py``
compares raw bytes and the capture records with and without lanes).

A block's dependencies, in the order ``Block`` calls them:

1. ``fork()`` at the block's start: the text lane waits for the main lane's work so far (``temb``;
   at the first block ``t``, which the main lane made; later blocks' ``t`` is the text lane's own);
2. ``join(qt, kt, vt)`` before the joint attention: the main lane waits for the text lane's q, k, v;
3. ``fork(o)`` after it: the text lane waits for the attention output ``o``;
4. ``end()`` at the block's end: the main lane waits for the text lane, so the block's outputs,
   and a CUDA graph's capture, are complete on the caller's stream.

A tensor made on one lane and read on the other is *shared*: the caching allocator hands a
freed block back to the stream it was made on, without waiting for the other lane. ``fork`` and
``join`` therefore keep their shared tensors alive until ``end``: after it the main lane is
ordered after both lanes' reads, and the text lane's next work comes after the next ``fork``
(nothing else runs on the text lane in between). Tensors made before the block and read on the
text lane (``t`` at the first block, ``temb``, the RoPE tables) are held by the caller until the
block returns, after ``end``. ``JointAttention`` returns ``A_txt`` on the text lane, unjoined: only
``Block``, which ends the lane, may call it with lanes.

``SERIAL`` is the one-stream form (every method a no-op): what a runtime without lanes uses.
"""

from __future__ import annotations

import contextlib

import torch


class Serial:
    """No lanes: every operator on the caller's stream (the methods of ``Lanes``, doing nothing)."""

    def fork(self, *shared: torch.Tensor) -> None:
        """Nothing to wait for."""

    def join(self, *shared: torch.Tensor) -> None:
        """Nothing to wait for."""

    def end(self) -> None:
        """Nothing to wait for."""

    def txt(self) -> contextlib.AbstractContextManager[None]:
        """The caller's stream."""
        return contextlib.nullcontext()


SERIAL = Serial()


class Lanes(Serial):
    """The text lane of a CUDA device (module docstring).

    Args:
        device: the CUDA device whose streams run the blocks.

    Raises:
        ValueError: ``device`` is not a CUDA device.
    """

    def __init__(self, device: torch.device | str) -> None:
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"lanes are CUDA streams; got device {device}")
        self.text = torch.cuda.Stream(device)
        self._device = device
        self._shared: list[torch.Tensor] = []

    def fork(self, *shared: torch.Tensor) -> None:
        """The text lane waits for the main lane's work so far; ``shared``: main-lane tensors the
        text lane will read, kept until ``end``."""
        self.text.wait_stream(torch.cuda.current_stream(self._device))
        self._shared.extend(shared)

    def join(self, *shared: torch.Tensor) -> None:
        """The main lane waits for the text lane's work so far; ``shared``: text-lane tensors the
        main lane will read, kept until ``end``."""
        torch.cuda.current_stream(self._device).wait_stream(self.text)
        self._shared.extend(shared)

    def end(self) -> None:
        """``join`` and release the shared tensors (the block's end)."""
        self.join()
        self._shared.clear()

    def txt(self) -> contextlib.AbstractContextManager[None]:
        """Run the calls inside on the text lane."""
        return torch.cuda.stream(self.text)
