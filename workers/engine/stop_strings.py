"""Stop strings: which samples' newest token completes one of their `SamplingParams.stop` strings.

Only the tail of each sample is decoded, every sample of a step in one batched decode: a string in the
tail's text that the tail without its newest token lacks was completed by that token. Both decodes start
at the same token, so whatever decoding does at a cut-off start is the same in both. A tail starts with
twice as many tokens as the longest string has characters. A tail without any of the strings is decoded
only once: its text less the newest token's (decoded alone, at most one character shorter than in place)
must still hold the longest string, else (tokens of a few bytes of one character, special tokens that
decode to nothing) the tail is doubled until it does or reaches the first generated token. A tail that
starts there is read after the prompt's last tokens, as the row's text is (some tokenizers drop the leading
space of a decode's first word). No tail starts at a byte-fallback token of a UTF-8 continuation byte
(`<0x80>`..`<0xBF>`: SentencePiece's, in Llama 2, Mistral and Gemma), whose decoder would turn the whole run
of byte tokens it starts into U+FFFD, hiding a string of such characters (CJK, emoji) there. A special token
that decodes to nothing completes no string in the text, so a sample whose newest token is one is not decoded
at all; it ends its sample when its own text is one of the strings (`stop=["<|im_end|>"]`), as
`generate(stop_strings=...)` does, although the text leaves it out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from transformers import PreTrainedTokenizerBase

from workers.engine.tokenizer import CONTEXT_REACH, decode, decode_after

if TYPE_CHECKING:
    from workers.engine import sequence

# Characters of slack in a tail's text: a cut-off start decodes a split character as up to three
# replacement characters, and so does an end that the newest token completes.
_SLACK = 8


class StopStrings:
    """Which samples' newest token completes one of their stop strings, read with one tokenizer (whose special
    tokens that decode to nothing, and byte tokens that continue a character, are found once, here)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.silent = _silent_tokens(tokenizer)
        vocab = tokenizer.get_vocab()
        self.continuing = {vocab[t] for t in (f"<0x{b:02X}>" for b in range(0x80, 0xC0)) if t in vocab}

    def completed(self, samples: Sequence[tuple[Sequence[int], int]], stops: Sequence[Sequence[str]]) -> list[bool]:
        """For each sample, `(token ids, index of its first generated one)`, whether its last token completes
        one of its `stops` (in the generated text: the prompt's text never counts)."""
        longest = [max(map(len, strings)) for strings in stops]
        widths = [2 * n + _SLACK for n in longest]
        hits = [len(tokens) > start and self.silent.get(tokens[-1]) in strings
                for (tokens, start), strings in zip(samples, stops)]
        todo = [i for i, (tokens, start) in enumerate(samples) if len(tokens) > start and tokens[-1] not in self.silent]
        while todo:
            tails = [_tail(*samples[i], widths[i], self.continuing) for i in todo]
            contexts = [_context(*samples[i], tail) for i, tail in zip(todo, tails)]
            texts = decode_after(self.tokenizer, contexts + [[]] * len(tails), tails + [tail[-1:] for tail in tails])
            new, newest = texts[:len(tails)], texts[len(tails):]
            maybe = [k for k, i in enumerate(todo) if any(stop in new[k] for stop in stops[i])]
            old = dict(zip(maybe, decode_after(self.tokenizer, [contexts[k] for k in maybe],
                                               [tails[k][:-1] for k in maybe])))
            for k, i in enumerate(todo):
                if k in old:
                    hits[i] = any(stop in new[k] and stop not in old[k] for stop in stops[i])
            todo = [i for k, i in enumerate(todo) if k not in old and _too_short(
                len(new[k]) - len(newest[k]) - 1, longest[i], len(tails[k]), samples[i])]
            for i in todo:
                widths[i] *= 2
        return hits


def stopped_by_strings(stops: StopStrings | None, seqs: list[sequence.Sequence]) -> set[int]:
    """`id` of each of `seqs` whose newest token completes one of its stop strings (none without a
    tokenizer: stop strings are refused then)."""
    checked = [seq for seq in seqs if seq.group.params.stop]
    if not checked:
        return set()
    hits = stops.completed([(seq.token_ids, seq.num_prompt_tokens) for seq in checked],
                           [seq.group.params.stop for seq in checked])
    return {id(seq) for seq, hit in zip(checked, hits) if hit}


def _silent_tokens(tokenizer: PreTrainedTokenizerBase) -> dict[int, str]:
    """The text of each special token that decodes to nothing (skipped), by id: as the newest token, none
    completes a string in the text, and a run of them (EOS after EOS with `ignore_eos`) would otherwise widen the
    tail to the whole sample. Those of the added vocabulary count too, not only the named ones (Llama 3's
    `<|eom_id|>` and `<|start_header_id|>` are in no special-token attribute)."""
    texts = {i: token.content for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    for i in tokenizer.all_special_ids:
        texts.setdefault(i, tokenizer.convert_ids_to_tokens(i))
    ids = list(texts)
    return {i: texts[i] for i, text in zip(ids, decode(tokenizer, [[i] for i in ids])) if not text}


def _too_short(chars_before: int, longest: int, width: int, sample: tuple[Sequence[int], int]) -> bool:
    """Whether a tail's text before its newest token may miss the start of a string, and a wider tail exists."""
    tokens, start = sample
    return chars_before < longest + _SLACK and width < len(tokens) - start


def _tail(tokens: Sequence[int], start: int, width: int, continuing: set[int]) -> list[int]:
    """The last `width` tokens, none of the prompt's, and up to three more (a character has at most four
    bytes) while the first is one of `continuing`."""
    first = max(start, len(tokens) - width)
    floor = max(start, first - 3)
    while first > floor and tokens[first] in continuing:
        first -= 1
    return list(tokens[first:])


def _context(tokens: Sequence[int], start: int, tail: list[int]) -> list[int]:
    """The prompt's last tokens before a tail that starts at the first generated token; none before another."""
    return list(tokens[max(0, start - CONTEXT_REACH):start]) if len(tail) == len(tokens) - start else []
