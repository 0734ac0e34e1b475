"""Per-row state slots: one tensor per state, `[slots, ...]`, indexed by a sequence's block-table row.

Recurrent layers' states (recurrent.py) and windowed layers' rings (window_ring.py) live here; the CPU pool
offloads a preempted sequence's slot with its KV blocks (offload.py).
"""

from __future__ import annotations

import torch

StateKey = tuple[int, str, int]  # (layer, "conv" or "recurrent", state index)


class StateCache:
    """One `[slots, ...]` tensor per (mixer layer, state kind, state index), zeroed. The last slot, or with
    `zero_slot` the last two, belong to no row: `pad_slot` takes a decode graph's padding rows, and
    `zero_slot`, never written, is what a mixer's row starting afresh reads."""

    def __init__(self, layout: dict[StateKey, tuple[torch.Size, torch.dtype]], slots: int,
                 device: torch.device, zero_slot: bool = False) -> None:
        self.tensors = {key: torch.zeros(slots, *shape, dtype=dtype, device=device)
                        for key, (shape, dtype) in layout.items()}
        self.num_slots = slots
        self.zero_slot = slots - 1 if zero_slot else None
        self.pad_slot = slots - 1 - zero_slot

    def check_integrity(self) -> None:
        """Assert that the zero slot is still zero (a device sync)."""
        if self.zero_slot is not None:
            dirty = [key for key, t in self.tensors.items() if t[self.zero_slot].any()]
            assert not dirty, f"the zero state slot was written: {dirty}"

    @property
    def nbytes(self) -> int:
        """Bytes every slot of every state takes."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def copy_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the states of slots `src` into slots `dst` (a fork's children start where the prompt ended)."""
        for t in self.tensors.values():
            t.index_copy_(0, dst, t.index_select(0, src))
