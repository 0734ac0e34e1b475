"""A sequence's blocks: those a step adds to it, those a prompt reserves for its fork, and those the fork's
children share with their prompt."""

from __future__ import annotations

from workers.engine.block_pool import BlockPool
from workers.engine.sequence import Sequence, cdiv


def fork_spare_blocks(num_tokens: int, num_samples: int, block_size: int) -> int:
    """Blocks a prompt of `num_tokens` reserves for its fork into `num_samples`: a copy of its
    partial last block for every child but the first (none when the last block is complete)."""
    return num_samples - 1 if num_tokens % block_size else 0


def blocks_needed(seq: Sequence, n: int, block_size: int) -> int:
    """The blocks `seq` needs beyond those it holds to compute its next `n` tokens."""
    return max(0, cdiv(seq.num_computed_tokens + n, block_size) - len(seq.block_table))


def growing_decodes(decodes: list[Sequence], block_size: int) -> list[Sequence]:
    """The decoding sequences whose next token starts a new block (`blocks_needed(seq, 1) > 0`, written
    out: it runs for every decode of every step)."""
    return [seq for seq in decodes if seq.num_computed_tokens >= len(seq.block_table) * block_size]


def share_blocks(pool: BlockPool, seq: Sequence, children: list[Sequence]) -> list[tuple[int, int]]:
    """New children share the parent's complete blocks and each get a copy of its partial last
    block (the parent keeps the original); returns the (src, dst) block copies to make."""
    copies = []
    spare, seq.fork_blocks = seq.fork_blocks, []
    num_full = len(seq.block_table) - (1 if spare else 0)
    for child in children:
        full = child.block_table[:num_full]
        for block in full:
            pool.share(block)
        if spare:
            dst = spare.pop()
            copies.append((child.block_table[-1], dst))
            child.block_table = full + [dst]
    return copies
