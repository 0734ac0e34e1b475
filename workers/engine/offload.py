"""The CPU pool: KV blocks (and the recurrent state, for a model with one) of offloaded sequences wait
here until they are restored.

On CUDA the pool is page-locked to its size in whole pages and every copy runs on one copy stream, ordered
with the compute stream by waits on both sides: a device block freed by an offload is written again
only by compute work queued after its copy, and copies that touch one CPU slot run in queue order on
the copy stream, so a slot is never refilled before the copy that reads it. The host never touches
the pool's memory. On the CPU the same calls run synchronously.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import deque
from typing import Iterator

import numpy as np
import torch

from workers.engine.kv_cache import KvCache
from workers.engine.memory import available_ram_bytes, pinned_empty
from workers.engine.staging import Staging
from workers.engine.state_cache import StateCache

SAFE_RAM_FRACTION = 0.5
STATE_SHARE = 0.5  # of the pool, at most, for recurrent-state slots (one per offloaded sequence)


def cpu_pool_bytes(gib: float) -> int:
    """`gib` GiB in bytes, capped at a safe fraction of available RAM (with a warning)."""
    cap = int(available_ram_bytes() * SAFE_RAM_FRACTION)
    if gib * 2**30 > cap:  # compared as floats: a huge finite `gib` overflows int()
        warnings.warn(f"cpu_offload_gib={gib} exceeds {SAFE_RAM_FRACTION:.0%} of available RAM; "
                      f"the CPU pool gets at most {cap / 2**30:.2f} GiB", stacklevel=3)
        return cap
    return int(gib * 2**30)


def runs(slots: list[int]) -> Iterator[tuple[int, int, int]]:
    """(first pair index, first slot, length) of each run of consecutive CPU slots."""
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            yield start, slots[start], i - start
            start = i


class CpuPool:
    """Per tensor of the device cache, `[num_blocks, layers, 2, block_size, kv_heads, head_dim]`: each CPU
    block is contiguous, so runs of slots move in single copies. With `states`, up to `STATE_SHARE` of the
    pool holds state slots, one per offloaded sequence and at most `max_seqs`; never more than `max_blocks`
    blocks (what every sequence could hold: a model without attention has tiny placeholder blocks)."""

    def __init__(self, kv_cache: KvCache, gib: float, states: StateCache | None = None, max_seqs: int = 0,
                 max_blocks: int | None = None) -> None:
        self.kv_cache = kv_cache
        self.bytes_per_block = kv_cache.bytes_per_block
        budget = cpu_pool_bytes(gib)
        self.states = states
        per_slot = states.nbytes // states.num_slots if states else 0
        num_states = min(max_seqs, int(budget * STATE_SHARE) // per_slot) if states else 0
        self.state_slots = {key: pinned_empty((num_states, *t.shape[1:]), t.dtype, t.device)
                            for key, t in states.tensors.items()} if states else {}
        self.num_states = num_states
        self.free_states: deque[int] = deque(range(num_states))
        self.num_blocks = (budget - num_states * per_slot) // self.bytes_per_block
        if max_blocks is not None:
            self.num_blocks = min(self.num_blocks, max_blocks)
        if gib > 0 and states and not num_states:  # no sequence could be offloaded: no block is kept either
            self.num_blocks = 0
            warnings.warn(f"cpu_offload_gib={gib} holds no per-sequence state slot ({per_slot} bytes each, in at "
                          f"most {STATE_SHARE:.0%} of the pool): preempted requests are recomputed; offloading one "
                          f"needs at least {per_slot / STATE_SHARE / 2**30:.4g} GiB", stacklevel=3)
        elif gib > 0 and self.num_blocks <= 0:
            warnings.warn(f"cpu_offload_gib={gib} holds no KV block ({self.bytes_per_block} bytes each): "
                          "preempted requests are recomputed", stacklevel=3)
        self.blocks = [pinned_empty((self.num_blocks, *t.shape[:2], *t.shape[3:]), kv_cache.dtype, kv_cache.device)
                       for t in kv_cache.tensors]
        self.free: deque[int] = deque(range(self.num_blocks))
        self.staging = Staging(kv_cache.device)
        self.stream = torch.cuda.Stream(kv_cache.device) if kv_cache.is_cuda else None

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds (and pins, on CUDA)."""
        return sum(b.numel() * b.element_size() for b in self.blocks)

    @property
    def num_free(self) -> int:
        """CPU blocks not holding an offloaded block."""
        return len(self.free)

    @property
    def num_used(self) -> int:
        """CPU blocks holding offloaded KV."""
        return self.num_blocks - len(self.free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free CPU blocks (in ascending runs where the free list allows)."""
        if n > len(self.free):
            raise RuntimeError(f"asked for {n} CPU blocks, only {len(self.free)} free")
        return [self.free.popleft() for _ in range(n)]

    def release(self, blocks: list[int]) -> None:
        """Give CPU blocks back to the pool."""
        self.free.extend(blocks)

    @contextlib.contextmanager
    def _on_copy_stream(self) -> Iterator[None]:
        if self.stream is None:
            yield
            return
        compute = torch.cuda.current_stream(self.kv_cache.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            yield
        compute.wait_stream(self.stream)

    def copy_to_cpu(self, pairs: list[tuple[int, int]], states: list[tuple[int, int]] = ()) -> None:
        """Device block -> CPU block for each (device, cpu) pair: one gather, then a copy per run; and the
        recurrent state of each (row, state slot) pair."""
        if states:
            self._states_out(states)
        if not pairs:
            return
        device_ids = self.staging.send({"ids": np.array([d for d, _ in pairs], np.int64)})["ids"]
        with self._on_copy_stream():
            spans = list(runs([c for _, c in pairs]))
            for blocks, gathered in zip(self.blocks, self.kv_cache.gather(device_ids)):
                for first, slot, n in spans:
                    blocks[slot:slot + n].copy_(gathered[first:first + n], non_blocking=True)

    def copy_to_device(self, pairs: list[tuple[int, int]], states: list[tuple[int, int]] = ()) -> None:
        """CPU block -> device block for each (cpu, device) pair: a copy per run, then one scatter; and the
        recurrent state of each (state slot, row) pair."""
        if states:
            self._states_in(states)
        if not pairs:
            return
        device_ids = self.staging.send({"ids": np.array([d for _, d in pairs], np.int64)})["ids"]
        with self._on_copy_stream():
            moved = [torch.empty((len(pairs), *b.shape[1:]), dtype=b.dtype, device=self.kv_cache.device)
                     for b in self.blocks]
            spans = list(runs([c for c, _ in pairs]))
            for blocks, dst in zip(self.blocks, moved):
                for first, slot, n in spans:
                    dst[first:first + n].copy_(blocks[slot:slot + n], non_blocking=True)
            self.kv_cache.scatter(device_ids, moved)

    def take_state(self) -> int | None:
        """A free state slot, or None when every one holds an offloaded sequence's state."""
        return self.free_states.popleft() if self.free_states else None

    def release_state(self, slot: int) -> None:
        """Give a state slot back."""
        self.free_states.append(slot)

    def _states_out(self, pairs: list[tuple[int, int]]) -> None:
        """The recurrent state of each (device row, state slot) pair, copied into the slot."""
        rows = self.staging.send({"rows": np.array([r for r, _ in pairs], np.int64)})["rows"]
        with self._on_copy_stream():
            for key, slots in self.state_slots.items():
                gathered = self.states.tensors[key].index_select(0, rows)
                for i, (_, slot) in enumerate(pairs):
                    slots[slot].copy_(gathered[i], non_blocking=True)

    def _states_in(self, pairs: list[tuple[int, int]]) -> None:
        """The recurrent state in each (state slot, device row) pair's slot, copied into the row."""
        rows = self.staging.send({"rows": np.array([r for _, r in pairs], np.int64)})["rows"]
        with self._on_copy_stream():
            for key, slots in self.state_slots.items():
                device = self.states.tensors[key]
                moved = torch.empty((len(pairs), *device.shape[1:]), dtype=device.dtype, device=device.device)
                for i, (slot, _) in enumerate(pairs):
                    moved[i].copy_(slots[slot], non_blocking=True)
                device.index_copy_(0, rows, moved)
