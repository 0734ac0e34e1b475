"""The paged KV cache: per layer, K and V of `block_size` tokens per block, indexed by block id.

Layers whose K/V have one shape share a tensor `[layers, 2, num_blocks, block_size, kv_heads, head_dim]`,
so a model with a single shape (most) has one. A model whose layers differ (Gemma 4's global layers
have other head sizes and counts than its windowed ones) has one such tensor per shape, and a layer
that reuses another's K/V (Gemma 4's KV-shared layers) reads and writes its owner's cache, taking no
memory of its own. A layer whose values are its keys (multi-head latent attention cached as its latent,
latent.py) stores one plane instead of two: its tensor is `[layers, 1, ...]`, and its layer view repeats
that plane as both K and V. A block id means the same block in every tensor.

A sliding-window layer may instead keep only its window, in a ring of blocks per sequence slot (window_ring.py):
its K and V are then views of that ring, indexed by ring block ids, and take no block of the paged tensors.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class KvLayout(NamedTuple):
    """What a model's paged cache holds per token: per layer its `(kv_heads, head_dim)` (None: no attention),
    the layer whose K/V it reads (itself, or the earlier layer whose K/V it reuses), the layers whose
    values are their keys (one plane stored), each layer's sliding window (None: it sees every key), and the
    layers that keep only their window, in rings of blocks outside the paged tensors (window_ring.py)."""

    shapes: tuple[tuple[int, int] | None, ...]
    owners: tuple[int, ...]
    values_are_keys: frozenset[int] = frozenset()
    windows: tuple[int | None, ...] = ()
    rings: frozenset[int] = frozenset()

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block of `block_size` tokens takes across every layer that owns its K/V in the paged
        tensors (or the placeholder's, when none does)."""
        numbers = sum(planes * h * d for (h, d), planes in self.owned().values()) or 2
        return numbers * block_size * dtype.itemsize

    def owned(self) -> dict[int, tuple[tuple[int, int], int]]:
        """The shape and plane count (2: K and V, 1: values are keys) of each layer that stores K/V of its
        own in the paged tensors, by layer."""
        return {layer: (shape, 1 if layer in self.values_are_keys else 2) for layer, shape in enumerate(self.shapes)
                if shape is not None and self.owners[layer] == layer and layer not in self.rings}


class KvCache:
    """`layers[i]` is layer i's `[2, num_blocks, block_size, kv_heads, head_dim]` (K, V) view (None without
    attention); `stores[i]` is False for a layer reusing an earlier layer's K/V, which that layer has stored
    already; `values_are_keys[i]` is True for a layer whose V plane is its K plane; `rings[i]` is True for a
    layer whose K/V are ring views (`ring_views`, by owner layer), addressed by ring block ids. Block copies
    and gathers act on every paged tensor at once, never on rings."""

    def __init__(self, tensors: list[torch.Tensor], index: list[tuple[int, int] | None],
                 owners: list[int] | None = None, ring_views: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
                 ) -> None:
        self.tensors = tensors
        owners, ring_views = owners or list(range(len(index))), ring_views or {}
        self.rings = [owner in ring_views for owner in owners]
        self.layers = [ring_views[owner] if ring else None if place is None else _as_kv(tensors[place[0]][place[1]])
                       for place, owner, ring in zip(index, owners, self.rings)]
        self.values_are_keys = [place is not None and tensors[place[0]].shape[1] == 1 for place in index]
        self.stores = [owner == layer and layers is not None
                       for layer, (owner, layers) in enumerate(zip(owners, self.layers))]
        self.num_blocks, self.block_size = tensors[0].shape[2:4]

    @classmethod
    def allocate(cls, layout: KvLayout, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str, ring_views: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
                 ) -> KvCache:
        """A zeroed cache of `num_blocks` blocks for `layout`: one tensor per K/V shape and plane count, in
        layer order (a one-element placeholder when every layer keeps its window in a ring: blocks still
        bound each sequence's length); the ring layers read `ring_views`."""
        own = layout.owned()
        kinds = list(dict.fromkeys(own.values()))
        owned = [[layer for layer in own if own[layer] == kind] for kind in kinds]
        place = {layer: (t, i) for t, layers in enumerate(owned) for i, layer in enumerate(layers)}
        tensors = [torch.zeros(len(layers), planes, num_blocks, block_size, *shape, dtype=dtype, device=device)
                   for layers, (shape, planes) in zip(owned, kinds)]
        tensors = tensors or [torch.zeros(1, 2, num_blocks, block_size, 1, 1, dtype=dtype, device=device)]
        return cls(tensors, [place.get(owner) for owner in layout.owners], list(layout.owners), ring_views)

    @classmethod
    def of(cls, tensor: torch.Tensor) -> KvCache:
        """The cache over one `[layers, 2, num_blocks, block_size, kv_heads, head_dim]` tensor (tests, benchmarks)."""
        return cls([tensor], [(0, i) for i in range(tensor.shape[0])])

    @property
    def dtype(self) -> torch.dtype:
        """The K/V element type."""
        return self.tensors[0].dtype

    @property
    def device(self) -> torch.device:
        """Where the cache lives."""
        return self.tensors[0].device

    @property
    def is_cuda(self) -> bool:
        """Whether the cache is on a CUDA device."""
        return self.tensors[0].is_cuda

    @property
    def nbytes(self) -> int:
        """Bytes the cache takes."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes across every tensor."""
        return self.nbytes // self.num_blocks

    @property
    def max_kv_heads(self) -> int:
        """The most KV heads of any layer."""
        return max(kv[0].shape[-2] for kv in self.layers if kv is not None)

    @property
    def max_head_dim(self) -> int:
        """The largest head size of any layer."""
        return max(kv[0].shape[-1] for kv in self.layers if kv is not None)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the K/V of blocks `src` into blocks `dst`, in every layer."""
        for t in self.tensors:
            t.index_copy_(2, dst, t.index_select(2, src))

    def gather(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """Blocks `ids` of each tensor, block-major: `[len(ids), layers, 2, block_size, kv_heads, head_dim]`."""
        return [t.index_select(2, ids).movedim(2, 0).contiguous() for t in self.tensors]

    def scatter(self, ids: torch.Tensor, blocks: list[torch.Tensor]) -> None:
        """Write `gather`'s layout back into blocks `ids`."""
        for t, b in zip(self.tensors, blocks):
            t.index_copy_(2, ids, b.movedim(0, 2))


def _as_kv(planes: torch.Tensor) -> torch.Tensor:
    """A layer's `[2, ...]` (K, V) view of its planes: one plane (values are keys) is repeated, not copied."""
    return planes.expand(2, *planes.shape[1:])
