"""Small host arrays sent to the device in one copy from one staging buffer."""

from __future__ import annotations

import numpy as np
import torch

from workers.engine.memory import pinned_empty
from workers.engine.sequence import cdiv

_ALIGN = 16  # every view is 16-byte aligned, as Triton assumes of the pointers its kernels were compiled for
MAX_BUFFERS = 8  # staging buffers one Staging holds at most: a send finding all in flight waits for one


class Staging:
    """A host buffer (pinned on CUDA) that packs a step's small arrays for one non-blocking copy.

    Buffers are used in turn, and a buffer is refilled only after the copy that last read it has
    completed, so filling step t+1's inputs never races step t's transfer. A send whose turn's copy has not
    landed takes the next buffer whose copy has, or a new one (up to MAX_BUFFERS) rather than wait: a step
    that sends more after its launch (a recurrent model's forked states and copied blocks) queues those
    copies behind its own compute, and the next step's inputs must not wait for that. On the CPU the arrays
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
        count, self.host, self.dev, self.done = max(2, len(self.host)), [], [], []
        for _ in range(count):
            self._add_buffer()

    def _add_buffer(self) -> None:
        """One more buffer of `capacity` bytes (and its device twin and copy event on CUDA)."""
        self.host.append(pinned_empty((self.capacity,), torch.uint8, self.device))
        if self.cuda:
            self.dev.append(torch.empty(self.capacity, dtype=torch.uint8, device=self.device))
            self.done.append(torch.cuda.Event())

    def _take(self) -> int:
        """The buffer to fill: the one in turn, or on CUDA the next whose last copy has landed, else a new one
        (up to MAX_BUFFERS), else the one in turn once its copy lands."""
        if not self.cuda:
            return self.turn
        count = len(self.host)
        landed = next((i % count for i in range(self.turn, self.turn + count) if self.done[i % count].query()), None)
        if landed is not None:
            return landed
        if count < MAX_BUFFERS:
            self._add_buffer()
            return count
        self.done[self.turn].synchronize()
        return self.turn

    def send(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """Device tensors with the values and dtypes of `arrays`, after one host-to-device copy."""
        if not self.pack:
            return {name: torch.from_numpy(np.ascontiguousarray(array)) for name, array in arrays.items()}
        offsets, end = {}, 0
        for name, array in arrays.items():
            offsets[name] = end
            end += cdiv(array.nbytes, _ALIGN) * _ALIGN
        self._reserve(end)
        turn = self._take()
        host = dev = self.host[turn]
        raw = host.numpy()
        for name, array in arrays.items():
            raw[offsets[name]:offsets[name] + array.nbytes] = np.ascontiguousarray(array).view(np.uint8)
        if self.cuda:
            dev = self.dev[turn]
            dev[:end].copy_(host[:end], non_blocking=True)
            self.done[turn].record()
        self.turn = (turn + 1) % len(self.host)
        return {name: dev[offsets[name]:offsets[name] + array.nbytes].view(_TORCH[array.dtype.str[1:]])
                for name, array in arrays.items()}


_TORCH = {"i8": torch.int64, "i4": torch.int32, "f8": torch.float64, "f4": torch.float32, "b1": torch.bool,
          "u1": torch.uint8}
