"""Roots of the prefix cache's block hash chains.

A block's hash chains from its sequence's root, so KV is matched only under the root it was computed
with: a fresh root after every weights update, and, for LongRoPE models, a root of its own for sequences
past the switch length (their KV uses the long RoPE factors).
"""

from __future__ import annotations

from workers.engine.block_pool import hash_block
from workers.engine.sequence import Sequence


class HashRoots:
    """Hands each sequence its hash root and tells which sequences crossed the LongRoPE switch."""

    def __init__(self, rope_switch_length: int | None) -> None:
        self.rope_switch_length = rope_switch_length
        self.weights_updates = 0
        self.root = 0

    def weights_changed(self) -> None:
        """Root later prompts' prefix hashes afresh, so that KV computed under earlier weights is never
        matched, even when a weights version number comes back (a trainer resuming or rolling back)."""
        self.weights_updates += 1
        self.root = hash_block(0, [-2, self.weights_updates])  # no block of token ids hashes this

    def assign(self, seq: Sequence) -> None:
        """Give `seq` its root: the weights update's, or its long-RoPE child when `seq` is past the switch."""
        seq.long_rope = self.rope_switch_length is not None and len(seq.token_ids) > self.rope_switch_length
        seq.hash_root = hash_block(self.root, [-1]) if seq.long_rope else self.root

    def crossed_switch(self, seq: Sequence) -> bool:
        """True when `seq` has KV computed with the short RoPE factors but its tokens now go past the
        switch length: like `generate`, its whole KV must be recomputed with the long factors."""
        switch = self.rope_switch_length
        return (switch is not None and seq.num_computed_tokens > 0 and len(seq.token_ids) > switch
                and not seq.long_rope)
