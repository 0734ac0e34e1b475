"""Decode CUDA graphs: one per (padded batch, KV-length bucket), replayed over static input buffers.

A decode step (one new token for each sequence) is padded to the smallest batch bucket that holds it:
padding tokens have slot -1 (never written), padding sequences have length 0 (`cu_seqlens_q` plateaus at the
real count) and zero block-table rows. Their attention output is defined, so no padding row computes on what
a previous replay left there: the torch backend attends each to key 0 of block 0, the Triton kernels write
zeros. A step's key is (batch bucket, KV bucket), the KV bucket being `max_seqlen_k` rounded up to a power of two
of at least MIN_KV_BUCKET. Every host scalar a backend bakes into a launch is a function of the key (the
torch backend's gather width, the Triton backend's split count), never of the step's own lengths, so a graph
captured at a key is exact for every step with that key. A key without the KV bucket is the bug of
transformers #45323: a graph captured for short sequences replayed for long ones. Keys of one batch bucket
whose scalars are equal (the backend's `graph_scalars`: the Triton split count, which is 1 at every KV
bucket once a batch fills the GPU) share one graph, so far fewer graphs are captured than there are keys.

On CUDA every graph is captured at start. On the CPU the same path runs eagerly: the static buffers are
refilled and the forward runs with the metadata its key was given at "capture", not recomputed.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import logging
import os
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rollout.config import EngineConfig
from workers.engine.attention import AttentionMetadata

if TYPE_CHECKING:
    from workers.engine.model_runner import ModelRunner, StepInputs

logger = logging.getLogger(__name__)

MIN_KV_BUCKET = 1024


def resolve(config: EngineConfig) -> tuple[bool, bool]:
    """`config.cuda_graphs` as (varlen, decode), None resolved: decode graphs on CUDA (but not over the torch
    reference attention, whose boolean indexing syncs with the host), none on the CPU. A model whose decode
    step waits on the host is found when its graphs are captured (HostSync)."""
    if config.cuda_graphs is not None:
        return config.cuda_graphs
    return False, config.device.startswith("cuda") and config.attention_backend != "torch"


class HostSync(RuntimeError):
    """A decode step waits on the host (a data-dependent shape, a copy to or from pageable host memory),
    which a CUDA graph capture refuses; the message names the model's line that waits."""


def raise_on_host_sync(launch: Callable[[], None]) -> None:
    """Run `launch` on CUDA twice, the second time under torch's sync debug mode, which raises at the first
    operation that waits on the host: HostSync naming it, before a capture would fail on it (less clearly,
    and leaving the capture stream in an error state). The first launch may wait: what a model sets up on
    first use (a cache, a compile, an autotuner's timings) happens once, before any capture."""
    launch()
    previous = torch.cuda.get_sync_debug_mode()
    _set_sync_debug_mode("error")
    try:
        launch()
    except RuntimeError as err:
        if "synchronizing" not in str(err):
            raise
        raise HostSync(host_sync_message(err)) from err
    finally:
        _set_sync_debug_mode(previous)


