"""A step's small inputs, computed on the host from sequence state as arrays for one device copy."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from workers.engine.block_table import BlockTables
from workers.engine.sampler import RowParams, SamplingFlags, expanded_rows, sampling_arrays
from workers.engine.sequence import Sequence, cdiv
from workers.engine.window_ring import ring_slots


@dataclass
class StepPlan:
    """Host arrays of one step (named as the device tensors they become) and the host scalars that
    pick kernel shapes: the block-table width, the longest query and the longest sequence."""

    arrays: dict[str, np.ndarray]
    flags: SamplingFlags
    num_rows: int  # sampling rows: one per wanted sample of each sequence that reaches its end
    width: int
    max_seqlen_q: int
    max_seqlen_k: int
    expand: bool  # forks: several sampling rows read one kept row of logits
    tables: torch.Tensor | None = None  # block tables of a synthetic step (profile, warm-up)


def plan_step(seqs: list[Sequence], num_tokens: list[int], tables: BlockTables, params: RowParams,
              token_lengths: bool = False, ring_tokens: int = 0) -> StepPlan:
    """Ids, positions, cache slots, `cu_seqlens_q`, `seq_lens`, table rows, kept rows and sampling
    parameters of `num_tokens[i]` new tokens of each `seqs[i]`; with `token_lengths`, also the full
    length of each packed token's sequence (per-sequence LongRoPE); with `ring_tokens`, each token's slot
    in its row's ring of that many tokens (window_ring.py)."""
    rows, width, new = tables.sync(seqs)
    for seq in new:
        params.write(seq)
    counts = np.array(num_tokens, np.int64)
    starts = np.array([seq.num_computed_tokens for seq in seqs], np.int64)
    lengths = np.array([len(seq.token_ids) for seq in seqs], np.int64)
    cu = np.zeros(len(seqs) + 1, np.int64)
    np.cumsum(counts, out=cu[1:])
    positions = np.repeat(starts - cu[:-1], counts) + np.arange(cu[-1])
    bs = tables.block_size
    slots = tables.array[np.repeat(rows, counts), positions // bs].astype(np.int64) * bs + positions % bs
    seq_lens = starts + counts
    ends = np.flatnonzero(seq_lens == lengths)
    sampling, flags, logits_rows = _sampling(seqs, ends, rows, lengths, params)
    cells, table_values = tables.take_changes()
    ids = np.array(_token_ids(seqs, starts, num_tokens, cu), np.int64)
    arrays = {"ids": ids, "positions": positions,
              "slots": slots, "cu_seqlens_q": cu.astype(np.int32), "seq_lens": seq_lens.astype(np.int32),
              "rows": rows, "keep": cu[1:][ends] - 1, "logits_rows": logits_rows, "table_cells": cells,
              "table_values": table_values, **sampling}
    if token_lengths:
        arrays["token_lengths"] = np.repeat(lengths, counts)
    if ring_tokens:
        arrays["ring_slots"] = ring_slots(np.repeat(rows, counts), positions, ring_tokens)
    holes = np.flatnonzero(ids < 0)
    if holes.size:  # placeholders (pipeline.py): filled on the device from these rows of the last step
        arrays["fill_at"], arrays["fill_from"] = holes, -1 - ids[holes]
    return StepPlan(arrays, flags, logits_rows.size, width, int(counts.max()), int(seq_lens.max()),
                    expand=logits_rows.size != ends.size)


def _sampling(seqs: list[Sequence], ends: np.ndarray, rows: np.ndarray, lengths: np.ndarray,
              params: RowParams) -> tuple[dict[str, np.ndarray], SamplingFlags, np.ndarray]:
    """Sampling arrays and flags of the sequences `ends` (those that reach their end), and which of
    their logits each sampling row reads: gathered by table row when each is one sample; an unforked
    prompt has a row per wanted sample, all reading its logits."""
    sampled = ends.tolist()
    if any(len(seqs[i].sample_indices) > 1 for i in sampled):
        values, keys, logits_rows = expanded_rows([seqs[i] for i in sampled])
    else:
        values, keys, logits_rows = params.values[rows[ends]], params.keys[rows[ends]], np.arange(ends.size)
    return *sampling_arrays(values, keys, lengths[ends][logits_rows]), logits_rows


def _token_ids(seqs: list[Sequence], starts: np.ndarray, num_tokens: list[int], cu: np.ndarray) -> list[int]:
    """The tokens each sequence computes this step, packed (one read per sequence when all decode)."""
    starts = starts.tolist()
    if cu[-1] == len(seqs):
        return [seq.token_ids[start] for seq, start in zip(seqs, starts)]
    return [t for seq, a, n in zip(seqs, starts, num_tokens) for t in seq.token_ids[a:a + n]]


def profile_plan(num_tokens: int, num_rows: int, block_size: int, ring_tokens: int = 0,
                 context: int = 0, num_blocks: int | None = None) -> StepPlan:
    """A synthetic step: one sequence of `num_tokens` prompt tokens after `context` cached ones, over
    blocks 0, 1, ... (wrapping round a cache of `num_blocks`, when given: a warm-up's step may be longer
    than a tiny cache), and row 0's ring, of `ring_tokens`, and `num_rows` sampling rows with every filter
    on (the sampler's most memory-hungry path)."""
    length = context + num_tokens
    width = cdiv(length, block_size)
    keep = np.arange(max(0, num_tokens - num_rows), num_tokens, dtype=np.int64)
    uniform = np.linspace(0, 1, num_rows, endpoint=False)
    full = np.ones(num_rows)
    positions = np.arange(context, length, dtype=np.int64)
    wrap = (num_blocks or width) * block_size
    arrays = {"ids": np.zeros(num_tokens, np.int64), "positions": positions,
              "slots": positions % wrap, "cu_seqlens_q": np.array([0, num_tokens], np.int32),
              "seq_lens": np.array([length], np.int32), "rows": np.zeros(1, np.int64), "keep": keep,
              "logits_rows": np.arange(num_rows, dtype=np.int64) % keep.size,
              "table_cells": np.zeros(0, np.int64), "table_values": np.zeros(0, np.int32),
              "temperature": (0.7 * full).astype(np.float32), "top_k": (50 * full).astype(np.int64),
              "top_p": (0.9 * full).astype(np.float32), "min_p": (0.01 * full).astype(np.float32),
              "uniform": uniform, "raw_logprobs": np.zeros(num_rows, np.bool_)}
    if ring_tokens:
        arrays["ring_slots"] = ring_slots(np.zeros(num_tokens, np.int64), arrays["positions"], ring_tokens)
    flags = SamplingFlags(scale=True, max_top_k=50, top_k1=False, top_p=True, min_p=True, all_greedy=False,
                          any_greedy=False, any_raw=False)
    tables = (torch.arange(width, dtype=torch.int32) % (num_blocks or width))[None]
    return StepPlan(arrays, flags, num_rows, width, num_tokens, length, expand=True, tables=tables)
