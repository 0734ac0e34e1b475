"""Checks of a request before it is queued: a bad prompt, or one the cache could never hold, is
refused with an error naming it instead of failing in a step or waiting forever."""

from __future__ import annotations

import numbers
import operator

import torch
import transformers

from rollout.config import EngineConfig
from rollout.params import SamplingParams, check_prompt_list
from workers.engine.seq_blocks import fork_spare_blocks
from workers.engine.sequence import cdiv
from workers.engine.stop_strings import StopStrings
from workers.engine.tokenizer import encode_prompt


def encode_prompts(prompts: object, tokenizer: transformers.PreTrainedTokenizerBase | None, no_tokenizer: str,
                   vocab_size: int, max_model_len: int) -> list[list[int]]:
    """Token ids of each prompt, validated; strings need the model's tokenizer (`no_tokenizer` says why there
    is none)."""
    check_prompt_list(prompts)
    out = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ValueError(f"prompt {i} is a string, but {no_tokenizer}")
            prompt = _encoded(i, tokenizer, prompt)
        out.append(check_prompt(i, prompt, vocab_size, max_model_len))
    return out


def _encoded(index: int, tokenizer: transformers.PreTrainedTokenizerBase, text: str) -> list[int]:
    """`text`'s token ids; a text the tokenizer refuses (a lone surrogate, as `errors="surrogateescape"` leaves)
    is a ValueError naming the prompt, where the tokenizer's own error is a TypeError that names none."""
    try:
        return encode_prompt(tokenizer, text)
    except (TypeError, ValueError, UnicodeError) as err:
        raise ValueError(f"prompt {index} cannot be encoded by the tokenizer: {err}") from None


def check_prompt(index: int, prompt: object, vocab_size: int, max_model_len: int) -> list[int]:
    """Prompt `index` as a list of ints (lists, tuples, numpy arrays and tensors of integers)."""
    ids = prompt.tolist() if hasattr(prompt, "tolist") else prompt
    if isinstance(ids, str):  # `encode_prompts` encodes strings first: this is `add_request`'s
        raise ValueError(f"prompt {index} is a string; add_request takes token ids (generate() encodes strings "
                         "with the model's tokenizer)")
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"prompt {index} must be a string or a list of token ids, got {type(prompt).__name__}")
    if not ids:
        raise ValueError(f"prompt {index} is empty")
    ids = [_token_id(index, token, vocab_size) for token in ids]
    if len(ids) >= max_model_len:
        raise ValueError(f"prompt {index} has {len(ids)} tokens; the model's maximum length is "
                         f"{max_model_len} (prompt + at least one generated token)")
    return ids


def _token_id(index: int, token: object, vocab_size: int) -> int:
    """`token` of prompt `index` as an int (numpy and torch integer scalars too: they convert losslessly);
    ValueError unless it is an integer in the vocabulary."""
    not_scalar = isinstance(token, torch.Tensor) and (token.dim() != 0 or token.dtype == torch.bool)
    try:
        token_id = None if isinstance(token, bool) or not_scalar else operator.index(token)
    except (TypeError, RuntimeError):  # RuntimeError: a tensor without values (meta)
        token_id = None
    if token_id is None:
        raise ValueError(f"prompt {index} has {token!r}, which is not an integer token id")
    if not 0 <= token_id < vocab_size:
        raise ValueError(f"prompt {index} has token id {token!r} outside the vocabulary [0, {vocab_size})")
    return token_id


def check_sample_indices(sample_indices: object, n: int) -> list[int]:
    """The wanted sample indices, sorted: all of `range(n)` when None, else a non-empty set of integers in it."""
    if sample_indices is None:
        return list(range(n))
    given = sample_indices.tolist() if hasattr(sample_indices, "tolist") else sample_indices  # numpy, torch
    indices = list(given) if isinstance(given, (list, tuple, set, range)) else []
    if not indices or not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) and 0 <= i < n
                              for i in indices):
        raise ValueError(f"sample_indices={sample_indices!r} must be a non-empty subset of range({n})")
    return sorted({int(i) for i in indices})


def check_params(params: object, vocab_size: int, stops: StopStrings | None, no_tokenizer: str) -> None:
    """Refuse sampling parameters that are not a valid `SamplingParams` (validated again: a field may have been
    set since it was built), whose stop tokens the model could never produce, or stop strings without a
    tokenizer to read them with (`stops` None, `no_tokenizer` saying why) or that hold a special token beside
    other text: the text leaves special tokens out, so such a string would never be found."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__} {params!r:.60}")
    params.__post_init__()
    outside = [t for t in params.stop_token_ids if t >= vocab_size]
    if outside:
        raise ValueError(f"stop_token_ids has {outside[0]}, outside the vocabulary [0, {vocab_size})")
    if params.stop and stops is None:
        raise ValueError(f"stop={params.stop!r} needs the model's tokenizer, but {no_tokenizer} (stop_token_ids "
                         "work without one)")
    for stop in params.stop:
        special = next((t for t in stops.silent.values() if t in stop and t != stop), None)
        if special is not None:
            raise ValueError(f"stop={stop!r} holds the special token {special!r}, which the text leaves out, so it "
                             "would never be found; stop on the token alone, or pass its id in stop_token_ids")


def check_repeat(repeat: object) -> None:
    """Refuse a `repeat` (which copy of an identical prompt of its call a request is) that is no integer >= 0."""
    if not isinstance(repeat, int) or isinstance(repeat, bool) or repeat < 0:
        raise ValueError(f"repeat={repeat!r} must be an integer >= 0")


def check_fits(config: EngineConfig, num_blocks: int, max_model_len: int, index: int, prompt_len: int,
               params: SamplingParams, num_samples: int) -> None:
    """Refuse `num_samples` samples of prompt `index` that a cache of `num_blocks` blocks or `max_num_seqs`
    could never hold."""
    if num_samples > config.max_num_seqs:
        raise ValueError(f"prompt {index}: {num_samples} samples of one prompt exceed "
                         f"max_num_seqs={config.max_num_seqs}")
    bs = config.block_size
    longest = min(prompt_len + params.max_new_tokens, max_model_len) - 1
    need = max(cdiv(longest, bs), cdiv(prompt_len, bs) + fork_spare_blocks(prompt_len, num_samples, bs))
    if need > num_blocks:
        raise ValueError(
            f"prompt {index} ({prompt_len} tokens) with max_new_tokens={params.max_new_tokens} and "
            f"{num_samples} samples needs {need} blocks of {bs} tokens; the cache has {num_blocks} "
            f"(num_blocks={config.num_blocks})")