def _set_sync_debug_mode(mode: str | int) -> None:
    """torch's setter without its warning that the mode is a prototype which misses some syncs (a capture
    still fails on those, naming the key)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype")
        torch.cuda.set_sync_debug_mode(mode)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Collect garbage now, then keep Python's cyclic collector off until the block ends. A finalizer the
    collector runs mid-capture (a dropped engine's CPU pool syncs the device before unpinning it) would
    invalidate the capture; torch 2.11's `torch.cuda.graph` no longer collects before capturing."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def host_sync_message(err: BaseException) -> str:
    """Which line of the model (the innermost frame outside torch) made the operation in `err` wait."""
    torch_dir = os.path.dirname(torch.__file__) + os.sep
    frames = [f for f in traceback.extract_tb(err.__traceback__) if not f.filename.startswith(torch_dir)]
    if not frames:
        return "the decode step waits on the host, which a CUDA graph cannot capture"
    frame = frames[-1]
    where = f"{Path(frame.filename).parent.name}/{Path(frame.filename).name}:{frame.lineno}"
    where += f" ({frame.line})" if frame.line else ""
    hint = (" (transformers' MoE experts stay on the device in bfloat16 only)"
            if Path(frame.filename).name == "moe.py" else "")
    return f"the decode step waits on the host at {where}{hint}, which a CUDA graph cannot capture"


def batch_buckets(max_batch: int) -> list[int]:
    """Padded batch sizes: 1, 2, 4, 8, 16, then multiples of 16 below `max_batch`, and `max_batch`."""
    return sorted({b for b in (1, 2, 4, 8) if b < max_batch} | set(range(16, max_batch, 16)) | {max_batch})


def kv_bucket(max_seqlen_k: int) -> int:
    """`max_seqlen_k` rounded up to a power of two, at least MIN_KV_BUCKET."""
    return max(MIN_KV_BUCKET, 1 << (max_seqlen_k - 1).bit_length())


def kv_buckets(max_model_len: int) -> list[int]:
    """Every KV bucket of sequences of at most `max_model_len` tokens, smallest first."""
    return [MIN_KV_BUCKET << i for i in range((kv_bucket(max_model_len) // MIN_KV_BUCKET).bit_length())]


def graph_key(batch: int, kv: int) -> tuple[int, ...]:
    """The key of the graph of batch bucket `batch` and KV bucket `kv`: both fix host scalars of its launches."""
    return batch, kv


@dataclass
class _Graph:
    """One key's padded batch, the metadata its backend was given at capture, and its CUDA graph
    (None on the CPU, where the forward runs eagerly)."""

    batch: int
    meta: AttentionMetadata
    graph: torch.cuda.CUDAGraph | None = None


class DecodeGraphs:
    """Static decode inputs sized for the largest batch bucket, and one graph per key over views of them.

    Batch buckets stop at `min(max_num_seqs, max_batch_tokens)`: no decode step has more sequences.
    """

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        config = runner.config
        self.batch_sizes = batch_buckets(min(config.max_num_seqs, config.max_batch_tokens))
        self.kv_sizes = kv_buckets(runner.max_model_len)
        size, device = self.batch_sizes[-1], runner.device
        self.ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = torch.zeros_like(self.ids)
        self.slots = torch.full_like(self.ids, -1)
        self.cu_seqlens_q = torch.zeros(size + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(size, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(size, runner.tables.max_blocks, dtype=torch.int32, device=device)
        self.token_lengths = None if runner.rope_switch_length is None else torch.zeros_like(self.ids)
        # windowed layers' rings (window_ring.py): padding tokens write nowhere, padding rows read ring 0
        self.ring_slots = torch.full_like(self.ids, -1) if runner.ring_blocks else None
        self.ring_table = torch.zeros_like(self.block_table) if runner.ring_blocks else None
        # recurrent-state slots (recurrent.py); padding rows take the spare one
        self.pad_row = None if runner.states is None else runner.states.pad_slot
        self.rows = None if runner.states is None else torch.full_like(self.ids, self.pad_row)
        self.logits: torch.Tensor | None = None
        self.graphs: dict[tuple[int, ...], _Graph] = {}
        self.pool = None
        self.replays = 0  # decode steps served, for tests and benchmarks
        self.warmup_s = 0.0  # of capture_s: the warm-up launches, which compile kernel variants on first use
        self.num_captured = 0
        self.capture_s = self._capture_all()

    @torch.inference_mode()
    def _capture_all(self) -> float:
        """Capture every key's graph, largest first (smaller ones reuse the shared pool); seconds taken. The
        memory they reserve is logged: it comes out of the headroom KV sizing leaves."""
        cuda = self.runner.device.type == "cuda"
        reserved = torch.cuda.memory_reserved(self.runner.device) if cuda else 0
        start = time.perf_counter()
        captured: dict[tuple, _Graph] = {}
        with collector_paused() if cuda else contextlib.nullcontext():
            self._capture_keys(captured)
        seconds, self.num_captured = time.perf_counter() - start, len(captured)
        how = (f"captured, reserving {(torch.cuda.memory_reserved(self.runner.device) - reserved) / 2**30:.2f} GiB"
               if cuda else "set up (run eagerly on the CPU)")
        logger.info("decode graphs: %d %s for %d keys in %.2f s, %.2f s of it warm-up launches (batch buckets %s, "
                    "KV buckets %s)", len(captured), how, len(self.graphs), seconds, self.warmup_s, self.batch_sizes,
                    self.kv_sizes)
        return seconds

    def _capture_keys(self, captured: dict[tuple, _Graph]) -> None:
        """Fill `self.graphs` with every key's graph, captured once per distinct (batch, backend scalars)."""
        for batch in reversed(self.batch_sizes):
            for kv in reversed(self.kv_sizes):
                meta = AttentionMetadata(self.slots[:batch], self.cu_seqlens_q[:batch + 1], self.seq_lens[:batch],
                                         self.block_table[:batch], max_seqlen_q=1, max_seqlen_k=kv,
                                         decode_graph=True, rows=_head(self.rows, batch),
                                         ring_slot_mapping=_head(self.ring_slots, batch),
                                         ring_block_table=_head(self.ring_table, batch))
                scalars = (batch, *self.runner.backend.graph_scalars(meta))
                if scalars not in captured:
                    captured[scalars] = self._capture(batch, meta)
                self.graphs[graph_key(batch, kv)] = captured[scalars]

    def _capture(self, batch: int, meta: AttentionMetadata) -> _Graph:
        """The graph of one key: its metadata, and on CUDA its launches, after a warm-up run that compiles
        every kernel variant of the key (the buffers hold padding only: nothing is written) and raises
        HostSync if the step waits on the host."""
        entry = _Graph(batch, meta)
        if self.runner.device.type != "cuda":
            return entry
        start = time.perf_counter()
        raise_on_host_sync(lambda: self._launch(entry))
        torch.cuda.synchronize(self.runner.device)
        self.warmup_s += time.perf_counter() - start
        entry.graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(entry.graph, pool=self.pool):
                self._launch(entry)
        except RuntimeError as err:
            raise RuntimeError(f"capturing the decode graph of batch {batch}, KV bucket {meta.max_seqlen_k} failed: "
                               f"{err}; EngineConfig.cuda_graphs=(False, False) runs decode steps eagerly") from err
        if self.pool is None:
            self.pool = entry.graph.pool()
        return entry

    def _launch(self, entry: _Graph) -> None:
        """The padded forward of `entry` over the static buffers, its logits into `self.logits`."""
        n = entry.batch
        lengths = None if self.token_lengths is None else self.token_lengths[:n]
        logits = self.runner.model_forward(self.ids[:n], self.positions[:n], entry.meta, 0, lengths)
        if self.logits is None:
            self.logits = logits.new_empty(self.batch_sizes[-1], logits.shape[1])
        self.logits[:n] = logits

    def eligible(self, inputs: StepInputs) -> bool:
        """Whether a graph serves the step: one new token for each sequence, within the largest buckets."""
        meta = inputs.meta
        num_seqs = meta.seq_lens.shape[0]
        return (meta.max_seqlen_q == 1 and inputs.ids.shape[0] == num_seqs <= self.batch_sizes[-1]
                and meta.max_seqlen_k <= self.kv_sizes[-1])

    def replay(self, inputs: StepInputs) -> torch.Tensor:
        """Logits `[batch bucket, vocab]` of an eligible step (its rows first, then padding rows), from
        the graph of its key over the refilled static buffers; nothing waits on the device."""
        num_seqs = inputs.meta.seq_lens.shape[0]
        batch = self.batch_sizes[bisect.bisect_left(self.batch_sizes, num_seqs)]
        entry = self.graphs[graph_key(batch, kv_bucket(inputs.meta.max_seqlen_k))]
        self._fill(inputs, entry.batch)
        self.replays += 1
        if entry.graph is None:
            self._launch(entry)
        else:
            entry.graph.replay()
        return self.logits[:entry.batch]

    def _fill(self, inputs: StepInputs, batch: int) -> None:
        """Copy the step's inputs into the static buffers (device to device) and pad them to `batch`."""
        meta = inputs.meta
        n = meta.seq_lens.shape[0]
        for static, value in ((self.ids, inputs.ids), (self.positions, inputs.positions),
                              (self.slots, meta.slot_mapping), (self.seq_lens, meta.seq_lens)):
            static[:n].copy_(value)
        self.slots[n:batch].fill_(-1)
        self.seq_lens[n:batch].zero_()
        self.cu_seqlens_q[:n + 1].copy_(meta.cu_seqlens_q)
        self.cu_seqlens_q[n + 1:batch + 1].fill_(n)
        self.block_table[:n, :meta.block_table.shape[1]].copy_(meta.block_table)
        self.block_table[n:batch].zero_()
        if self.token_lengths is not None:
            self.token_lengths[:n].copy_(inputs.token_lengths)
            self.token_lengths[n:batch].zero_()
        if self.rows is not None:
            self.rows[:n].copy_(meta.rows)
            self.rows[n:batch].fill_(self.pad_row)
        if self.ring_slots is not None:
            self.ring_slots[:n].copy_(meta.ring_slot_mapping)
            self.ring_slots[n:batch].fill_(-1)
            self.ring_table[:n, :meta.ring_block_table.shape[1]].copy_(meta.ring_block_table)
            self.ring_table[n:batch].zero_()


def _head(buffer: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """The first `n` rows of a static buffer the model may not have."""
    return None if buffer is None else buffer[:n]
