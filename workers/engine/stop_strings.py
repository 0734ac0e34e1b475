"""Stop strings: which samples' newest token completes one of their `SamplingParams.stop` strings.

Only the tail of each sample is decoded (enough tokens for its longest string, each token giving at least
one character, with room for byte-level tokens that give part of one), every sample of a step in one
batched decode: a string in the tail's text that the tail without its newest token lacks was completed by
that token. Both decodes start at the same token, so whatever decoding does at a cut-off start is the
same in both.
"""

from __future__ import annotations

from typing import Sequence

from transformers import PreTrainedTokenizerBase


def stops_completed(tokenizer: PreTrainedTokenizerBase, samples: Sequence[tuple[Sequence[int], int]],
                    stops: Sequence[Sequence[str]]) -> list[bool]:
    """For each sample, `(token ids, index of its first generated one)`, whether its last token completes one
    of its `stops` (in the generated text: the prompt's text never counts)."""
    tails = [list(tokens[max(start, len(tokens) - 2 * max(map(len, strings)) - 8):])
             for (tokens, start), strings in zip(samples, stops)]
    new = _decode(tokenizer, tails)
    maybe = [i for i, text in enumerate(new) if any(stop in text for stop in stops[i])]
    old = _decode(tokenizer, [tails[i][:-1] for i in maybe])
    hits = [False] * len(tails)
    for i, text in zip(maybe, old):
        hits[i] = any(stop in new[i] and stop not in text for stop in stops[i])
    return hits


def _decode(tokenizer: PreTrainedTokenizerBase, batch: list[list[int]]) -> list[str]:
    """The texts `tokenizer.batch_decode` gives (special tokens skipped), in one call of a fast tokenizer's
    Rust backend when decoding adds nothing to it (no clean-up of spaces): a third of the time."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return backend.decode_batch(batch, skip_special_tokens=True)
    return tokenizer.batch_decode(batch, skip_special_tokens=True)
