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
model with rings. Their memory is fixed: `max_num_seqs + 1` rings per ring layer, whatever the sequences'
lengths. `EngineConfig.windowed_kv="auto"` keeps windows in rings when one ring holds at most half of
`max_model_len` tokens (at full length, the windowed layers then take at most half of what they would).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from workers.engine.kv_cache import KvLayout
from workers.engine.recurrent import StateCache, StateKey
from workers.engine.sequence import cdiv

RING_KEYS = ("ring_k", "ring_v")
MIN_CHUNK = 256  # the fewest prompt tokens a sequence may compute per step with rings (at most max_batch_tokens)


class RingPlan(NamedTuple):
    """The cache layout with its ring layers marked, the blocks of one ring (0: no rings), and the most
    tokens one sequence may compute in a step (None: no cap below max_batch_tokens)."""

    layout: KvLayout
    blocks: int = 0
    chunk: int | None = None


def plan_rings(layout: KvLayout, mode: str, max_batch_tokens: int, block_size: int, max_model_len: int) -> RingPlan:
    """Which layers keep only their window under `mode` ("auto", "window", "full"), and their rings' size."""
    layers = ring_candidates(layout)
    if mode == "full" or not layers:
        return RingPlan(layout)
    window = max(layout.windows[layer] for layer in layers)
    chunk = min(max_batch_tokens, max(window, MIN_CHUNK))
    blocks = cdiv(window - 1 + chunk, block_size)
    if mode == "auto" and 2 * blocks * block_size > max_model_len:
        return RingPlan(layout)
    return RingPlan(layout._replace(rings=frozenset(layers)), blocks, chunk)


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
