"""The CPU swap pool: KV blocks of preempted requests wait here until they are restored."""

from __future__ import annotations

import os
import warnings
from collections import deque

import torch

SAFE_RAM_FRACTION = 0.5


def available_ram_bytes() -> int:
    """Physical memory not in use right now (Linux and macOS)."""
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cpu_pool_blocks(gib: float, bytes_per_block: int) -> int:
    """How many blocks `gib` GiB holds, capped at a safe fraction of free RAM (with a warning)."""
    want = int(gib * 2**30)
    cap = int(available_ram_bytes() * SAFE_RAM_FRACTION)
    if want > cap:
        warnings.warn(f"cpu_offload_gib={gib} exceeds {SAFE_RAM_FRACTION:.0%} of free RAM; "
                      f"the CPU swap pool is capped at {cap / 2**30:.2f} GiB", stacklevel=3)
        want = cap
    return want // bytes_per_block


class CpuPool:
    """Blocks shaped like the device cache's, allocated once (pinned when the cache is on CUDA)."""

    def __init__(self, kv_cache: torch.Tensor, gib: float) -> None:
        self.kv_cache = kv_cache
        per_block = kv_cache[:, :, 0].numel() * kv_cache.element_size()
        self.num_blocks = cpu_pool_blocks(gib, per_block)
        shape = (*kv_cache.shape[:2], self.num_blocks, *kv_cache.shape[3:])
        self.blocks = torch.zeros(shape, dtype=kv_cache.dtype, pin_memory=kv_cache.is_cuda)
        self.free: deque[int] = deque(range(self.num_blocks))

    @property
    def num_free(self) -> int:
        """CPU blocks not holding an offloaded block."""
        return len(self.free)

    @property
    def num_used(self) -> int:
        """CPU blocks holding offloaded KV."""
        return self.num_blocks - len(self.free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free CPU blocks."""
        if n > len(self.free):
            raise RuntimeError(f"asked for {n} CPU blocks, only {len(self.free)} free")
        return [self.free.popleft() for _ in range(n)]

    def release(self, blocks: list[int]) -> None:
        """Give CPU blocks back to the pool."""
        self.free.extend(blocks)

    def copy_out(self, pairs: list[tuple[int, int]]) -> None:
        """Device block -> CPU block for each (device, cpu) pair, as one gather and one copy."""
        if pairs:
            dev = torch.tensor([d for d, _ in pairs], device=self.kv_cache.device)
            cpu = torch.tensor([c for _, c in pairs])
            self.blocks[:, :, cpu] = self.kv_cache[:, :, dev].cpu()

    def copy_in(self, pairs: list[tuple[int, int]]) -> None:
        """CPU block -> device block for each (cpu, device) pair, as one copy and one scatter."""
        if pairs:
            cpu = torch.tensor([c for c, _ in pairs])
            dev = torch.tensor([d for _, d in pairs], device=self.kv_cache.device)
            self.kv_cache[:, :, dev] = self.blocks[:, :, cpu].to(self.kv_cache.device)
