"""How long pinning the CPU pool takes, and where the time goes.

The engine pins its CPU pool with `workers.engine.memory.pinned_empty`: a fresh anonymous mapping, registered
with cudaHostRegister. Registering faults every page in (and the kernel zeroes it) one by one before locking it:
pinning 16 GiB that way took 6.0-6.3 s of an engine's start-up on an H200 (docs/benchmarks.md, ninth GPU session).
Ways compared, each on a fresh mapping of --gib GiB:
  register         cudaHostRegister faults the pages in itself (the engine's way until the tenth GPU session)
  touch xT         the pages written first by T threads (`fault_in`), then registered: the engine's way now for
                   pools of 64 MiB or more, on min(16, CPUs) threads
  hugepage         transparent huge pages asked for (madvise), written by the most threads, then registered
  cudaHostAlloc    torch's pinned allocator (sizes rounded up to a power of two), for reference
Each row: seconds faulting the pages in, seconds registering, GiB/s overall, and the host-to-device copy rate
from the pinned pages (a way that copies slower is no win). Without CUDA only the faulting is timed.

Usage: python scripts/bench_pin.py [--gib 4] [--threads 1 4 16]
"""

from __future__ import annotations

import argparse
import mmap
import time

import torch
from arg_types import positive_float, positive_int

from workers.engine.memory import PAGE, fault_in, pin_pages, unpin_pages

ROW = "{:<16} {:>9} {:>11} {:>9} {:>14}"


def parse_args() -> argparse.Namespace:
    """The size pinned and the thread counts that fault pages in."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=positive_float, default=4.0, help="GiB pinned by each way (default 4)")
    parser.add_argument("--threads", type=positive_int, nargs="+", default=[1, 4, 16],
                        help="threads that write the pages before registering (default 1 4 16)")
    return parser.parse_args()


def fresh_pages(nbytes: int, huge: bool) -> torch.Tensor:
    """An anonymous private mapping of `nbytes`, as `pinned_empty` makes, optionally backed by huge pages."""
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    if huge:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(mapping, dtype=torch.uint8)


def timed_fault_in(pages: torch.Tensor, threads: int) -> float:
    """Seconds the engine's `fault_in` takes on `threads` threads to write one byte of every page."""
    start = time.perf_counter()
    fault_in(pages, threads)
    return time.perf_counter() - start


def register(pages: torch.Tensor) -> float:
    """Seconds the engine's `pin_pages` takes to lock `pages` (0 without CUDA)."""
    if not torch.cuda.is_available():
        return 0.0
    start = time.perf_counter()
    pin_pages(pages, torch.device("cuda"))
    return time.perf_counter() - start


def copy_rate(pages: torch.Tensor) -> float:
    """GiB/s of host-to-device copies of 256 MiB from `pages` (0 without CUDA)."""
    if not torch.cuda.is_available():
        return 0.0
    source = pages[: min(pages.numel(), 256 << 20)]
    target = torch.empty_like(source, device="cuda")
    target.copy_(source, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        target.copy_(source, non_blocking=True)
    torch.cuda.synchronize()
    return 5 * source.numel() / 2**30 / (time.perf_counter() - start)


def mapped_row(name: str, nbytes: int, threads: int, huge: bool) -> tuple:
    """One way through a fresh mapping: faulted in by `threads` threads first (0: by the registration)."""
    pages = fresh_pages(nbytes, huge)
    touch = timed_fault_in(pages, threads) if threads else 0.0
    lock = register(pages)
    rate = copy_rate(pages)
    if torch.cuda.is_available():
        unpin_pages(pages.data_ptr(), torch.device("cuda"))
    return name, touch, lock, rate


def host_alloc_row(nbytes: int) -> tuple:
    """torch's pinned allocator, its cache emptied afterwards."""
    start = time.perf_counter()
    pages = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    seconds = time.perf_counter() - start
    rate = copy_rate(pages)
    del pages
    torch._C._host_emptyCache()
    return "cudaHostAlloc", 0.0, seconds, rate


def main() -> None:
    """Time each way and print the table."""
    args = parse_args()
    nbytes = int(args.gib * 2**30) // PAGE * PAGE
    cuda = torch.cuda.is_available()
    print(f"{torch.cuda.get_device_name() if cuda else 'no CUDA: faulting only'}, {args.gib:g} GiB per way, "
          f"page {PAGE} bytes, transparent huge pages: {thp_mode()}")
    print(ROW.format("way", "fault s", "register s", "GiB/s", "copy GiB/s"))
    rows = [mapped_row("register", nbytes, 0, False)] if cuda else []
    rows += [mapped_row(f"touch x{t}", nbytes, t, False) for t in args.threads]
    rows.append(mapped_row("hugepage", nbytes, max(args.threads), True))
    if cuda:
        rows.append(host_alloc_row(nbytes))
    for name, touch, lock, rate in rows:
        print(ROW.format(name, f"{touch:.2f}", f"{lock:.2f}", f"{nbytes / 2**30 / (touch + lock):.2f}",
                         f"{rate:.1f}" if cuda else "-"))


def thp_mode() -> str:
    """The kernel's transparent-huge-page setting (the bracketed word), or 'unknown'."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "unknown"


if __name__ == "__main__":
    main()
