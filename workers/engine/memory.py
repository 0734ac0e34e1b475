"""How big the KV cache is, in which dtype the model runs, and host memory pinned in whole pages."""

from __future__ import annotations

import logging
import math
import mmap
import os
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch
import transformers

from rollout import config
from rollout.config import EngineConfig
from workers.engine.sequence import cdiv

logger = logging.getLogger(__name__)

DTYPES = {name: getattr(torch, name) for name in config.DTYPES if name != "auto"}
PAGE = mmap.PAGESIZE  # host memory is page-locked in whole pages
CPU_KV_SHARE = 0.2  # of the memory available at start, for the default CPU KV cache
CPU_KV_CAP_GIB = 4.0  # so that two default workers sit comfortably on a 24 GiB machine
# pools this big are faulted in on threads before they are registered: 4 GiB took 2.05 s registered as mapped,
# 0.39 s written first by 16 threads (H200 host, scripts/bench_pin.py, tenth GPU session)
THREADED_FAULT_BYTES = 64 << 20
FAULT_THREADS = min(16, os.cpu_count() or 1)


def available_ram_bytes() -> int:
    """Physical memory new allocations can take without swapping: Linux's MemAvailable (free memory and the
    page cache the kernel can drop, such as a checkpoint just read), else the free pages (macOS)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_device(name: str) -> torch.device:
    """`EngineConfig.device` as a torch device; ValueError naming it where this process has no such device (a
    CPU build of torch, no GPU visible, an index past the last GPU) rather than torch's error from deep inside."""
    device = torch.device(name)
    count = torch.cuda.device_count() if device.type == "cuda" else 0
    if device.type == "cuda" and (device.index or 0) >= count:
        why = "this torch is a CPU build" if not torch.backends.cuda.is_built() else f"{count} CUDA devices are visible"
        raise ValueError(f"EngineConfig.device={name!r} is not a device here: {why}")
    return device


def resolve_dtype(config: EngineConfig, hf_config: transformers.PretrainedConfig) -> torch.dtype:
    """`config.dtype`, where "auto" is the checkpoint's 16-bit dtype (else bfloat16) on CUDA and
    float32 on the CPU."""
    if config.dtype != "auto":
        return DTYPES[config.dtype]
    if not config.device.startswith("cuda"):
        return torch.float32
    saved = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    saved = DTYPES.get(saved, saved) if isinstance(saved, str) else saved
    return saved if saved in (torch.bfloat16, torch.float16) else torch.bfloat16


def kv_budget_bytes(config: EngineConfig, profile_peak: Callable[[], int]) -> int:
    """Bytes the KV cache may take: `kv_cache_memory_gib` when set; else on CUDA the card's
    `gpu_memory_utilization` minus the profiled peak and memory held outside torch; else a capped
    share of free memory."""
    if config.kv_cache_memory_gib is not None:
        return int(config.kv_cache_memory_gib * 2**30)
    if config.device.startswith("cuda"):
        peak = profile_peak()
        free, total = torch.cuda.mem_get_info(config.device)
        outside_torch = total - free - torch.cuda.memory_reserved(config.device)
        return int(total * config.gpu_memory_utilization) - peak - outside_torch
    return int(min(available_ram_bytes() * CPU_KV_SHARE, CPU_KV_CAP_GIB * 2**30))


def num_cache_blocks(config: EngineConfig, budget: int, bytes_per_block: int, max_model_len: int) -> int:
    """Blocks the budget holds, never more than `max_num_seqs` sequences of `max_model_len` need (the K/V of
    all but its last token, which is sampled and never computed); ValueError when not even one such sequence fits."""
    per_seq = max(1, cdiv(max_model_len - 1, config.block_size))
    blocks = max(0, budget) // bytes_per_block
    if blocks < per_seq:
        raise ValueError(
            f"the KV cache budget of {budget / 2**30:.3f} GiB holds {blocks} blocks of {config.block_size} "
            f"tokens ({bytes_per_block} bytes each), fewer than the {per_seq} one sequence of "
            f"max_model_len={max_model_len} tokens needs; raise kv_cache_memory_gib or "
            f"gpu_memory_utilization, or lower max_model_len")
    return min(blocks, per_seq * config.max_num_seqs)


