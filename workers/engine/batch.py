"""What one step computes and copies."""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.engine.sequence import Sequence


@dataclass
class Batch:
    """`num_tokens[i]` new tokens of `seqs[i]`, the first `num_decodes` of them decodes, after copying
    device blocks to the CPU pool (`offload_copies`: (device, cpu) pairs) and then back
    (`restore_copies`: (cpu, device) pairs); for a model with recurrent state, also each offloaded
    sequence's state (`state_offloads`: (row, state slot) pairs) and each restored one's
    (`state_restores`: (state slot, sequence) pairs, the sequence's row taken at the copy)."""

    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    offload_copies: list[tuple[int, int]] = field(default_factory=list)
    restore_copies: list[tuple[int, int]] = field(default_factory=list)
    state_offloads: list[tuple[int, int]] = field(default_factory=list)
    state_restores: list[tuple[int, Sequence]] = field(default_factory=list)
    num_decodes: int = 0

    def add(self, seq: Sequence, n: int) -> None:
        """Compute `n` more tokens of `seq` in this step."""
        self.seqs.append(seq)
        self.num_tokens.append(n)

    def samplers(self) -> list[Sequence]:
        """The sequences whose last token this step computes (every decode, and prefills that end), in
        the order of its sampling rows (each has one per wanted sample); read before the step is counted in."""
        d = self.num_decodes
        return self.seqs[:d] + [seq for seq, n in zip(self.seqs[d:], self.num_tokens[d:])
                                if seq.num_computed_tokens + n == len(seq.token_ids)]
