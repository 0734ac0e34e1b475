"""A request group (one prompt, its sampling params) and the sequences that sample it."""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rollout.params import SamplingParams

if TYPE_CHECKING:
    from workers.engine.block_pool import BlockKey


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of `b` tokens hold `a` tokens."""
    return -(-a // b)


class Status(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass(eq=False)
class Group:
    """One `add_request` call: a prompt and the sample indices wanted from it."""

    request_id: str
    prompt_index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    prompt_hash: int
    eos_token_ids: frozenset[int]
    max_length: int  # a sample ends when it holds this many tokens (max_new_tokens, or the model's limit)
    num_unfinished: int = 0
    repeat: int = 0  # which copy of an identical prompt in its call (rollout.params.prompt_repeats)

    def noise_index(self, sample_index: int) -> int:
        """The index the sampler's noise is keyed by: copy k of a prompt draws samples k*n .. k*n + n-1."""
        return self.repeat * self.params.n + sample_index

    @functools.cached_property
    def stop_token_ids(self) -> frozenset[int]:
        """Tokens that end a sample: the model's eos (unless ignored) and the request's stop tokens."""
        return self.eos_token_ids | frozenset(self.params.stop_token_ids)

    @functools.cached_property
    def sampling_values(self) -> tuple[float, float, float, float, bool]:
        """(temperature, 0 when greedy; top_k, capped at 2**31; top_p; min_p; raw logprobs), as the
        sampler reads them each step."""
        p = self.params
        return (0.0 if p.greedy else p.temperature, min(p.top_k, 2**31), p.top_p, p.min_p,
                p.logprobs_mode == "raw")


@dataclass(eq=False)
class Sequence:
    """Tokens and KV blocks of one sample, or of a prompt not yet forked into its samples.

    Before its fork a prompt sequence carries every wanted index in `sample_indices`; each child
    carries one. `num_computed_tokens` tokens have their K/V in the cache; `block_hashes` holds the
    chained keys (`block_pool.BlockKey`: hash, parent key, tokens) of the complete blocks among them.
    """

    group: Group
    sample_indices: list[int]
    token_ids: list[int]
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[BlockKey] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    hash_root: int = 0
    num_preemptions: int = 0
    fork_blocks: list[int] = field(default_factory=list)
    cpu_blocks: list[int] = field(default_factory=list)
    cpu_state: int = -1  # the CPU pool's state slot holding an offloaded sequence's recurrent state
    row: int = -1
    long_rope: bool = False  # its KV uses a LongRoPE model's long factors (hash_roots.py)
    arrival: int = 0  # when its request was added (the scheduler's count): older sequences run first

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.group.prompt_token_ids)  # read every step: a plain attribute

    @property
    def num_generated(self) -> int:
        """Tokens sampled so far."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        """Tokens whose KV is not in the cache yet."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def started(self) -> bool:
        """Has sampled a token (a prompt still in prefill has not)."""
        return len(self.token_ids) > self.num_prompt_tokens

    @property
    def is_forked(self) -> bool:
        """True once the sequence is one sample (after its prompt forked, or n = 1)."""
        return len(self.sample_indices) == 1

    def block_tokens(self, i: int, block_size: int) -> list[int]:
        """The tokens of block `i`."""
        return self.token_ids[i * block_size:(i + 1) * block_size]

    def fork(self, sample_index: int) -> "Sequence":
        """A child with this sequence's tokens and blocks (the caller fixes refcounts and the last block)."""
        return Sequence(self.group, [sample_index], list(self.token_ids), self.status,
                        self.num_computed_tokens, list(self.block_table), list(self.block_hashes),
                        list(self.logprobs), list(self.versions), self.hash_root, self.num_preemptions,
                        long_rope=self.long_rope, arrival=self.arrival)