def check_set_cache(num_blocks: int, nbytes: int, device: torch.device) -> None:
    """ValueError naming `num_blocks`, as set, when its cache of `nbytes` exceeds the memory free on `device`
    now (on a card, with what torch's allocator holds unused): the allocator's own error names no setting, and on
    the CPU a cache of untouched pages would be allocated, then killed for memory once filled."""
    if device.type == "cpu":
        free = available_ram_bytes()
    else:
        free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)
        free -= torch.cuda.memory_allocated(device)
    if nbytes > free:
        raise ValueError(f"EngineConfig.num_blocks={num_blocks} needs a KV cache of {nbytes / 2**30:.2f} GiB; the "
                         f"{device.type} has {free / 2**30:.2f} GiB free (unset, num_blocks fits the memory)")


def log_cache(num_blocks: int, block_size: int, bytes_per_block: int, sized: bool) -> None:
    """Say once how big the KV cache is, in blocks, tokens and GiB."""
    how = "sized automatically" if sized else "num_blocks as configured"
    logger.info("KV cache: %d blocks x %d tokens = %d tokens, %.3f GiB (%s)", num_blocks, block_size,
                num_blocks * block_size, num_blocks * bytes_per_block / 2**30, how)


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised host tensor, page-locked for a CUDA `device` to its size rounded up to whole pages
    (torch's pinned allocator would round it up to a power of two). It owns a mapping of its own, so the
    locked pages hold nothing else and torch sees the tensor as pinned."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not (device.type == "cuda" and nbytes):
        return torch.empty(shape, dtype=dtype)
    locked = cdiv(nbytes, PAGE) * PAGE
    pages = torch.frombuffer(mmap.mmap(-1, locked, flags=mmap.MAP_PRIVATE), dtype=torch.uint8)
    if locked >= THREADED_FAULT_BYTES:
        fault_in(pages, FAULT_THREADS)
    pin_pages(pages, device)
    tensor = pages[:nbytes].view(dtype).view(shape)
    weakref.finalize(tensor, unpin_pages, pages.data_ptr(), device)
    return tensor


def fault_in(pages: torch.Tensor, threads: int) -> None:
    """Write a zero into every page of `pages` (uint8) on `threads` threads, torch releasing the GIL: the
    kernel then maps and zeroes pages in parallel, where cudaHostRegister would fault them in one by one."""
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda chunk: chunk[::PAGE].fill_(0), pages.chunk(16 * threads)))


def pin_pages(pages: torch.Tensor, device: torch.device) -> None:
    """Page-lock `pages` (uint8, whole pages) for `device` with cudaHostRegister, which faults each page in
    first. A failure is raised here, and CUDA's last error cleared, so no later CUDA call is blamed for it."""
    err = torch.cuda.cudart().cudaHostRegister(pages.data_ptr(), pages.numel(), 0)
    if int(err) != 0:
        clear_last_error(device)
        raise RuntimeError(f"cudaHostRegister of {pages.numel()} bytes failed with CUDA error {int(err)}")


def clear_last_error(device: torch.device) -> None:
    """Reset CUDA's last error, which a failed cudaHostRegister leaves set: torch's check after a kernel launch
    reads and resets it (raising it, which is caught here). torch binds no cudaGetLastError of its own."""
    try:
        torch.empty(1, device=device).zero_()
    except RuntimeError:
        pass


def unpin_pages(address: int, device: torch.device) -> None:
    """Unlock pages once `device` has finished every copy queued on them (a dropped CPU pool may still
    have offloads in flight on its copy stream). They are unlocked even if the sync fails: pages left
    registered when their mapping goes would fail a later cudaHostRegister at the same address."""
    try:
        torch.cuda.synchronize(device)
    finally:
        torch.cuda.cudart().cudaHostUnregister(address)
