"""Small host arrays sent to the device in one copy from one staging buffer."""

from __future__ import annotations

import numpy as np
import torch

from workers.engine.memory import pinned_empty
from workers.engine.sequence import cdiv

_ALIGN = 16  # every view is 16-byte aligned, as Triton assumes of the pointers its kernels were compiled for


class Staging:
    """A host buffer (pinned on CUDA) that packs a step's small arrays for one non-blocking copy.

    Two buffers are used in turn, and a buffer is refilled only after the copy that last read it has
    completed, so filling step t+1's inputs never races step t's transfer. On the CPU the arrays
    themselves are the result (shared, not copied: every step plans fresh arrays), unless `pack` asks
    for the views of one buffer that CUDA kernels get (tests check their alignment).
    """

    def __init__(self, device: torch.device, pack: bool | None = None) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.pack = self.cuda if pack is None else pack
        self.capacity = 0
        self.turn = 0
        self.host: list[torch.Tensor] = []
        self.dev: list[torch.Tensor] = []
        self.done: list[torch.cuda.Event] = []

    def _reserve(self, nbytes: int) -> None:
        if nbytes <= self.capacity:
            return
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()  # old buffers may still be read
        self.capacity = max(nbytes, 2 * self.capacity, 4096)
        self.host = [pinned_empty((self.capacity,), torch.uint8, self.device) for _ in range(2)]
        if self.cuda:
            self.dev = [torch.empty(self.capacity, dtype=torch.uint8, device=self.device) for _ in range(2)]
            self.done = [torch.cuda.Event() for _ in range(2)]

    def send(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """Device tensors with the values and dtypes of `arrays`, after one host-to-device copy."""
        if not self.pack:
            return {name: torch.from_numpy(np.ascontiguousarray(array)) for name, array in arrays.items()}
        offsets, end = {}, 0
        for name, array in arrays.items():
            offsets[name] = end
            end += cdiv(array.nbytes, _ALIGN) * _ALIGN
        self._reserve(end)
        host = dev = self.host[self.turn]
        if self.cuda:
            dev = self.dev[self.turn]
            if not self.done[self.turn].query():  # done long ago in a steady state: no sync at all
                self.done[self.turn].synchronize()
        raw = host.numpy()
        for name, array in arrays.items():
            raw[offsets[name]:offsets[name] + array.nbytes] = np.ascontiguousarray(array).view(np.uint8)
        if self.cuda:
            dev[:end].copy_(host[:end], non_blocking=True)
            self.done[self.turn].record()
        self.turn ^= 1
        return {name: dev[offsets[name]:offsets[name] + array.nbytes].view(_TORCH[array.dtype.str[1:]])
                for name, array in arrays.items()}


_TORCH = {"i8": torch.int64, "i4": torch.int32, "f8": torch.float64, "f4": torch.float32, "b1": torch.bool,
          "u1": torch.uint8}
