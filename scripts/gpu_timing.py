"""One GPU call timed two ways, for the kernel benchmarks.

Eager (Triton's `do_bench`): the call launched from Python after an L2 flush. When the call's launches take
the host longer than the flush takes the device, the device waits for them, and the time counts the host
too: a call of several short launches looks slower than it runs. Graph: the call captured once in a CUDA
graph, each replay after an L2 flush, timed between events around the replay alone: the device time, as the
engine's decode graphs run it.
"""

from __future__ import annotations

import statistics
from typing import Callable, NamedTuple

import torch

from workers.engine.graphs import HostSync, raise_on_host_sync

FLUSH_BYTES = 256 * 2**20  # more than any card's L2 (50 MiB on an H100), as Triton's do_bench flushes
REP_MS = 100.0


class Timed(NamedTuple):
    """A call's median ms replayed from a graph (None when it cannot be captured, `why` saying so) and eager."""

    graph: float | None
    eager: float
    why: str

    @property
    def ms(self) -> float:
        """The graph's time where there is one (the device time), else the eager one."""
        return self.eager if self.graph is None else self.graph

    def cells(self) -> tuple[str, str]:
        """The two times in us for a table row, "-" for no graph."""
        return ("-" if self.graph is None else f"{self.graph * 1e3:.1f}"), f"{self.eager * 1e3:.1f}"

    def note(self, label: str) -> str | None:
        """A line saying why `label` has no graph time, or None."""
        return f"    no graph for {label}: {self.why}" if self.why else None


def time_call(call: Callable[[], object]) -> Timed:
    """`call` timed both ways."""
    graph, why = graph_ms(call)
    return Timed(graph, eager_ms(call), why)


def eager_ms(call: Callable[[], object]) -> float:
    """Median ms of `call` launched eagerly (Triton's `do_bench`)."""
    from triton.testing import do_bench
    return do_bench(call, return_mode="median")


def graph_ms(call: Callable[[], object]) -> tuple[float | None, str]:
    """(median ms of one replay of `call` captured in a CUDA graph, "") or (None, why it cannot be captured).
    `call` runs twice eagerly first (compiles, autotuning), the second time refusing host syncs."""
    try:
        raise_on_host_sync(call)
    except HostSync as err:
        return None, str(err)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    estimate = max(statistics.median(_replays(graph, flush, 5)), 1e-3)
    return statistics.median(_replays(graph, flush, min(1000, max(10, int(REP_MS / estimate))))), ""


def _replays(graph: torch.cuda.CUDAGraph, flush: torch.Tensor, n: int) -> list[float]:
    """ms of each of `n` replays, each after an L2 flush that the replay's timing leaves out."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for start, end in events:
        flush.zero_()
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]
