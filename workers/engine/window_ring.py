"""Sliding-window layers that keep only their window: a ring of KV blocks per block-table row.

A layer with window W reads, for a query at position q, keys q - W + 1 .. q only. Kept in a ring of
`ring_blocks` blocks per row, position p of row r sits in ring block `r * ring_blocks + (p // block_size) %
ring_blocks` at offset `p % block_size`. A step adds at most `chunk` tokens to a sequence (the scheduler caps
prefill chunks at `max(W, MIN_CHUNK)`, within `max_batch_tokens`), so a ring of W - 1 + chunk tokens holds
every key any query of a step reads, and the step's own writes only overwrite keys older than all of them.
A ring layer's block table is a fixed function of the row, and the kernels run unchanged: they take each
key's position from its table column and mask what lies outside the window, whatever its slot holds now.

Rings are per-row state, like a recurrent layer's (recurrent.py): they live in the same StateCache, so a
fork copies the prompt's ring to each child, an offload moves it to the CPU pool with the sequence, and a
recompute writes it afresh. A cached prefix would come without its window, so prefix caching is off for a
model with rings. Their memory is fixed, `max_num_seqs + 1` rings per ring layer whatever the sequences'
lengths, and comes out of the KV cache's budget. `EngineConfig.windowed_kv="auto"` keeps windows in rings
only where that costs no capacity: when the rings fit in the tokens a cache of every token would hold in
the budget, the paged blocks left (which no longer hold the windowed layers) hold at least as many tokens.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import numpy as np
import torch

from rollout.config import EngineConfig
from workers.engine.kv_cache import KvLayout
from workers.engine.sequence import cdiv
from workers.engine.state_cache import StateCache, StateKey

logger = logging.getLogger(__name__)

RING_KEYS = ("ring_k", "ring_v")
MIN_CHUNK = 256  # the fewest prompt tokens a sequence may compute per step with rings (at most max_batch_tokens)


class RingPlan(NamedTuple):
    """The cache layout with its ring layers marked, the blocks of one ring (0: no rings), and the most
    tokens one sequence may compute in a step (None: no cap below max_batch_tokens)."""

    layout: KvLayout
    blocks: int = 0
    chunk: int | None = None


def plan_rings(layout: KvLayout, mode: str, max_batch_tokens: int, block_size: int) -> RingPlan:
    """Which layers may keep only their window under `mode` ("auto", "window", "full"), and their rings' size."""
    layers = ring_candidates(layout)
    if mode == "full" or not layers:
        return RingPlan(layout)
    window = max(layout.windows[layer] for layer in layers)
    chunk = min(max_batch_tokens, max(window, MIN_CHUNK))
    return RingPlan(layout._replace(rings=frozenset(layers)), cdiv(window - 1 + chunk, block_size), chunk)


def choose_rings(layout: KvLayout, config: EngineConfig, max_model_len: int, budget: int,
                 dtype: torch.dtype) -> RingPlan:
    """The rings `config.windowed_kv` asks for. Under "auto" only where they cost no capacity: `max_num_seqs + 1`
    rings fit in the tokens a cache of every token would hold in `budget` bytes, and a ring is shorter than
    `max_model_len`; else none (logged)."""
    plan = plan_rings(layout, config.windowed_kv, config.max_batch_tokens, config.block_size)
    if not plan.blocks or config.windowed_kv == "window":
        return plan
    ring_tokens, rows = plan.blocks * config.block_size, config.max_num_seqs + 1
    full_tokens = budget // layout.bytes_per_block(1, dtype)
    if ring_tokens < max_model_len and rows * ring_tokens <= full_tokens:
        return plan
    logger.info("windowed layers keep every token: %d rings of %d tokens would take more than the %d tokens a "
                "full cache holds in the budget (or a ring reaches max_model_len=%d); windowed_kv='window' "
                "forces rings", rows, ring_tokens, full_tokens, max_model_len)
    return RingPlan(layout)


def ring_candidates(layout: KvLayout) -> list[int]:
    """Layers storing K/V of their own under a sliding window that every layer reading that K/V shares (a
    layer reusing it with another window, or none, needs all of it); latent layers keep their cache."""
    windows, owners = layout.windows, layout.owners
    return [layer for layer, shape in enumerate(layout.shapes)
            if shape is not None and owners[layer] == layer and windows[layer]
            and layer not in layout.values_are_keys
            and all(windows[i] == windows[layer] for i, owner in enumerate(owners) if owner == layer)]


def ring_state_layout(layout: KvLayout, ring_blocks: int, block_size: int,
                      dtype: torch.dtype) -> dict[StateKey, tuple[torch.Size, torch.dtype]]:
    """The per-row state of the rings: K and V of `ring_blocks` blocks for each ring layer."""
    return {(layer, key, 0): (torch.Size((ring_blocks, block_size, *layout.shapes[layer])), dtype)
            for layer in sorted(layout.rings) for key in RING_KEYS}


def ring_views(states: StateCache, layout: KvLayout) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Each ring layer's K and V as `[rows * ring_blocks, block_size, kv_heads, head_dim]`, by ring block id."""
    return {layer: tuple(states.tensors[layer, key, 0].flatten(0, 1) for key in RING_KEYS)
            for layer in layout.rings}


def ring_slots(rows: np.ndarray, positions: np.ndarray, ring_tokens: int) -> np.ndarray:
    """The ring slot of each token (its row `rows[i]`, its position `positions[i]`)."""
    return rows * ring_tokens + positions % ring_tokens


def ring_table(rows: torch.Tensor, columns: torch.Tensor, ring_blocks: int) -> torch.Tensor:
    """The ring block table of `rows`: `columns` holds `arange(width) % ring_blocks` (int32)."""
    return (rows[:, None] * ring_blocks).to(torch.int32) + columns
