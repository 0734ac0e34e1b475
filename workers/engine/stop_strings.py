"""Stop strings: whether a sample's newest token completes one of its `SamplingParams.stop` strings.

Only the tail of the sample is decoded (enough tokens for the longest string, each token giving at least
one character, with room for byte-level tokens that give part of one): a string in the tail's text that
the tail without its newest token lacks was completed by that token. Both decodes start at the same
token, so whatever decoding does at a cut-off start is the same in both.
"""

from __future__ import annotations

from typing import Sequence

from transformers import PreTrainedTokenizerBase


def completes_stop(tokenizer: PreTrainedTokenizerBase, generated: Sequence[int], stops: Sequence[str]) -> bool:
    """Whether the last token of `generated` completes one of `stops` in the text the tokens decode to."""
    tail = list(generated[-(2 * max(map(len, stops)) + 8):])
    new = tokenizer.decode(tail, skip_special_tokens=True)
    if not any(stop in new for stop in stops):
        return False
    old = tokenizer.decode(tail[:-1], skip_special_tokens=True)
    return any(stop in new and stop not in old for stop in stops)
